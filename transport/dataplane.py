"""The data-plane process: one rank's transport, run apart from its trainer (`transport.process`).

    python -m transport.dataplane FD

FD is this end of the control socket pair (`transport.control`). The first message builds the
transport; then each message is a request: map a shared-memory segment, start a collective on
vectors in those segments, abort one, connect, probe, read the counters, close. Replies carry the
request's id. A collective gets two: ``started`` (or the error that refused it) and ``done``
(or the error that ended it), so the trainer sees exactly the errors an in-process transport
raises, at the same calls.

The process ignores SIGINT and SIGTERM (a terminal's Ctrl-C or torchrun's stop reach the whole
process group; the trainer decides when its data plane ends) and exits when the control channel
closes, which it does when the trainer exits in any way.
"""

from __future__ import annotations

import logging
import mmap
import os
import signal
import socket
import sys
import threading
from typing import Any

import torch

from .control import (COUNTERS, ControlClosed, codec_from_spec, credentials_from_spec, error_spec, recv_message,
                      send_message)
from .link_spec import link_class

log = logging.getLogger("transport.dataplane")


def build_transport(spec: dict) -> Any:
    """The link the init message describes (a name of ``link_spec.LINKS``), listening."""
    from .shaping import TokenBucket
    from .tls import TlsConfig

    kwargs = dict(spec["options"])
    kwargs["secret"] = credentials_from_spec(spec["credentials"])
    if spec.get("tls"):
        kwargs["tls"] = TlsConfig(*spec["tls"])
    if spec.get("shaper"):
        kwargs["shaper"] = TokenBucket(*spec["shaper"])
    return link_class(spec["link"])(**kwargs)


class DataPlaneServer:
    """Serves one trainer's requests on ``sock`` with ``transport``."""

    def __init__(self, sock: socket.socket, transport: Any) -> None:
        self.sock, self.t = sock, transport
        self._send_lock = threading.Lock()
        self._segments: dict[int, tuple[mmap.mmap, torch.Tensor]] = {}
        self._handles: dict[int, Any] = {}
        self._codecs: dict[str, Any] = {}  # one codec object per spec: a stochastic codec keeps its stream

    def reply(self, obj: dict) -> None:
        with self._send_lock:
            try:
                send_message(self.sock, obj)
            except OSError:  # the trainer is gone; the loop will see EOF
                pass

    def serve(self) -> None:
        """Handle requests until the channel closes or a close request arrives."""
        while True:
            try:
                msg, fds = recv_message(self.sock)
            except (ControlClosed, OSError):
                return
            op = msg.get("op")
            try:
                if op == "segment":
                    self._map(int(msg["seg"]), int(msg["size"]), fds)
                elif op == "drop":
                    self._segments.pop(int(msg["seg"]), None)
                elif op in ("all_reduce", "all_gather_mean"):
                    self._collective(msg)
                elif op == "abort":
                    self._abort(int(msg["id"]), str(msg["reason"]))
                elif op in ("connect", "probe"):
                    threading.Thread(target=self._blocking, args=(msg,), daemon=True, name=f"dataplane-{op}").start()
                elif op == "counters":
                    self.reply({"id": msg["id"], "ok": {name: getattr(self.t, name) for name in COUNTERS}})
                elif op == "close":
                    self.t.close(float(msg.get("flush_timeout_s", 5.0)))
                    self.reply({"id": msg["id"], "ok": True})
                    return
                else:
                    raise ValueError(f"unknown request {op!r}")
            except Exception as e:
                if "id" in msg:
                    self.reply({"id": msg["id"], "error": error_spec(e)})
                else:
                    log.error("data-plane request %r failed: %s", op, e)
            finally:
                for fd in fds:
                    os.close(fd)

    def _map(self, seg: int, size: int, fds: list[int]) -> None:
        if len(fds) != 1:
            raise ValueError(f"segment {seg} arrived with {len(fds)} file descriptors, want 1")
        mm = mmap.mmap(fds[0], size)
        self._segments[seg] = (mm, torch.frombuffer(mm, dtype=torch.uint8))

    def _view(self, where: list[int]) -> torch.Tensor:
        """The float32 vector at [segment, byte offset, elements]."""
        seg, offset, n = (int(v) for v in where)
        buf = self._segments[seg][1]
        if offset < 0 or offset % 4 or offset + 4 * n > buf.numel():
            raise ValueError(f"vector at {offset} + {4 * n} bytes does not fit segment {seg}")
        return buf[offset : offset + 4 * n].view(torch.float32)

    def _codec(self, spec: dict | None) -> Any:
        if spec is None:
            return None
        key = repr(sorted(spec["params"].items())) + spec["name"]
        if key not in self._codecs:
            self._codecs[key] = codec_from_spec(spec)
        return self._codecs[key]

    def _collective(self, msg: dict) -> None:
        rid = int(msg["id"])
        kw: dict[str, Any] = dict(tag=str(msg["tag"]), codec=self._codec(msg.get("codec")), timeout_s=msg.get("timeout_s"),
                                  out=self._view(msg["out"]), groups=msg.get("groups"), finite=bool(msg.get("finite")))
        if msg["op"] == "all_gather_mean":
            kw.update(sent=self._view(msg["sent"]), scales=msg.get("scales"))
            h = self.t.all_gather_mean(self._view(msg["x"]), list(msg["ring"]), int(msg["index"]), **kw)
        else:
            h = self.t.all_reduce(self._view(msg["x"]), list(msg["ring"]), int(msg["index"]), **kw)
        self._handles[rid] = h
        self.reply({"id": rid, "started": True})
        threading.Thread(target=self._finish, args=(rid, h), daemon=True, name=f"dataplane-wait[{kw['tag']}]").start()

    def _finish(self, rid: int, h: Any) -> None:
        try:
            h.wait()
            result: dict = {"id": rid, "ok": True}
        except Exception as e:
            result = {"id": rid, "error": error_spec(e)}
        self._handles.pop(rid, None)
        self.reply(result)

    def _abort(self, rid: int, reason: str) -> None:
        h = self._handles.get(rid)
        if h is not None:
            h.abort(reason)

    def _blocking(self, msg: dict) -> None:
        try:
            if msg["op"] == "connect":
                self.t.connect(str(msg["peer"]), msg.get("timeout_s"))
                value: Any = True
            else:
                value = self.t.probe(str(msg["peer"]), int(msg["nbytes"]), msg.get("timeout_s"))
            self.reply({"id": msg["id"], "ok": value})
        except Exception as e:
            self.reply({"id": msg["id"], "error": error_spec(e)})


def main(argv: list[str]) -> int:
    """Entry point: ``python -m transport.dataplane FD``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s data-plane[{os.getpid()}] %(name)s %(levelname)s: %(message)s")
    sock = socket.socket(fileno=int(argv[0]))
    try:
        spec, _ = recv_message(sock)
    except (ControlClosed, OSError):
        return 1
    torch.set_num_threads(max(1, int(spec.get("threads", 1))))
    try:
        transport = build_transport(spec)
    except Exception as e:
        send_message(sock, {"id": 0, "error": error_spec(e)})
        return 1
    send_message(sock, {"id": 0, "ok": {"address": transport.address, "group": transport.group}})
    try:
        DataPlaneServer(sock, transport).serve()
    finally:
        transport.close(1.0)
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
