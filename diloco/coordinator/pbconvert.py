"""Generic conversion between protobuf messages and the dicts the field validators check.

A message becomes the dict of its fields: a field with explicit presence that is not set is left
out (the validator then reports it missing, or takes its default); a map becomes a dict with
string keys (group ids as in JSON), a repeated field a list, JsonValue/JsonObject the Python
value, and a message of a single field (RankAddresses, GroupRates, Rates) that field's value.
``_parse`` reads untrusted bytes, ``_pb_to_obj`` makes the dict and ``_fill`` is its inverse.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from google.protobuf import message as pb_message
from google.protobuf import unknown_fields
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from . import coordinator_pb2 as pb
from .fields import MAX_INT64, MAX_SUMMARY_DEPTH, MessageError, _type_name

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
