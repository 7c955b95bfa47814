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
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, TypeVar

from google.protobuf import message as pb_message
from google.protobuf import unknown_fields
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from . import coordinator_pb2 as pb

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


# --- protobuf <-> the dicts the validators check ----------------------------------------------
#
# A message becomes the dict of its fields: a field with explicit presence that is not set is left
# out (the validator then reports it missing, or takes its default); a map becomes a dict with
# string keys (group ids as in JSON), a repeated field a list, JsonValue/JsonObject the Python
# value, and a message of a single field (RankAddresses, GroupRates, Rates) that field's value.

_JSON_VALUE = pb.JsonValue.DESCRIPTOR.full_name
_JSON_OBJECT = pb.JsonObject.DESCRIPTOR.full_name
_WIRE_TYPES = {0: "varint", 1: "64-bit", 2: "length-delimited", 3: "group start", 4: "group end", 5: "32-bit"}


def _parse(pb_type: type[pb_message.Message], data: bytes, limit: int, what: str) -> pb_message.Message:
    """Parse ``data`` (at most ``limit`` bytes) as one ``pb_type`` with no unknown fields."""
    if not isinstance(data, (bytes, bytearray)):
        raise MessageError(f"{what}: expected bytes, got {_type_name(data)}")
    if len(data) > limit:
        raise MessageError(f"{what}: message is {len(data)} bytes, the limit is {limit}")
    msg = pb_type()
    try:
        msg.ParseFromString(bytes(data))
    except (pb_message.DecodeError, UnicodeDecodeError) as exc:  # the latter: the pure-Python runtime
        raise MessageError(f"{what}: not a valid {pb_type.DESCRIPTOR.full_name} message ({exc})") from None
    fields = {f.number: f.name for f in msg.DESCRIPTOR.fields}
    unknown = sorted({(f.field_number, f.wire_type) for f in unknown_fields.UnknownFieldSet(msg)})
    for number, wire_type in unknown:  # a known number here was sent with the wrong wire type
        if number in fields:
            raise MessageError(f"{what}: {fields[number]}: wrong type on the wire "
                               f"({_WIRE_TYPES.get(wire_type, wire_type)})")
    if unknown:
        raise MessageError(f"{what}: unknown field(s) {', '.join(str(n) for n, _ in unknown)}")
    size = msg.ByteSize()
    msg.DiscardUnknownFields()  # recursive: the nested messages' unknown fields
    if msg.ByteSize() != size:
        raise MessageError(f"{what}: unknown or mistyped fields in a nested message")
    return msg


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _pb_to_obj(msg: pb_message.Message, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        if field.has_presence and not msg.HasField(field.name):
            continue
        out[field.name] = _pb_field(field, getattr(msg, field.name), _join(path, field.name))
    return out


def _pb_field(field: FieldDescriptor, value: Any, path: str) -> Any:
    if _is_map(field):
        item = field.message_type.fields_by_name["value"]
        return {str(k): _pb_item(item, value[k], f"{path}[{k}]") for k in sorted(value)}
    if field.is_repeated:
        return [_pb_item(field, v, f"{path}[{i}]") for i, v in enumerate(value)]
    return _pb_item(field, value, path)


def _pb_item(field: FieldDescriptor, value: Any, path: str) -> Any:
    kind: Descriptor | None = field.message_type
    if kind is None:
        return value
    if kind.full_name == _JSON_VALUE:
        return _json_from_pb(value, path, 0)
    if kind.full_name == _JSON_OBJECT:
        return _object_from_pb(value, path, 0)
    if len(kind.fields) == 1:  # a wrapper: its one field stands for it
        return _pb_field(kind.fields[0], getattr(value, kind.fields[0].name), path)
    return _pb_to_obj(value, path)


def _json_from_pb(value: pb.JsonValue, path: str, depth: int) -> Any:
    """The Python value; ``depth`` counts as ``_json_tree`` does (the root object is 0)."""
    if depth > MAX_SUMMARY_DEPTH:
        raise MessageError(f"{path}: nested deeper than {MAX_SUMMARY_DEPTH}")
    kind = value.WhichOneof("kind")
    if kind is None:
        raise MessageError(f"{path}: a JsonValue with no kind set")
    if kind == "null_value":
        return None
    if kind == "list_value":
        return [_json_from_pb(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value.list_value.values)]
    if kind == "object_value":
        return _object_from_pb(value.object_value, path, depth)
    return getattr(value, kind)


def _object_from_pb(obj: pb.JsonObject, path: str, depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for entry in obj.fields:
        where = f"{path}[{entry.key[:40]!r}]"
        if entry.key in out:
            raise MessageError(f"{where}: repeated key")
        if not entry.HasField("value"):
            raise MessageError(f"{where}: no value")
        out[entry.key] = _json_from_pb(entry.value, where, depth + 1)
    return out


def _fill(msg: pb_message.Message, obj: Mapping[str, Any], path: str) -> None:
    """Set ``msg``'s fields from the dict of fields ``obj`` (the inverse of ``_pb_to_obj``)."""
    fields = msg.DESCRIPTOR.fields_by_name
    for name, value in obj.items():
        field = fields.get(name)
        where = _join(path, name)
        if field is None:
            raise MessageError(f"{where}: no such field in {msg.DESCRIPTOR.full_name}")
        if _is_map(field):
            key_field, item = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            if not isinstance(value, Mapping):
                raise MessageError(f"{where}: expected a mapping, got {_type_name(value)}")
            container = getattr(msg, name)
            for k, v in value.items():
                key = _map_key(key_field, k, where)
                if item.message_type is not None:
                    _fill_item(item, container[key], v, f"{where}[{k}]")
                else:
                    container[key] = _scalar(item, v, f"{where}[{k}]")
        elif field.is_repeated:
            if not isinstance(value, (list, tuple)):
                raise MessageError(f"{where}: expected a list, got {_type_name(value)}")
            container = getattr(msg, name)
            for i, v in enumerate(value):
                if field.message_type is not None:
                    _fill_item(field, container.add(), v, f"{where}[{i}]")
                else:
                    container.append(_scalar(field, v, f"{where}[{i}]"))
        elif field.message_type is not None:
            sub = getattr(msg, name)
            sub.SetInParent()
            _fill_item(field, sub, value, where)
        else:
            setattr(msg, name, _scalar(field, value, where))


def _fill_item(field: FieldDescriptor, target: pb_message.Message, value: Any, path: str) -> None:
    kind = field.message_type
    if kind.full_name == _JSON_VALUE:
        _json_to_pb(value, target, path)
    elif kind.full_name == _JSON_OBJECT:
        _object_to_pb(value, target, path)
    elif len(kind.fields) == 1:
        _fill(target, {kind.fields[0].name: value}, path)
    else:
        _fill(target, value, path)


def _map_key(field: FieldDescriptor, key: Any, path: str) -> Any:
    if field.cpp_type == FieldDescriptor.CPPTYPE_STRING:
        return _scalar(field, key, path)
    try:  # group and rank ids: string keys in the dicts, integers on the wire
        return _scalar(field, int(key) if isinstance(key, str) else key, path)
    except ValueError:
        raise MessageError(f"{path}: key {key!r} is not an integer") from None


def _scalar(field: FieldDescriptor, value: Any, path: str) -> Any:
    """``value`` checked against the field's type (no silent conversions: a bool is no integer)."""
    cpp = field.cpp_type
    if cpp in (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_INT32):
        if type(value) is not int:
            raise MessageError(f"{path}: expected an integer, got {_type_name(value)}")
        if not -MAX_INT64 - 1 <= value <= MAX_INT64:
            raise MessageError(f"{path}: {value} does not fit in 64 bits")
    elif cpp == FieldDescriptor.CPPTYPE_DOUBLE:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MessageError(f"{path}: expected a number, got {_type_name(value)}")
        return float(value)
    elif cpp == FieldDescriptor.CPPTYPE_BOOL:
        if not isinstance(value, bool):
            raise MessageError(f"{path}: expected true or false, got {_type_name(value)}")
    elif cpp == FieldDescriptor.CPPTYPE_STRING:
        if not isinstance(value, str):
            raise MessageError(f"{path}: expected a string, got {_type_name(value)}")
    else:  # pragma: no cover - the schema has no other scalar types
        raise MessageError(f"{path}: unsupported field type {field.type}")
    return value


def _json_key(key: Any, path: str) -> str:
    """An object key as ``json.dumps`` writes it: numbers, bools and None become their JSON text."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    raise MessageError(f"{path}: object key {key!r} is not a string")


def _json_to_pb(value: Any, out: pb.JsonValue, path: str) -> None:
    if value is None:
        out.null_value = 0  # google.protobuf.NULL_VALUE
    elif isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, int):
        if not -MAX_INT64 - 1 <= value <= MAX_INT64:
            raise MessageError(f"{path}: {value} does not fit in 64 bits")
        out.int_value = int(value)
    elif isinstance(value, float):
        out.double_value = float(value)
    elif isinstance(value, str):
        out.string_value = value
    elif isinstance(value, (list, tuple)):
        out.list_value.SetInParent()
        for i, item in enumerate(value):
            _json_to_pb(item, out.list_value.values.add(), f"{path}[{i}]")
    elif isinstance(value, Mapping):
        out.object_value.SetInParent()
        _object_to_pb(value, out.object_value, path)
    else:
        raise MessageError(f"{path}: cannot encode {_type_name(value)} as a JSON value")


def _object_to_pb(value: Any, out: pb.JsonObject, path: str) -> None:
    if not isinstance(value, Mapping):
        raise MessageError(f"{path}: expected an object, got {_type_name(value)}")
    for key, item in value.items():
        entry = out.fields.add()
        entry.key = _json_key(key, path)
        _json_to_pb(item, entry.value, f"{path}[{entry.key[:40]!r}]")


# --- messages ---------------------------------------------------------------------------------

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

    PB: ClassVar[type[pb_message.Message]] = pb.HeartbeatRequest

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
    """Reply to heartbeats and reports: the current membership epoch (0 before the quorum)."""

    PB: ClassVar[type[pb_message.Message]] = pb.Ack

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
    Ping, Ack, JoinRequest, JoinResponse, HeartbeatRequest, ProgressRequest, RoundRequest, SummaryRequest,
    BandwidthRequest, PlanRequest, PlanResponse, QuorumRequest, QuorumResponse, CommitRequest,
    CommitResponse, StateOffer, OfferQuery, StopRequest)}
RPCS: dict[str, tuple[type[Message], type[Message]]] = {
    method.name: (_BY_PB[method.input_type.full_name], _BY_PB[method.output_type.full_name])
    for method in _SERVICE.methods}
"""Every RPC of ``coordinator.proto``: name -> (request message, reply message)."""
