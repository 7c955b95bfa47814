"""Validators of the coordinator's message fields: limits, patterns and checks of untrusted values.

Each check takes a decoded value and the field's name, returns the value it accepts and raises
:class:`MessageError` naming the field otherwise. ``messages.py`` builds every message's validator
from these; ``pbconvert.py`` raises the same error.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

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


def _setting(value: Any) -> str:
    """An auto setting's name (a row of the study's table), or "" (none)."""
    return _opt_str(value, "setting", MAX_TAG_CHARS, _HASH_RE)


def _reason(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_REASON_CHARS:
        raise MessageError(f"{what}: expected a string of at most {MAX_REASON_CHARS} characters")
    return value
