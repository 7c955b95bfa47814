"""Wire messages of the coordinator: typed dataclasses with strict JSON decoding.

Every message is one UTF-8 JSON object. ``decode`` never trusts its input: size, encoding,
syntax, required and unknown fields, types (``bool`` is not an ``int``) and ranges are checked,
and any mismatch raises :class:`MessageError`, which the server answers with INVALID_ARGUMENT.
Non-finite floats (``NaN``, ``Infinity``) are accepted in progress and summaries: a NaN loss is
a fact worth reporting, and both ends are this package's Python ``json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, TypeVar

MAX_REQUEST_BYTES = 64 * 1024  # every message but summaries
MAX_SUMMARY_BYTES = 1024 * 1024
MAX_GROUPS = 1024
MAX_GROUP_SIZE = 4096
MAX_INT64 = 2**63 - 1
MAX_PROGRESS_KEYS = 64
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 256
MAX_SUMMARY_DEPTH = 8
MAX_HASH_CHARS = 256
MAX_ADDRESS_CHARS = 262
MAX_INCARNATION_CHARS = 64
MAX_TAG_CHARS = 256
MAX_REASON_CHARS = 512
MAX_NUMEL = 2**40

_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-/]*\Z")
_HASH_RE = re.compile(r"[\x21-\x7e]+\Z")  # printable ASCII, no spaces
_HEX64_RE = re.compile(r"[0-9a-f]{64}\Z")
_ADDRESS_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):([0-9]{1,5})\Z")
_WILDCARD_HOSTS = {"0.0.0.0", "[::]", "[0:0:0:0:0:0:0:0]"}


class MessageError(ValueError):
    """A message that does not match its schema (the server answers INVALID_ARGUMENT)."""


# --- primitive checks -------------------------------------------------------------------------

def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _load_object(data: bytes, limit: int, what: str) -> dict[str, Any]:
    """Parse ``data`` (at most ``limit`` bytes) as one JSON object."""
    if not isinstance(data, (bytes, bytearray)):
        raise MessageError(f"{what}: expected bytes, got {_type_name(data)}")
    if len(data) > limit:
        raise MessageError(f"{what}: message is {len(data)} bytes, the limit is {limit}")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MessageError(f"{what}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError covers JSONDecodeError, huge ints
        raise MessageError(f"{what}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise MessageError(f"{what}: expected a JSON object, got {_type_name(obj)}")
    return obj


def _check_fields(obj: Mapping[str, Any], what: str, fields: tuple[str, ...],
                  optional: tuple[str, ...] = ()) -> None:
    missing = [f for f in fields if f not in obj]
    unknown = sorted(k for k in obj if k not in fields and k not in optional)
    if missing:
        raise MessageError(f"{what}: missing field(s) {', '.join(missing)}")
    if unknown:
        raise MessageError(f"{what}: unknown field(s) {', '.join(unknown)}")


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if type(value) is not int:  # excludes bool, float
        raise MessageError(f"{what}: expected an integer, got {_type_name(value)}")
    if not lo <= value <= hi:
        raise MessageError(f"{what}: {value} is out of range [{lo}, {hi}]")
    return value


def _str(value: Any, what: str, max_chars: int, pattern: re.Pattern[str] | None = None) -> str:
    if not isinstance(value, str):
        raise MessageError(f"{what}: expected a string, got {_type_name(value)}")
    if not value:
        raise MessageError(f"{what}: must not be empty")
    if len(value) > max_chars:
        raise MessageError(f"{what}: {len(value)} characters, the limit is {max_chars}")
    if pattern is not None and not pattern.match(value):
        raise MessageError(f"{what}: {value[:80]!r} has characters outside {pattern.pattern!r}")
    return value


def check_address(value: Any, what: str = "address") -> str:
    """Validate a data-plane address ``host:port`` (``[v6]:port`` for IPv6) that peers can dial."""
    value = _str(value, what, MAX_ADDRESS_CHARS)
    match = _ADDRESS_RE.match(value)
    if match is None:
        raise MessageError(f"{what}: {value[:80]!r} is not host:port")
    host, port = match.group(1), int(match.group(2))
    if not 1 <= port <= 65535:
        raise MessageError(f"{what}: port {port} is out of range [1, 65535]")
    if host in _WILDCARD_HOSTS:
        raise MessageError(f"{what}: {value!r} is a wildcard; advertise an address peers can reach")
    return value


def _flat_dict(value: Any, what: str) -> dict[str, int | float | str | bool]:
    """A flat dict of short keys to numbers, bools or short strings (progress reports)."""
    if not isinstance(value, dict):
        raise MessageError(f"{what}: expected an object, got {_type_name(value)}")
    if len(value) > MAX_PROGRESS_KEYS:
        raise MessageError(f"{what}: {len(value)} keys, the limit is {MAX_PROGRESS_KEYS}")
    out: dict[str, int | float | str | bool] = {}
    for key, item in value.items():
        _str(key, f"{what} key", MAX_KEY_CHARS, _KEY_RE)
        if isinstance(item, str):
            if len(item) > MAX_VALUE_CHARS:
                raise MessageError(f"{what}[{key!r}]: string longer than {MAX_VALUE_CHARS}")
        elif type(item) is int:
            _int(item, f"{what}[{key!r}]", -MAX_INT64 - 1, MAX_INT64)
        elif not isinstance(item, (float, bool)):
            raise MessageError(
                f"{what}[{key!r}]: expected a number, bool or string, got {_type_name(item)}")
        out[key] = item
    return out


def _json_tree(value: Any, what: str, depth: int = 0) -> Any:
    """A JSON tree of objects (string keys), lists and scalars, nested at most MAX_SUMMARY_DEPTH."""
    if depth > MAX_SUMMARY_DEPTH:
        raise MessageError(f"{what}: nested deeper than {MAX_SUMMARY_DEPTH}")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise MessageError(f"{what}: object key {key!r} is not a string")
            _json_tree(item, f"{what}.{key[:40]}", depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _json_tree(item, f"{what}[{index}]", depth + 1)
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise MessageError(f"{what}: {_type_name(value)} is not a JSON value")
    return value


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise MessageError(f"{what}: expected true or false, got {_type_name(value)}")
    return value


def _float(value: Any, what: str, *, finite: bool = True, lo: float = float("-inf")) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MessageError(f"{what}: expected a number, got {_type_name(value)}")
    value = float(value)
    if finite and not math.isfinite(value):
        raise MessageError(f"{what}: {value} is not finite")
    if value < lo:
        raise MessageError(f"{what}: {value} is below {lo}")
    return value


def _opt_str(value: Any, what: str, max_chars: int, pattern: re.Pattern[str] | None = None) -> str:
    """Like _str, but the empty string is allowed (an absent value)."""
    if value == "":
        return ""
    return _str(value, what, max_chars, pattern)


def _incarnation(value: Any) -> str:
    return _opt_str(value, "incarnation", MAX_INCARNATION_CHARS, _HASH_RE)


def _group_id(key: Any, what: str) -> int:
    if not (isinstance(key, str) and key.isdigit() and key.isascii()):
        raise MessageError(f"{what}: key {key!r} is not a group id")
    return _int(int(key), what, 0, MAX_GROUPS - 1)


def _members(raw: Any, what: str) -> dict[int, tuple[str, ...]]:
    """``{"<group>": [address by rank]}``, non-empty."""
    if not isinstance(raw, dict) or not raw or len(raw) > MAX_GROUPS:
        raise MessageError(f"{what}: expected a non-empty object of at most {MAX_GROUPS} groups")
    members: dict[int, tuple[str, ...]] = {}
    for key, addresses in raw.items():
        group = _group_id(key, what)
        if not isinstance(addresses, list) or not 1 <= len(addresses) <= MAX_GROUP_SIZE:
            raise MessageError(f"{what}[{group}]: expected a list of 1..{MAX_GROUP_SIZE}")
        members[group] = tuple(check_address(a, f"{what}[{group}]") for a in addresses)
    return members


def _groups(raw: Any, what: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_GROUPS:
        raise MessageError(f"{what}: expected a list of at most {MAX_GROUPS} group ids")
    out = tuple(_int(g, what, 0, MAX_GROUPS - 1) for g in raw)
    if len(set(out)) != len(out):
        raise MessageError(f"{what}: repeated group ids {list(out)}")
    return out


def _by_group(raw: Any, what: str, item) -> dict[int, Any]:
    if not isinstance(raw, dict) or len(raw) > MAX_GROUPS:
        raise MessageError(f"{what}: expected an object of at most {MAX_GROUPS} groups")
    return {_group_id(k, what): item(v, f"{what}[{k}]") for k, v in raw.items()}


# --- messages ---------------------------------------------------------------------------------

M = TypeVar("M", bound="Message")


class Message:
    """Base of all wire messages: ``encode`` to bytes, ``decode`` with validation."""

    LIMIT: ClassVar[int] = MAX_REQUEST_BYTES

    @classmethod
    def from_obj(cls: type[M], obj: dict[str, Any]) -> M:
        raise NotImplementedError

    def to_obj(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def decode(cls: type[M], data: bytes) -> M:
        """Parse and validate ``data``; raises MessageError."""
        return cls.from_obj(_load_object(data, cls.LIMIT, cls.__name__))

    def encode(self) -> bytes:
        """Serialize and check the result against the same rules the receiver applies."""
        try:
            data = json.dumps(self.to_obj(), separators=(",", ":"), allow_nan=True).encode()
        except (TypeError, ValueError, RecursionError) as exc:
            raise MessageError(f"{type(self).__name__}: cannot encode as JSON ({exc})") from None
        type(self).decode(data)
        return data


@dataclass(frozen=True)
class JoinRequest(Message):
    """A rank announces itself: its group, its rank in the group, the group's size, and the
    data-plane address ``host:port`` other groups will dial."""

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

    epoch: int
    members: dict[int, tuple[str, ...]]
    ring_order: tuple[int, ...]
    heal: bool = False  # the job is under way: this group fetches its state before it takes part

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> JoinResponse:
        _check_fields(obj, "JoinResponse", ("epoch", "members", "ring_order"), ("heal",))
        members = _members(obj["members"], "members")
        ring = obj["ring_order"]
        if not isinstance(ring, list) or any(type(g) is not int for g in ring):
            raise MessageError("ring_order: expected a list of group ids")
        if sorted(ring) != sorted(members):
            raise MessageError(f"ring_order {ring} is not a permutation of {sorted(members)}")
        return cls(epoch=_int(obj["epoch"], "epoch", 1, MAX_INT64), members=members,
                   ring_order=tuple(ring), heal=_bool(obj.get("heal", False), "heal"))

    def to_obj(self) -> dict[str, Any]:
        return {"epoch": self.epoch,
                "members": {str(g): list(a) for g, a in sorted(self.members.items())},
                "ring_order": list(self.ring_order), "heal": self.heal}


@dataclass(frozen=True)
class HeartbeatRequest(Message):
    """A rank is alive at inner step ``step``."""

    group: int
    rank: int
    step: int
    incarnation: str = ""

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> HeartbeatRequest:
        _check_fields(obj, "HeartbeatRequest", ("group", "rank", "step"), ("incarnation",))
        return cls(group=_int(obj["group"], "group", 0, MAX_GROUPS - 1),
                   rank=_int(obj["rank"], "rank", 0, MAX_GROUP_SIZE - 1),
                   step=_int(obj["step"], "step", 0, MAX_INT64),
                   incarnation=_incarnation(obj.get("incarnation", "")))

    def to_obj(self) -> dict[str, Any]:
        return {"group": self.group, "rank": self.rank, "step": self.step, "incarnation": self.incarnation}


@dataclass(frozen=True)
class ProgressRequest(Message):
    """Latest progress of a rank: a flat dict (step, loss, tokens_per_s, bytes_sent, round, H ...)."""

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

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Ping:
        _check_fields(obj, "Ping", ())
        return cls()

    def to_obj(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class Ack(Message):
    """Reply to heartbeats and reports: the current membership epoch (0 before the quorum)."""

    epoch: int

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Ack:
        _check_fields(obj, "Ack", ("epoch",))
        return cls(epoch=_int(obj["epoch"], "epoch", 0, MAX_INT64))

    def to_obj(self) -> dict[str, Any]:
        return {"epoch": self.epoch}


def _rates(value: Any, what: str) -> dict[int, float]:
    """``{"<group>": bytes_per_s}`` with finite, non-negative rates."""
    if not isinstance(value, dict) or len(value) > MAX_GROUPS:
        raise MessageError(f"{what}: expected an object of at most {MAX_GROUPS} rates")
    out: dict[int, float] = {}
    for key, rate in value.items():
        if not (isinstance(key, str) and key.isdigit() and key.isascii()):
            raise MessageError(f"{what}: key {key!r} is not a group id")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < float("inf"):
            raise MessageError(f"{what}[{key}]: expected a finite rate >= 0, got {rate!r}")
        out[_int(int(key), f"{what} key", 0, MAX_GROUPS - 1)] = float(rate)
    return out


@dataclass(frozen=True)
class BandwidthRequest(Message):
    """What one rank measured towards each other group: bytes/s by group id."""

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

def _reason(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_REASON_CHARS:
        raise MessageError(f"{what}: expected a string of at most {MAX_REASON_CHARS} characters")
    return value


@dataclass(frozen=True)
class QuorumRequest(Message):
    """A rank is about to run ``exchange`` (-1: it needs the job's state and joins the next one).

    Rank 0's ``state_hash`` (hash of its group's global state before the exchange, "" to skip the
    comparison) and ``delta_norm`` (its contribution's L2 norm; NaN/Inf allowed: a non-finite
    contribution, which is rejected) are compared and screened; ``weight`` is what the group
    contributed since its last exchange (tokens). ``retry``: a repeat of a rolled-back exchange.
    ``healable``: healers may join it (a fragment sync, not a control exchange).
    """

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

    FIELDS: ClassVar[tuple[str, ...]] = ("group", "rank", "incarnation", "exchange", "tag", "numel",
                                         "weight", "state_hash", "delta_norm", "retry", "healable")

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> QuorumRequest:
        _check_fields(obj, "QuorumRequest", cls.FIELDS)
        return cls(group=_int(obj["group"], "group", 0, MAX_GROUPS - 1),
                   rank=_int(obj["rank"], "rank", 0, MAX_GROUP_SIZE - 1),
                   incarnation=_incarnation(obj["incarnation"]),
                   exchange=_int(obj["exchange"], "exchange", -1, MAX_INT64),
                   tag=_opt_str(obj["tag"], "tag", MAX_TAG_CHARS, _HASH_RE),
                   numel=_int(obj["numel"], "numel", 0, MAX_NUMEL),
                   weight=_float(obj["weight"], "weight", lo=0.0),
                   state_hash=_opt_str(obj["state_hash"], "state_hash", MAX_HASH_CHARS, _HASH_RE),
                   delta_norm=_float(obj["delta_norm"], "delta_norm", finite=False),
                   retry=_bool(obj["retry"], "retry"), healable=_bool(obj["healable"], "healable"))

    def to_obj(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.FIELDS}


@dataclass(frozen=True)
class QuorumResponse(Message):
    """The quorum of one attempt at one exchange (see ``diloco.coordinator.rounds.Quorum``), with
    the members' data-plane addresses. ``evicted``: why the caller's group must stop and heal ("" if
    not). ``stop``: the job asked every group to checkpoint and stop after this exchange.
    ``finished``: nothing to heal into, the job's groups have finished."""

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

    FIELDS: ClassVar[tuple[str, ...]] = ("id", "exchange", "attempt", "tag", "numel", "members", "weights",
                                         "healers", "donor", "rejected", "state_hash", "evicted", "stop",
                                         "finished")

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> QuorumResponse:
        _check_fields(obj, "QuorumResponse", cls.FIELDS)
        finished = _bool(obj["finished"], "finished")
        members = {} if finished and obj["members"] == {} else _members(obj["members"], "members")
        weights = _by_group(obj["weights"], "weights", lambda v, w: _float(v, w, lo=0.0))
        if set(weights) != set(members):
            raise MessageError(f"weights for groups {sorted(weights)}, members are {sorted(members)}")
        healers = _groups(obj["healers"], "healers")
        donor = _int(obj["donor"], "donor", -1, MAX_GROUPS - 1)
        if not set(healers) <= set(members) or (healers and donor not in members):
            raise MessageError("healers and donor must be members")
        return cls(id=_opt_str(obj["id"], "id", MAX_TAG_CHARS, _HASH_RE),
                   exchange=_int(obj["exchange"], "exchange", -1, MAX_INT64),
                   attempt=_int(obj["attempt"], "attempt", 0, MAX_INT64),
                   tag=_opt_str(obj["tag"], "tag", MAX_TAG_CHARS, _HASH_RE),
                   numel=_int(obj["numel"], "numel", 0, MAX_NUMEL), members=members, weights=weights,
                   healers=healers, donor=donor, rejected=_by_group(obj["rejected"], "rejected", _reason),
                   state_hash=_opt_str(obj["state_hash"], "state_hash", MAX_HASH_CHARS, _HASH_RE),
                   evicted=_reason(obj["evicted"], "evicted"), stop=_bool(obj["stop"], "stop"),
                   finished=finished)

    def to_obj(self) -> dict[str, Any]:
        return {"id": self.id, "exchange": self.exchange, "attempt": self.attempt, "tag": self.tag,
                "numel": self.numel, "members": {str(g): list(a) for g, a in sorted(self.members.items())},
                "weights": {str(g): w for g, w in sorted(self.weights.items())}, "healers": list(self.healers),
                "donor": self.donor, "rejected": {str(g): r for g, r in sorted(self.rejected.items())},
                "state_hash": self.state_hash, "evicted": self.evicted, "stop": self.stop,
                "finished": self.finished}


@dataclass(frozen=True)
class CommitRequest(Message):
    """A rank's vote on quorum ``quorum_id``: ``ok`` if its collective finished. ``exchange`` and
    ``groups`` repeat the quorum, so a restarted coordinator can still decide the vote."""

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

    reason: str = ""

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> StopRequest:
        _check_fields(obj, "StopRequest", ("reason",))
        return cls(reason=_reason(obj["reason"], "reason"))

    def to_obj(self) -> dict[str, Any]:
        return {"reason": self.reason}
