"""A tensor-tree format for sending state between groups: a checked header, raw bytes, no pickle.

``pack(tree)`` turns a tree of dicts, lists, tuples, numbers, strings, None and tensors (an
engine's ``state_dict()``) into bytes::

    b"DLCSTATE" | u32 version | u64 header length | header (UTF-8 JSON) | tensor bytes

The header holds the tree with every tensor replaced by ``{"$t": index}`` and, per tensor, its
dtype (from a fixed list), shape, offset and length. ``unpack`` checks every field of the header
against the data before it allocates anything and rebuilds the tree on CPU; it never runs code
from the data. Integrity and authenticity come from the digest the receiver learns elsewhere
(the coordinator) and checks first.

``to_values`` / ``from_values`` carry bytes through an fp32 all-reduce exactly: three bytes per
value as an integer below 2^24 (an exact float), doubled by the sender so that the mean of a
two-member ring (sender, receiver contributing zeros) is the value itself.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

MAGIC = b"DLCSTATE"
VERSION = 1
MAX_HEADER_BYTES = 16 << 20
MAX_DEPTH = 16
_PREFIX = struct.Struct("<8sIQ")
DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}


class StateFormatError(ValueError):
    """Bytes that are not a well-formed state blob."""


def pack(tree: Any) -> bytes:
    """Serialize ``tree`` (see the module doc); tensors are copied to CPU."""
    tensors: list[torch.Tensor] = []

    def encode(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"state nested deeper than {MAX_DEPTH}")
        if isinstance(node, torch.Tensor):
            if node.dtype not in _NAMES:
                raise ValueError(f"cannot send a tensor of dtype {node.dtype}")
            tensors.append(node.detach().to("cpu").contiguous())
            return {"$t": len(tensors) - 1}
        if isinstance(node, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in node):
                return {k: encode(v, depth + 1) for k, v in node.items()}
            return {"$d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in node.items()]}
        if isinstance(node, tuple):
            return {"$tuple": [encode(v, depth + 1) for v in node]}
        if isinstance(node, list):
            return [encode(v, depth + 1) for v in node]
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise ValueError(f"cannot send a {type(node).__name__} in a state")

    body = encode(tree, 0)
    entries, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append({"dtype": _NAMES[t.dtype], "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
        offset += nbytes
    header = json.dumps({"tree": body, "tensors": entries}, separators=(",", ":"), allow_nan=True).encode()
    parts = [_PREFIX.pack(MAGIC, VERSION, len(header)), header]
    parts += [t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b"" for t in tensors]
    return b"".join(parts)


def unpack(data: bytes | bytearray | memoryview) -> Any:
    """Rebuild the tree ``pack`` wrote, tensors on CPU; raises StateFormatError on any mismatch."""
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size:
        raise StateFormatError(f"{len(view)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, version, hlen = _PREFIX.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise StateFormatError(f"not a version-{VERSION} state blob (magic {magic!r}, version {version})")
    if hlen > min(MAX_HEADER_BYTES, len(view) - _PREFIX.size):
        raise StateFormatError(f"header length {hlen} does not fit the {len(view)}-byte blob")
    try:
        header = json.loads(bytes(view[_PREFIX.size:_PREFIX.size + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise StateFormatError(f"header is not JSON: {e}") from None
    payload = view[_PREFIX.size + hlen:]
    if not isinstance(header, dict) or set(header) != {"tree", "tensors"} or not isinstance(header["tensors"], list):
        raise StateFormatError("header must be an object with exactly 'tree' and 'tensors'")
    tensors = [_tensor(e, i, payload) for i, e in enumerate(header["tensors"])]
    if sum(t.numel() * t.element_size() for t in tensors) != len(payload):
        raise StateFormatError(f"tensors cover {sum(t.numel() * t.element_size() for t in tensors)} bytes, "
                               f"the payload is {len(payload)}")
    return _decode(header["tree"], tensors, 0)


def _tensor(entry: Any, index: int, payload: memoryview) -> torch.Tensor:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "offset", "nbytes"}:
        raise StateFormatError(f"tensor {index}: bad entry")
    dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    shape, offset, nbytes = entry["shape"], entry["offset"], entry["nbytes"]
    if dtype is None:
        raise StateFormatError(f"tensor {index}: dtype {entry['dtype']!r} is not one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > 16 or any(type(d) is not int or d < 0 for d in shape):
        raise StateFormatError(f"tensor {index}: bad shape {shape!r}")
    if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
        raise StateFormatError(f"tensor {index}: bad offset/length")
    size = torch.empty(0, dtype=dtype).element_size()
    if math.prod(shape) * size != nbytes or offset + nbytes > len(payload):
        raise StateFormatError(f"tensor {index}: {nbytes} bytes at {offset} do not match shape {shape} "
                               f"of {entry['dtype']} in a {len(payload)}-byte payload")
    raw = torch.frombuffer(bytearray(payload[offset:offset + nbytes]), dtype=torch.uint8) if nbytes else \
        torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _decode(node: Any, tensors: list[torch.Tensor], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise StateFormatError(f"tree nested deeper than {MAX_DEPTH}")
    if isinstance(node, list):
        return [_decode(v, tensors, depth + 1) for v in node]
    if isinstance(node, dict):
        if set(node) == {"$t"}:
            i = node["$t"]
            if type(i) is not int or not 0 <= i < len(tensors):
                raise StateFormatError(f"tensor reference {i!r} out of range")
            return tensors[i]
        if set(node) == {"$tuple"} and isinstance(node["$tuple"], list):
            return tuple(_decode(v, tensors, depth + 1) for v in node["$tuple"])
        if set(node) == {"$d"} and isinstance(node["$d"], list):
            out = {}
            for pair in node["$d"]:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise StateFormatError("bad dict entry")
                key = _decode(pair[0], tensors, depth + 1)
                if not isinstance(key, (int, str, float, bool)) and key is not None:
                    raise StateFormatError(f"dict key of type {type(key).__name__}")
                out[key] = _decode(pair[1], tensors, depth + 1)
            return out
        if any(k.startswith("$") for k in node):
            raise StateFormatError(f"unknown marker in {sorted(node)[:3]}")
        return {k: _decode(v, tensors, depth + 1) for k, v in node.items()}
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    raise StateFormatError(f"unexpected {type(node).__name__} in the tree")


def to_values(data: bytes) -> torch.Tensor:
    """``data`` as fp32 values, 3 bytes each (zero-padded), doubled: what a sender contributes."""
    padded = data + b"\0" * (-len(data) % 3)
    b = torch.frombuffer(bytearray(padded), dtype=torch.uint8).to(torch.int32).reshape(-1, 3) if padded else \
        torch.empty(0, 3, dtype=torch.int32)
    return ((b[:, 0] << 16) | (b[:, 1] << 8) | b[:, 2]).to(torch.float32) * 2


def num_values(nbytes: int) -> int:
    """How many fp32 values ``to_values`` makes of ``nbytes`` bytes."""
    return -(-nbytes // 3)


def from_values(values: torch.Tensor, nbytes: int) -> bytes:
    """The bytes a receiver gets back from the ring's mean ``values`` (the first ``nbytes``)."""
    if values.numel() != num_values(nbytes):
        raise StateFormatError(f"{values.numel()} values cannot hold {nbytes} bytes")
    v = values.to("cpu", torch.float32)
    if not torch.equal(v, v.round()) or bool((v < 0).any()) or bool((v >= 1 << 24).any()):
        raise StateFormatError("values are not the integers a state transfer carries")
    w = v.to(torch.int32)
    out = torch.stack([(w >> 16) & 0xFF, (w >> 8) & 0xFF, w & 0xFF], dim=1).to(torch.uint8).reshape(-1)
    return out.numpy().tobytes()[:nbytes]
