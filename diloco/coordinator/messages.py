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
``pbconvert.py``; this module holds the messages themselves and the service's table of RPCs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from google.protobuf import message as pb_message

from . import coordinator_pb2 as pb
from .fields import (_HASH_RE, _HEX64_RE, MAX_GROUP_SIZE, MAX_GROUPS, MAX_HASH_CHARS, MAX_INT64, MAX_NUMEL,
                     MAX_TAG_CHARS, MessageError, _bool, _by_group, _check_fields, _flat_dict, _float, _groups,
                     _incarnation, _int, _json_tree, _members, _opt_str, _rates, _reason, _setting, _str, _type_name,
                     check_address)
from .pbconvert import _fill, _parse, _pb_to_obj

MAX_REQUEST_BYTES = 64 * 1024  # every message but summaries
MAX_SUMMARY_BYTES = 1024 * 1024

M = TypeVar("M", bound="Message")


class Message:
    """Base of all wire messages: ``encode`` to protobuf bytes, ``decode`` with validation."""

    LIMIT: ClassVar[int] = MAX_REQUEST_BYTES  # bytes of the encoded message
    PB: ClassVar[type[pb_message.Message]]  # its protobuf message class

    @classmethod
    def from_obj(cls: type[M], obj: dict[str, Any]) -> M:
        """Validate the dict of fields (the message's JSON shape) and build the message."""
        raise NotImplementedError

    def to_obj(self) -> dict[str, Any]:
        """The dict of fields (the message's JSON shape, group ids as string keys)."""
        raise NotImplementedError

    @classmethod
    def from_pb(cls: type[M], msg: pb_message.Message) -> M:
        """Validate a protobuf message of type ``PB``; raises MessageError."""
        if msg.DESCRIPTOR.full_name != cls.PB.DESCRIPTOR.full_name:
            raise MessageError(f"{cls.__name__}: expected {cls.PB.DESCRIPTOR.full_name}, "
                               f"got {msg.DESCRIPTOR.full_name}")
        try:
            obj = _pb_to_obj(msg, "")
        except RecursionError:
            raise MessageError(f"{cls.__name__}: nested too deeply") from None
        return cls.from_obj(obj)

    def to_pb(self) -> pb_message.Message:
        """The protobuf message (not validated: ``encode`` is)."""
        msg = self.PB()
        try:
            _fill(msg, self.to_obj(), "")
        except MessageError as exc:
            raise MessageError(f"{type(self).__name__}: {exc}") from None
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise MessageError(f"{type(self).__name__}: cannot encode ({exc})") from None
        return msg

    @classmethod
    def decode(cls: type[M], data: bytes) -> M:
        """Parse and validate ``data``; raises MessageError."""
        return cls.from_pb(_parse(cls.PB, data, cls.LIMIT, cls.__name__))

    def encode(self) -> bytes:
        """Serialize and check the result against the same rules the receiver applies."""
        data = self.to_pb().SerializeToString()
        type(self).decode(data)
        return data


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

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> JoinRequest:
        _check_fields(obj, "JoinRequest", ("group", "rank", "group_size", "address"),
                      ("incarnation", "exchange"))
        size = _int(obj["group_size"], "group_size", 1, MAX_GROUP_SIZE)
        return cls(
            group=_int(obj["group"], "group", 0, MAX_GROUPS - 1),
            rank=_int(obj["rank"], "rank", 0, size - 1),
            group_size=size,
            address=check_address(obj["address"]),
            incarnation=_incarnation(obj.get("incarnation", "")),
            exchange=_int(obj.get("exchange", -1), "exchange", -1, MAX_INT64),
        )

    def to_obj(self) -> dict[str, Any]:
        return {"group": self.group, "rank": self.rank, "group_size": self.group_size,
                "address": self.address, "incarnation": self.incarnation, "exchange": self.exchange}


@dataclass(frozen=True)
class JoinResponse(Message):
    """The complete membership: addresses by rank for every group, ring order, epoch."""

    PB: ClassVar[type[pb_message.Message]] = pb.JoinResponse

    epoch: int
    members: dict[int, tuple[str, ...]]
    ring_order: tuple[int, ...]
    heal: bool = False  # the job is under way: this group fetches its state before it takes part
    setting: str = ""  # --codec/--h auto: the setting (a row of the study's table) of the latest quorum

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> JoinResponse:
        _check_fields(obj, "JoinResponse", ("epoch", "members", "ring_order"), ("heal", "setting"))
        members = _members(obj["members"], "members")
        ring = obj["ring_order"]
        if not isinstance(ring, list) or any(type(g) is not int for g in ring):
            raise MessageError("ring_order: expected a list of group ids")
        if sorted(ring) != sorted(members):
            raise MessageError(f"ring_order {ring} is not a permutation of {sorted(members)}")
        return cls(epoch=_int(obj["epoch"], "epoch", 1, MAX_INT64), members=members,
                   ring_order=tuple(ring), heal=_bool(obj.get("heal", False), "heal"),
                   setting=_setting(obj.get("setting", "")))

    def to_obj(self) -> dict[str, Any]:
        return {"epoch": self.epoch,
                "members": {str(g): list(a) for g, a in sorted(self.members.items())},
                "ring_order": list(self.ring_order), "heal": self.heal, "setting": self.setting}


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


# --- fault tolerance: quorum per exchange, commit vote, healing, stop ------------------------------

@dataclass(frozen=True)
class QuorumRequest(Message):
    """A rank is about to run ``exchange`` (-1: it needs the job's state and joins the next one).

    Rank 0's ``state_hash`` (hash of its group's global state before the exchange, "" to skip the
    comparison) and ``delta_norm`` (its contribution's L2 norm; NaN/Inf allowed: a non-finite
    contribution, which is rejected) are compared and screened; ``weight`` is what the group
    contributed since its last exchange (tokens). ``retry``: a repeat of a rolled-back exchange.
    ``healable``: healers may join it (a fragment sync, not a control exchange). ``setting``: with
    ``--codec auto`` / ``--h auto``, the setting (a row of the study's table) whose codec the
    exchange runs ("" without auto), handed to healers in the quorum's response.
    """

    PB: ClassVar[type[pb_message.Message]] = pb.QuorumRequest

    group: int
    rank: int
    incarnation: str
    exchange: int
    tag: str = ""
    numel: int = 0
    weight: float = 0.0
    state_hash: str = ""
    delta_norm: float = 0.0
    retry: bool = False
    healable: bool = True  # healers may join this exchange (not a control exchange)
    setting: str = ""
    weight_cap: float = 0.0  # the most tokens one rank can contribute to one exchange (0: none said)

    FIELDS: ClassVar[tuple[str, ...]] = ("group", "rank", "incarnation", "exchange", "tag", "numel",
                                         "weight", "state_hash", "delta_norm", "retry", "healable", "setting",
                                         "weight_cap")

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> QuorumRequest:
        _check_fields(obj, "QuorumRequest", cls.FIELDS[:-2], ("setting", "weight_cap"))
        return cls(group=_int(obj["group"], "group", 0, MAX_GROUPS - 1),
                   rank=_int(obj["rank"], "rank", 0, MAX_GROUP_SIZE - 1),
                   incarnation=_incarnation(obj["incarnation"]),
                   exchange=_int(obj["exchange"], "exchange", -1, MAX_INT64),
                   tag=_opt_str(obj["tag"], "tag", MAX_TAG_CHARS, _HASH_RE),
                   numel=_int(obj["numel"], "numel", 0, MAX_NUMEL),
                   weight=_float(obj["weight"], "weight", lo=0.0),
                   state_hash=_opt_str(obj["state_hash"], "state_hash", MAX_HASH_CHARS, _HASH_RE),
                   delta_norm=_float(obj["delta_norm"], "delta_norm", finite=False),
                   retry=_bool(obj["retry"], "retry"), healable=_bool(obj["healable"], "healable"),
                   setting=_setting(obj.get("setting", "")),
                   weight_cap=_float(obj.get("weight_cap", 0.0), "weight_cap", lo=0.0))

    def to_obj(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.FIELDS}


@dataclass(frozen=True)
class QuorumResponse(Message):
    """The quorum of one attempt at one exchange (see ``diloco.coordinator.rounds.Quorum``), with
    the members' data-plane addresses. ``evicted``: why the caller's group must stop and heal ("" if
    not). ``stop``: the job asked every group to checkpoint and stop after this exchange.
    ``finished``: nothing to heal into, the job's groups have finished. ``setting``: the auto
    setting the members asked with ("" without auto). ``left_out``: live groups the grace window
    left out, with their addresses (the donor serves each the committed mean). ``catch_up``: the
    caller's group was left out of this quorum, which committed: it fetches the mean from
    ``donor`` and applies it at weight 0. ``disagreement``: the members differ with no majority
    (why): nothing formed, ask again. ``halted``: the job halted (why): stop, no restart mends it."""

    PB: ClassVar[type[pb_message.Message]] = pb.QuorumResponse
    LIMIT: ClassVar[int] = MAX_SUMMARY_BYTES

    id: str
    exchange: int
    attempt: int
    tag: str
    numel: int
    members: dict[int, tuple[str, ...]]
    weights: dict[int, float]
    healers: tuple[int, ...] = ()
    donor: int = -1
    rejected: dict[int, str] = dataclasses.field(default_factory=dict)
    state_hash: str = ""
    evicted: str = ""
    stop: bool = False
    finished: bool = False
    setting: str = ""
    left_out: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    catch_up: bool = False
    disagreement: str = ""
    halted: str = ""

    FIELDS: ClassVar[tuple[str, ...]] = ("id", "exchange", "attempt", "tag", "numel", "members", "weights",
                                         "healers", "donor", "rejected", "state_hash", "evicted", "stop",
                                         "finished", "setting", "left_out", "catch_up", "disagreement", "halted")
    OPTIONAL: ClassVar[tuple[str, ...]] = ("setting", "left_out", "catch_up", "disagreement", "halted")

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> QuorumResponse:
        _check_fields(obj, "QuorumResponse", tuple(f for f in cls.FIELDS if f not in cls.OPTIONAL), cls.OPTIONAL)
        finished = _bool(obj["finished"], "finished")
        no_quorum = finished or bool(obj.get("disagreement")) or bool(obj.get("halted"))  # nothing formed
        members = {} if no_quorum and obj["members"] == {} else _members(obj["members"], "members")
        weights = _by_group(obj["weights"], "weights", lambda v, w: _float(v, w, lo=0.0))
        if set(weights) != set(members):
            raise MessageError(f"weights for groups {sorted(weights)}, members are {sorted(members)}")
        healers = _groups(obj["healers"], "healers")
        donor = _int(obj["donor"], "donor", -1, MAX_GROUPS - 1)
        if not set(healers) <= set(members) or (healers and donor not in members):
            raise MessageError("healers and donor must be members")
        left_out = _members(obj["left_out"], "left_out") if obj.get("left_out") else {}
        catch_up = _bool(obj.get("catch_up", False), "catch_up")
        if set(left_out) & set(members) or ((left_out or catch_up) and donor not in members):
            raise MessageError("left-out groups are not members, and they (or a catching-up group) need a member donor")
        return cls(id=_opt_str(obj["id"], "id", MAX_TAG_CHARS, _HASH_RE),
                   exchange=_int(obj["exchange"], "exchange", -1, MAX_INT64),
                   attempt=_int(obj["attempt"], "attempt", 0, MAX_INT64),
                   tag=_opt_str(obj["tag"], "tag", MAX_TAG_CHARS, _HASH_RE),
                   numel=_int(obj["numel"], "numel", 0, MAX_NUMEL), members=members, weights=weights,
                   healers=healers, donor=donor, rejected=_by_group(obj["rejected"], "rejected", _reason),
                   state_hash=_opt_str(obj["state_hash"], "state_hash", MAX_HASH_CHARS, _HASH_RE),
                   evicted=_reason(obj["evicted"], "evicted"), stop=_bool(obj["stop"], "stop"),
                   finished=finished, setting=_setting(obj.get("setting", "")),
                   left_out=left_out, catch_up=catch_up,
                   disagreement=_reason(obj.get("disagreement", ""), "disagreement"),
                   halted=_reason(obj.get("halted", ""), "halted"))

    def to_obj(self) -> dict[str, Any]:
        return {"id": self.id, "exchange": self.exchange, "attempt": self.attempt, "tag": self.tag,
                "numel": self.numel, "members": {str(g): list(a) for g, a in sorted(self.members.items())},
                "weights": {str(g): w for g, w in sorted(self.weights.items())}, "healers": list(self.healers),
                "donor": self.donor, "rejected": {str(g): r for g, r in sorted(self.rejected.items())},
                "state_hash": self.state_hash, "evicted": self.evicted, "stop": self.stop,
                "finished": self.finished, "setting": self.setting,
                "left_out": {str(g): list(a) for g, a in sorted(self.left_out.items())}, "catch_up": self.catch_up,
                "disagreement": self.disagreement, "halted": self.halted}


@dataclass(frozen=True)
class CommitRequest(Message):
    """A rank's vote on quorum ``quorum_id``: ``ok`` if its collective finished. ``exchange`` and
    ``groups`` repeat the quorum, so a restarted coordinator can still decide the vote."""

    PB: ClassVar[type[pb_message.Message]] = pb.CommitRequest

    group: int
    rank: int
    incarnation: str
    quorum_id: str
    exchange: int
    groups: tuple[int, ...]
    ok: bool
    reason: str = ""

    FIELDS: ClassVar[tuple[str, ...]] = ("group", "rank", "incarnation", "quorum_id", "exchange", "groups",
                                         "ok", "reason")

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> CommitRequest:
        _check_fields(obj, "CommitRequest", cls.FIELDS)
        groups = _groups(obj["groups"], "groups")
        group = _int(obj["group"], "group", 0, MAX_GROUPS - 1)
        if group not in groups:
            raise MessageError(f"group {group} votes on a quorum of groups {list(groups)}")
        return cls(group=group, rank=_int(obj["rank"], "rank", 0, MAX_GROUP_SIZE - 1),
                   incarnation=_incarnation(obj["incarnation"]),
                   quorum_id=_str(obj["quorum_id"], "quorum_id", MAX_TAG_CHARS, _HASH_RE),
                   exchange=_int(obj["exchange"], "exchange", 0, MAX_INT64), groups=groups,
                   ok=_bool(obj["ok"], "ok"), reason=_reason(obj["reason"], "reason"))

    def to_obj(self) -> dict[str, Any]:
        return {**{f: getattr(self, f) for f in self.FIELDS}, "groups": list(self.groups)}


@dataclass(frozen=True)
class CommitResponse(Message):
    """The quorum's decision: apply the result (``committed``) or roll back; ``reason`` says why."""

    PB: ClassVar[type[pb_message.Message]] = pb.CommitResponse

    committed: bool
    reason: str = ""

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> CommitResponse:
        _check_fields(obj, "CommitResponse", ("committed", "reason"))
        return cls(committed=_bool(obj["committed"], "committed"), reason=_reason(obj["reason"], "reason"))

    def to_obj(self) -> dict[str, Any]:
        return {"committed": self.committed, "reason": self.reason}


@dataclass(frozen=True)
class StateOffer(Message):
    """A donor rank serves its state (``nbytes`` bytes, SHA-256 ``digest`` in hex) to one healer
    rank for quorum ``quorum_id``. Sent by the donor; returned to the healer that waits for it."""

    PB: ClassVar[type[pb_message.Message]] = pb.StateOffer

    quorum_id: str
    donor_group: int
    donor_rank: int
    healer_group: int
    healer_rank: int
    nbytes: int
    digest: str

    FIELDS: ClassVar[tuple[str, ...]] = ("quorum_id", "donor_group", "donor_rank", "healer_group",
                                         "healer_rank", "nbytes", "digest")

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> StateOffer:
        _check_fields(obj, "StateOffer", cls.FIELDS)
        digest = _str(obj["digest"], "digest", 64, _HEX64_RE)
        return cls(quorum_id=_str(obj["quorum_id"], "quorum_id", MAX_TAG_CHARS, _HASH_RE),
                   donor_group=_int(obj["donor_group"], "donor_group", 0, MAX_GROUPS - 1),
                   donor_rank=_int(obj["donor_rank"], "donor_rank", 0, MAX_GROUP_SIZE - 1),
                   healer_group=_int(obj["healer_group"], "healer_group", 0, MAX_GROUPS - 1),
                   healer_rank=_int(obj["healer_rank"], "healer_rank", 0, MAX_GROUP_SIZE - 1),
                   nbytes=_int(obj["nbytes"], "nbytes", 1, MAX_NUMEL), digest=digest)

    def to_obj(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.FIELDS}


@dataclass(frozen=True)
class OfferQuery(Message):
    """A healer rank waits for the offer its donor rank makes for quorum ``quorum_id``."""

    PB: ClassVar[type[pb_message.Message]] = pb.OfferQuery

    quorum_id: str
    healer_group: int
    healer_rank: int

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> OfferQuery:
        _check_fields(obj, "OfferQuery", ("quorum_id", "healer_group", "healer_rank"))
        return cls(quorum_id=_str(obj["quorum_id"], "quorum_id", MAX_TAG_CHARS, _HASH_RE),
                   healer_group=_int(obj["healer_group"], "healer_group", 0, MAX_GROUPS - 1),
                   healer_rank=_int(obj["healer_rank"], "healer_rank", 0, MAX_GROUP_SIZE - 1))

    def to_obj(self) -> dict[str, Any]:
        return {"quorum_id": self.quorum_id, "healer_group": self.healer_group, "healer_rank": self.healer_rank}


@dataclass(frozen=True)
class StopRequest(Message):
    """Ask every group to checkpoint and stop after its next exchange; ``reason`` is logged."""

    PB: ClassVar[type[pb_message.Message]] = pb.StopRequest

    reason: str = ""

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> StopRequest:
        _check_fields(obj, "StopRequest", ("reason",))
        return cls(reason=_reason(obj["reason"], "reason"))

    def to_obj(self) -> dict[str, Any]:
        return {"reason": self.reason}


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
