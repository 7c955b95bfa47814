"""Wire messages of the coordinator: typed dataclasses, protobuf on the wire, strict validation.

The schema is ``coordinator.proto`` (package ``diloco.coordinator.v1``); its generated code,
``coordinator_pb2``, is committed (``python -m diloco.coordinator.protogen`` regenerates it).
The dataclasses below are what the coordinator's logic consumes and produces; the edge converts:
``encode`` builds the protobuf message (``to_pb``) and ``decode`` parses one (``from_pb``).

``decode`` never trusts its input: size, protobuf syntax, UTF-8, unknown fields (and fields sent
with the wrong wire type), missing required fields, ranges, patterns and the limits of the
free-form trees are checked, and any mismatch raises :class:`MessageError` naming the field,
which the server answers with INVALID_ARGUMENT. Each message is first turned into the dict of its
fields (``to_obj``/``from_obj``: the shape of its JSON form, group ids as string keys), which one
validator per message checks. Non-finite floats (``NaN``, ``Infinity``) are accepted in progress,
summaries and ``delta_norm``: a NaN loss is a fact worth reporting.

The field checks are in ``fields.py``, the conversion between protobuf and those dicts in
``pbconvert.py``; ``message_base.py`` the base class; this module holds the membership, progress and plan messages
(``quorum_messages.py`` the fault-tolerance ones, re-exported here) and the service's table of RPCs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from google.protobuf import message as pb_message

from . import coordinator_pb2 as pb
from .fields import (_HASH_RE, MAX_GROUP_SIZE, MAX_GROUPS, MAX_HASH_CHARS, MAX_INT64, MAX_TAG_CHARS, MessageError,
                     _bool, _check_fields, _flat_dict, _incarnation, _int, _json_tree, _members, _opt_str, _rates,
                     _reason, _setting, _str, _type_name, check_address)
from .message_base import MAX_REQUEST_BYTES, MAX_SUMMARY_BYTES, Message
from .quorum_messages import (CommitRequest, CommitResponse, OfferQuery, QuorumRequest, QuorumResponse, StateOffer,
                              StopRequest)

__all__ = ["MAX_REQUEST_BYTES", "MAX_SUMMARY_BYTES", "Message", "MessageError", "JoinRequest", "JoinResponse",
           "HeartbeatRequest", "HeartbeatResponse", "ProgressRequest", "RoundRequest", "SummaryRequest", "Ping",
           "Ack", "BandwidthRequest", "PlanRequest", "PlanResponse", "QuorumRequest", "QuorumResponse",
           "CommitRequest", "CommitResponse", "StateOffer", "OfferQuery", "StopRequest", "RPCS", "SERVICE"]


@dataclass(frozen=True)
class JoinRequest(Message):
    """A rank announces itself: its group, its rank in the group, the group's size, and the
    data-plane address ``host:port`` other groups will dial."""

    PB: ClassVar[type[pb_message.Message]] = pb.JoinRequest

    group: int
    rank: int
    group_size: int
    address: str
    incarnation: str = ""  # the same for every rank of one start of the group; new after a restart
    exchange: int = -1  # -1: a new member; >= 0: rejoining a restarted coordinator at this exchange
    resume_step: int = -1  # the newest checkpoint step the group may resume from at the job's start (-1: none)
    resume_exact: bool = False  # that step was named: the job starts only if every group names it

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> JoinRequest:
        _check_fields(obj, "JoinRequest", ("group", "rank", "group_size", "address"),
                      ("incarnation", "exchange", "resume_step", "resume_exact"))
        size = _int(obj["group_size"], "group_size", 1, MAX_GROUP_SIZE)
        return cls(
            group=_int(obj["group"], "group", 0, MAX_GROUPS - 1),
            rank=_int(obj["rank"], "rank", 0, size - 1),
            group_size=size,
            address=check_address(obj["address"]),
            incarnation=_incarnation(obj.get("incarnation", "")),
            exchange=_int(obj.get("exchange", -1), "exchange", -1, MAX_INT64),
            resume_step=_int(obj.get("resume_step", -1), "resume_step", -1, MAX_INT64),
            resume_exact=_bool(obj.get("resume_exact", False), "resume_exact"),
        )

    def to_obj(self) -> dict[str, Any]:
        return {"group": self.group, "rank": self.rank, "group_size": self.group_size,
                "address": self.address, "incarnation": self.incarnation, "exchange": self.exchange,
                "resume_step": self.resume_step, "resume_exact": self.resume_exact}


@dataclass(frozen=True)
class JoinResponse(Message):
    """The complete membership: addresses by rank for every group, ring order, epoch."""

    PB: ClassVar[type[pb_message.Message]] = pb.JoinResponse

    epoch: int
    members: dict[int, tuple[str, ...]]
    ring_order: tuple[int, ...]
    heal: bool = False  # the job is under way: this group fetches its state before it takes part
    setting: str = ""  # --codec/--h auto: the setting (a row of the study's table) of the latest quorum
    resume_step: int = -1  # the checkpoint step the job started from (-1: none)

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> JoinResponse:
        _check_fields(obj, "JoinResponse", ("epoch", "members", "ring_order"), ("heal", "setting", "resume_step"))
        members = _members(obj["members"], "members")
        ring = obj["ring_order"]
        if not isinstance(ring, list) or any(type(g) is not int for g in ring):
            raise MessageError("ring_order: expected a list of group ids")
        if sorted(ring) != sorted(members):
            raise MessageError(f"ring_order {ring} is not a permutation of {sorted(members)}")
        return cls(epoch=_int(obj["epoch"], "epoch", 1, MAX_INT64), members=members,
                   ring_order=tuple(ring), heal=_bool(obj.get("heal", False), "heal"),
                   setting=_setting(obj.get("setting", "")),
                   resume_step=_int(obj.get("resume_step", -1), "resume_step", -1, MAX_INT64))

    def to_obj(self) -> dict[str, Any]:
        return {"epoch": self.epoch,
                "members": {str(g): list(a) for g, a in sorted(self.members.items())},
                "ring_order": list(self.ring_order), "heal": self.heal, "setting": self.setting,
                "resume_step": self.resume_step}


@dataclass(frozen=True)
class HeartbeatRequest(Message):
    """A rank is alive at inner step ``step``."""

    PB: ClassVar[type[pb_message.Message]] = pb.HeartbeatRequest

    group: int
    rank: int
    step: int
    incarnation: str = ""
    quorum: str = ""  # the quorum whose rings this rank runs now ("": none)

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> HeartbeatRequest:
        _check_fields(obj, "HeartbeatRequest", ("group", "rank", "step"), ("incarnation", "quorum"))
        return cls(group=_int(obj["group"], "group", 0, MAX_GROUPS - 1),
                   rank=_int(obj["rank"], "rank", 0, MAX_GROUP_SIZE - 1),
                   step=_int(obj["step"], "step", 0, MAX_INT64),
                   incarnation=_incarnation(obj.get("incarnation", "")),
                   quorum=_opt_str(obj.get("quorum", ""), "quorum", MAX_TAG_CHARS, _HASH_RE))

    def to_obj(self) -> dict[str, Any]:
        return {"group": self.group, "rank": self.rank, "step": self.step, "incarnation": self.incarnation,
                "quorum": self.quorum}


@dataclass(frozen=True)
class HeartbeatResponse(Message):
    """Reply to a heartbeat: the membership epoch, and ``quorum_lost``: why the quorum the
    heartbeat named can no longer commit (a member failed or started again, or it was rolled
    back), so that the rank aborts its rings now instead of at their deadline; "" otherwise."""

    PB: ClassVar[type[pb_message.Message]] = pb.HeartbeatResponse

    epoch: int
    quorum_lost: str = ""

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> HeartbeatResponse:
        _check_fields(obj, "HeartbeatResponse", ("epoch",), ("quorum_lost",))
        return cls(epoch=_int(obj["epoch"], "epoch", 0, MAX_INT64),
                   quorum_lost=_reason(obj.get("quorum_lost", ""), "quorum_lost"))

    def to_obj(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "quorum_lost": self.quorum_lost}


@dataclass(frozen=True)
class ProgressRequest(Message):
    """Latest progress of a rank: a flat dict (step, loss, tokens_per_s, bytes_sent, round, H ...)."""

    PB: ClassVar[type[pb_message.Message]] = pb.ProgressRequest

    group: int
    rank: int
    progress: dict[str, int | float | str | bool]

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> ProgressRequest:
        _check_fields(obj, "ProgressRequest", ("group", "rank", "progress"))
        return cls(group=_int(obj["group"], "group", 0, MAX_GROUPS - 1),
                   rank=_int(obj["rank"], "rank", 0, MAX_GROUP_SIZE - 1),
                   progress=_flat_dict(obj["progress"], "progress"))

    def to_obj(self) -> dict[str, Any]:
        return {"group": self.group, "rank": self.rank, "progress": dict(self.progress)}


@dataclass(frozen=True)
class RoundRequest(Message):
    """A group committed outer round ``round``; ``param_hash`` digests its global parameters."""

    PB: ClassVar[type[pb_message.Message]] = pb.RoundRequest

    group: int
    round: int
    param_hash: str

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> RoundRequest:
        _check_fields(obj, "RoundRequest", ("group", "round", "param_hash"))
        return cls(group=_int(obj["group"], "group", 0, MAX_GROUPS - 1),
                   round=_int(obj["round"], "round", 0, MAX_INT64),
                   param_hash=_str(obj["param_hash"], "param_hash", MAX_HASH_CHARS, _HASH_RE))

    def to_obj(self) -> dict[str, Any]:
        return {"group": self.group, "round": self.round, "param_hash": self.param_hash}


@dataclass(frozen=True)
class SummaryRequest(Message):
    """A group's final summary: any JSON tree up to MAX_SUMMARY_BYTES and MAX_SUMMARY_DEPTH."""

    PB: ClassVar[type[pb_message.Message]] = pb.SummaryRequest
    LIMIT: ClassVar[int] = MAX_SUMMARY_BYTES

    group: int
    summary: dict[str, Any]

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> SummaryRequest:
        _check_fields(obj, "SummaryRequest", ("group", "summary"))
        summary = obj["summary"]
        if not isinstance(summary, dict):
            raise MessageError(f"summary: expected an object, got {_type_name(summary)}")
        return cls(group=_int(obj["group"], "group", 0, MAX_GROUPS - 1),
                   summary=_json_tree(summary, "summary"))

    def to_obj(self) -> dict[str, Any]:
        return {"group": self.group, "summary": self.summary}


@dataclass(frozen=True)
class Ping(Message):
    """An empty request: is the coordinator there, and does it accept our token?"""

    PB: ClassVar[type[pb_message.Message]] = pb.PingRequest

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Ping:
        _check_fields(obj, "Ping", ())
        return cls()

    def to_obj(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class Ack(Message):
    """Reply to pings and reports: the current membership epoch (0 before the quorum)."""

    PB: ClassVar[type[pb_message.Message]] = pb.Ack

    epoch: int

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Ack:
        _check_fields(obj, "Ack", ("epoch",))
        return cls(epoch=_int(obj["epoch"], "epoch", 0, MAX_INT64))

    def to_obj(self) -> dict[str, Any]:
        return {"epoch": self.epoch}


@dataclass(frozen=True)
class BandwidthRequest(Message):
    """What one rank measured towards each other group: bytes/s by group id."""

    PB: ClassVar[type[pb_message.Message]] = pb.BandwidthRequest

    group: int
    rank: int
    rates: dict[int, float]

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> BandwidthRequest:
        _check_fields(obj, "BandwidthRequest", ("group", "rank", "rates"))
        return cls(group=_int(obj["group"], "group", 0, MAX_GROUPS - 1),
                   rank=_int(obj["rank"], "rank", 0, MAX_GROUP_SIZE - 1),
                   rates=_rates(obj["rates"], "rates"))

    def to_obj(self) -> dict[str, Any]:
        return {"group": self.group, "rank": self.rank,
                "rates": {str(g): r for g, r in sorted(self.rates.items())}}


@dataclass(frozen=True)
class PlanRequest(Message):
    """Which bandwidth table governs exchange number ``exchange`` (0, 1, 2, ... per job)."""

    PB: ClassVar[type[pb_message.Message]] = pb.PlanRequest

    exchange: int

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> PlanRequest:
        _check_fields(obj, "PlanRequest", ("exchange",))
        return cls(exchange=_int(obj["exchange"], "exchange", 0, MAX_INT64))

    def to_obj(self) -> dict[str, Any]:
        return {"exchange": self.exchange}


@dataclass(frozen=True)
class PlanResponse(Message):
    """A versioned bandwidth table: ``table[group][rank]`` = that rank's rates by peer group.

    Version 0 is the empty table (no measurements yet): every rank plans with equal bandwidths.
    """

    PB: ClassVar[type[pb_message.Message]] = pb.PlanResponse
    LIMIT: ClassVar[int] = MAX_SUMMARY_BYTES

    version: int
    table: dict[int, dict[int, dict[int, float]]]

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> PlanResponse:
        _check_fields(obj, "PlanResponse", ("version", "table"))
        raw = obj["table"]
        if not isinstance(raw, dict):
            raise MessageError("table: expected an object")
        table: dict[int, dict[int, dict[int, float]]] = {}
        for gkey, ranks in raw.items():
            if not (isinstance(gkey, str) and gkey.isdigit()) or not isinstance(ranks, dict):
                raise MessageError(f"table: bad group entry {gkey!r}")
            g = _int(int(gkey), "table group", 0, MAX_GROUPS - 1)
            table[g] = {}
            for rkey, rates in ranks.items():
                if not (isinstance(rkey, str) and rkey.isdigit()):
                    raise MessageError(f"table[{g}]: bad rank key {rkey!r}")
                table[g][_int(int(rkey), "table rank", 0, MAX_GROUP_SIZE - 1)] = _rates(rates, f"table[{g}][{rkey}]")
        return cls(version=_int(obj["version"], "version", 0, MAX_INT64), table=table)

    def to_obj(self) -> dict[str, Any]:
        return {"version": self.version,
                "table": {str(g): {str(r): {str(h): x for h, x in sorted(rates.items())}
                                   for r, rates in sorted(ranks.items())}
                          for g, ranks in sorted(self.table.items())}}


# --- the service ------------------------------------------------------------------------------

_SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]
SERVICE = _SERVICE.full_name  # "diloco.coordinator.v1.Coordinator"
_BY_PB: dict[str, type[Message]] = {cls.PB.DESCRIPTOR.full_name: cls for cls in (
    Ping, Ack, JoinRequest, JoinResponse, HeartbeatRequest, HeartbeatResponse, ProgressRequest, RoundRequest,
    SummaryRequest, BandwidthRequest, PlanRequest, PlanResponse, QuorumRequest, QuorumResponse, CommitRequest,
    CommitResponse, StateOffer, OfferQuery, StopRequest)}
RPCS: dict[str, tuple[type[Message], type[Message]]] = {
    method.name: (_BY_PB[method.input_type.full_name], _BY_PB[method.output_type.full_name])
    for method in _SERVICE.methods}
"""Every RPC of ``coordinator.proto``: name -> (request message, reply message)."""
