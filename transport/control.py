"""The control channel between a trainer and its data-plane process (`transport.process`).

Messages are length-prefixed JSON objects on a Unix stream socket pair; shared-memory segments
travel beside them as file descriptors (SCM_RIGHTS). Nothing is unpickled: the child is started
with a file descriptor number and everything else, credentials included, arrives here.

Also here: how a codec, credentials and errors are written as JSON and read back.
"""

from __future__ import annotations

import array
import builtins
import json
import socket
import struct
from typing import Any

from . import errors as transport_errors
from .identity import Credentials, GroupKeys, SharedSecret

_HEADER = struct.Struct("!I")
#: Largest control message, bytes (a ring of a thousand members is a few tens of KB).
MAX_CONTROL_BYTES = 16 << 20
_MAX_FDS = 4
#: Counters of a transport that its trainer may read (`TransportBase` properties).
COUNTERS = ("bytes_sent", "bytes_received", "rejected_connections", "handshake_timeouts",
            "unauthenticated_connections", "max_unauthenticated_seen", "max_reserved_seen",
            "ignored_messages", "pending_bytes", "dropped_pending_messages")


class ControlClosed(ConnectionError):
    """The other end of the control channel is gone."""


def send_message(sock: socket.socket, obj: dict, fds: list[int] = ()) -> None:
    """Write one JSON object (and the file descriptors ``fds``) to ``sock``; the caller serializes writers."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_CONTROL_BYTES:
        raise ValueError(f"control message of {len(body)} bytes exceeds {MAX_CONTROL_BYTES}")
    data = _HEADER.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def recv_message(sock: socket.socket) -> tuple[dict, list[int]]:
    """Read one JSON object and the file descriptors sent with it; ControlClosed at EOF."""
    header = bytearray()
    fds: list[int] = []
    while len(header) < _HEADER.size:
        data, anc, _flags, _addr = sock.recvmsg(_HEADER.size - len(header), socket.CMSG_SPACE(_MAX_FDS * 4))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
                fds.extend(arr)
        if not data:
            raise ControlClosed("control channel closed")
        header += data
    (size,) = _HEADER.unpack(header)
    if size > MAX_CONTROL_BYTES:
        raise ValueError(f"control message of {size} bytes exceeds {MAX_CONTROL_BYTES}")
    body = bytearray(size)
    view, got = memoryview(body), 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if not n:
            raise ControlClosed("control channel closed mid-message")
        got += n
    obj = json.loads(body)
    if not isinstance(obj, dict):
        raise ValueError("a control message must be a JSON object")
    return obj, fds


def codec_spec(codec: Any) -> dict | None:
    """A codec as JSON (name and constructor parameters); None for the default (fp32)."""
    if codec is None:
        return None
    return {"name": codec.name, "params": dict(codec.params)}


def codec_from_spec(spec: dict | None) -> Any:
    """`codec_spec`'s inverse."""
    if spec is None:
        return None
    import compress

    return compress.get_codec(spec["name"], **spec["params"])


def credentials_spec(creds: "bytes | Credentials") -> dict:
    """Data-plane credentials as JSON: a job-wide secret or one group's keyring (with the job
    secret, when the keyring derives keys on demand). Secret: only for the control channel."""
    if isinstance(creds, (bytes, bytearray)):
        return {"secret": bytes(creds).hex()}
    if isinstance(creds, SharedSecret):
        return {"secret": creds._secret.hex()}
    if isinstance(creds, GroupKeys):
        return {"group": creds.group, "keys": {str(h): k.hex() for h, k in creds._keys.items()},
                "job_secret": creds._job_secret.hex() if creds._job_secret is not None else None}
    raise ValueError(f"credentials of type {type(creds).__name__} cannot be handed to a data-plane process")


def credentials_from_spec(spec: dict) -> "bytes | GroupKeys":
    """`credentials_spec`'s inverse."""
    if "secret" in spec:
        return bytes.fromhex(spec["secret"])
    job = spec.get("job_secret")
    return GroupKeys(int(spec["group"]), {int(h): bytes.fromhex(k) for h, k in spec["keys"].items()},
                     job_secret=bytes.fromhex(job) if job else None)


def error_spec(e: BaseException) -> dict:
    """An exception as JSON: its class name and message."""
    return {"type": type(e).__name__, "message": str(e)}


def error_from_spec(spec: dict) -> BaseException:
    """The exception `error_spec` describes: the transport's own error types and Python's
    built-in ones by name; anything else a TransportError naming the original type."""
    name, message = str(spec.get("type", "")), str(spec.get("message", ""))
    cls = getattr(transport_errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, transport_errors.TransportError)):
        cls = getattr(builtins, name, None)
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            return transport_errors.TransportError(f"{name}: {message}")
    try:
        return cls(message)
    except Exception:  # an exception type with another constructor
        return transport_errors.TransportError(f"{name}: {message}")
