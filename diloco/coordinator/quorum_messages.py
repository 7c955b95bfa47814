"""The coordinator's fault-tolerance messages: a quorum per exchange, the commit vote, healing
(state offers) and the stop; each a typed dataclass validated as ``messages`` describes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from google.protobuf import message as pb_message

from . import coordinator_pb2 as pb
from .fields import (_HASH_RE, _HEX64_RE, MAX_GROUP_SIZE, MAX_GROUPS, MAX_HASH_CHARS, MAX_INT64, MAX_NUMEL,
                     MAX_TAG_CHARS, MessageError, _bool, _by_group, _check_fields, _float, _groups, _incarnation,
                     _int, _members, _opt_str, _reason, _setting, _str)
from .message_base import MAX_SUMMARY_BYTES, Message

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


