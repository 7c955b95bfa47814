"""`ProcessTransport`: a rank's transport run in a child process, so the trainer keeps its interpreter.

An in-process transport does its per-chunk work (framing, checksums, sums, socket calls) in
threads of the trainer's process, and the Python parts of that work hold the interpreter lock
the training loop needs to launch its kernels: `bench/gil.py` measured a trainer losing 38 %
(fp32) / 19 % (int8) of its launch rate to a ring running beside it, against the same ring run
from a child process. This class is that child process behind the transport's own interface
(`all_reduce`, `all_gather_mean`, `connect`, `probe`, the counters, `close`), as torchft runs
its process groups in a subprocess:

* vectors cross through shared memory (memfd segments mapped by both processes, reused from
  collective to collective): the caller's vector is copied in once when a collective starts,
  the mean copied out once when it ends -- memory copies that release the interpreter lock;
* requests and replies are small JSON messages on a Unix socket pair (`transport.control`); no
  pickle, the credentials travel there, not on a command line;
* errors are the transport's own, raised at the same calls: a refused collective at
  `all_reduce`, a failed one at `Handle.wait`; a data plane that dies fails every pending and
  later call with a `TransportError` that says so.

GPU vectors are copied to the host segment when a collective starts (the child works on host
memory), so on a GPU host the in-process transport, which encodes on the device, may be faster
for large quantized vectors; `bench/gil.py` and `bench/gpu.py` measure both.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from .control import (COUNTERS, ControlClosed, codec_spec, credentials_spec, error_from_spec, recv_message,
                      send_message)
from .errors import TransportError
from .outputs import check_out, overlaps
from .process_handle import ProcessHandle, Segment, segment_size
from .shaping import TokenBucket
from .streams import side_stream_for
from .tls import TlsConfig

log = logging.getLogger(__name__)

_ALIGN = 64  # bytes between vectors in a segment


class _Call:
    """A request awaiting its reply (or, for a collective, its two replies)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reply: dict | None = None

    def resolve(self, reply: dict) -> None:
        self.reply = reply
        self.event.set()

    def result(self) -> Any:
        assert self.reply is not None
        return _reply_value(self.reply)


def _reply_value(reply: dict) -> Any:
    """A reply's value, or the error it carries raised."""
    if "error" in reply:
        raise error_from_spec(reply["error"])
    return reply.get("ok")


class ProcessTransport:
    """A link of ``link_spec.LINKS`` (``link``, checked by the child: an unknown one raises ValueError) running
    in a child process.

    Parameters are those of the link class (``host``, ``port``, ``secret``, ``timeout_s``,
    ``tls``, ``shaper``, ``connections_per_peer``, ``chunk_bytes`` and the listener's guards);
    ``threads``: torch threads of the data-plane process (for the codecs' and sums' work;
    default 1, so the data plane takes one core beside the trainer's); ``start_timeout_s``:
    how long the child may take to start and listen. Raises what the link's constructor raises
    (ValueError for a bad setting, OSError when it cannot listen).
    """

    def __init__(self, link: str = "tcp", host: str = "127.0.0.1", port: int = 0, *, secret: Any,
                 timeout_s: float = 60.0, tls: TlsConfig | None = None, shaper: TokenBucket | None = None,
                 threads: int = 1, start_timeout_s: float = 120.0, **options: Any) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.timeout_s = float(timeout_s)
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._handles: dict[int, ProcessHandle] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._free: dict[int, list[Segment]] = {}
        self._segments: list[Segment] = []
        self._seg_ids = itertools.count(1)
        self._dead: str | None = None
        self._closed = False
        spec = {
            "link": link, "threads": int(threads), "credentials": credentials_spec(secret),
            "tls": [tls.cert_file, tls.key_file, tls.ca_file, tls.check_hostname] if tls is not None else None,
            "shaper": [shaper.rate, shaper.burst] if shaper is not None else None,
            "options": {"host": host, "port": port, "timeout_s": timeout_s, **options},
        }
        self._sock, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "transport.dataplane", str(child_end.fileno())],
                pass_fds=[child_end.fileno()], stdin=subprocess.DEVNULL, env=_child_env(),
            )
        finally:
            child_end.close()
        try:
            send_message(self._sock, spec)
            self._sock.settimeout(start_timeout_s)
            try:
                reply, _ = recv_message(self._sock)
            except (ControlClosed, OSError) as e:
                raise TransportError(f"the data-plane process did not start ({e}; exit code {self._proc.poll()})") from None
            self._sock.settimeout(None)
            ready = _reply_value(reply)
        except BaseException:
            self._kill()
            raise
        #: "host:port" that peers dial (the child's listener)
        self.address: str = ready["address"]
        #: the group this side proves in every handshake (None: a job-wide shared secret)
        self.group: int | None = ready["group"]
        self._reader = threading.Thread(target=self._read_replies, name=f"dataplane-replies@{self.address}", daemon=True)
        self._reader.start()

    # -- collectives -------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, ring: list[str], index: int, *, tag: str, codec: Any = None,
                   timeout_s: float | None = None, out: torch.Tensor | None = None, groups: list[int] | None = None,
                   finite: bool = False) -> ProcessHandle:
        """As `TransportBase.all_reduce`, run by the data-plane process."""
        return self._collective("all_reduce", x, ring, index, tag=tag, codec=codec, timeout_s=timeout_s, out=out,
                                groups=groups, finite=finite)

    def all_gather_mean(self, x: torch.Tensor, ring: list[str], index: int, *, tag: str, codec: Any = None,
                        timeout_s: float | None = None, out: torch.Tensor | None = None, sent: torch.Tensor | None = None,
                        groups: list[int] | None = None, finite: bool = False,
                        scales: list[float] | None = None) -> ProcessHandle:
        """As `TransportBase.all_gather_mean`, run by the data-plane process."""
        return self._collective("all_gather_mean", x, ring, index, tag=tag, codec=codec, timeout_s=timeout_s, out=out,
                                sent=sent, groups=groups, finite=finite, scales=scales)

    def _collective(self, op: str, x: torch.Tensor, ring: list[str], index: int, *, tag: str, codec: Any,
                    timeout_s: float | None, out: torch.Tensor | None, groups: list[int] | None, finite: bool,
                    sent: torch.Tensor | None = None, scales: list[float] | None = None) -> ProcessHandle:
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.float32:
            raise ValueError(f"x must be a 1-D float32 tensor, got {getattr(x, 'dtype', type(x).__name__)} "
                             f"{tuple(getattr(x, 'shape', ()))}")
        n = x.numel()
        for buf in (out, sent):
            if buf is not None:
                check_out(buf, x)
        if out is not None and sent is not None and overlaps(sent, out):
            raise ValueError("sent must not overlap out")
        names = ["x", "out"] + (["sent"] if op == "all_gather_mean" else [])
        stride = (4 * n + _ALIGN - 1) // _ALIGN * _ALIGN
        seg = self._acquire(stride * len(names))
        views = {name: seg.vector(i * stride, n) for i, name in enumerate(names)}
        rid = next(self._ids)
        try:
            views["x"].copy_(x.detach())
            msg: dict[str, Any] = {
                "op": op, "tag": tag, "ring": list(ring), "index": int(index), "codec": codec_spec(codec),
                "timeout_s": timeout_s, "groups": list(groups) if groups is not None else None, "finite": bool(finite),
                **{name: [seg.id, i * stride, n] for i, name in enumerate(names)},
            }
            if scales is not None:
                msg["scales"] = [float(s) for s in scales]
            handle = ProcessHandle(self, rid, tag, seg, x, views, out, sent, side_stream_for(x))
            with self._lock:
                self._handles[rid] = handle
            self._request(msg, rid=rid)  # raises what refused the collective; then "done" comes to the handle
        except BaseException:
            with self._lock:
                self._handles.pop(rid, None)
            self.release(seg)
            raise
        return handle

    # -- other requests ----------------------------------------------------------------------------
    def connect(self, peer: str, timeout_s: float | None = None) -> None:
        """Open the connections to peer now (as `TransportBase.connect`)."""
        self._request({"op": "connect", "peer": peer, "timeout_s": timeout_s})

    def probe(self, peer: str, nbytes: int = 8 << 20, timeout_s: float | None = None) -> float:
        """Measured bytes/s to peer (as `TransportBase.probe`)."""
        return float(self._request({"op": "probe", "peer": peer, "nbytes": int(nbytes), "timeout_s": timeout_s}))

    def counters(self) -> dict[str, int]:
        """The transport's counters (bytes, refusals, ignored and pending messages) in one request."""
        return dict(self._request({"op": "counters"}))

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Abort running collectives, flush queued sends, stop the data-plane process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._dead is None:
            try:
                self._request({"op": "close", "flush_timeout_s": flush_timeout_s}, timeout_s=flush_timeout_s + 10.0,
                              closing=True)
            except Exception as e:  # noqa: BLE001 - a dead or stuck child is stopped below
                log.warning("data-plane process at %s did not close cleanly: %s", self.address, e)
        try:
            self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self._kill()
        self._fail_all("transport closed")
        self._sock.close()
        self._reader.join(2.0)
        self._unmap()

    def __enter__(self) -> "ProcessTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- machinery ---------------------------------------------------------------------------------
    def _acquire(self, nbytes: int) -> Segment:
        """A free segment of at least nbytes, mapped in the child (made and sent if none is free)."""
        size = segment_size(nbytes)
        with self._lock:
            self._check_usable()
            free = self._free.get(size)
            if free:
                return free.pop()
            seg = Segment(next(self._seg_ids), size)
            self._segments.append(seg)
        try:
            with self._send_lock:
                send_message(self._sock, {"op": "segment", "seg": seg.id, "size": size}, [seg.fd])
        except OSError as e:
            raise self._died(f"sending a segment failed: {e}") from None
        finally:
            os.close(seg.fd)
        return seg

    def release(self, seg: Segment) -> None:
        """Take back ``seg`` (a ``ProcessHandle`` whose results were copied out): free for the next collective."""
        with self._lock:
            self._free.setdefault(seg.size, []).append(seg)

    def _check_usable(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")
        if self._dead is not None:
            raise TransportError(self._dead)

    def _request(self, msg: dict, *, rid: int | None = None, timeout_s: float | None = None, closing: bool = False) -> Any:
        """Send a request and wait for its (first) reply; the result, or the error raised."""
        rid = next(self._ids) if rid is None else rid
        call = _Call()
        with self._lock:
            if not closing:
                self._check_usable()
            self._calls[rid] = call
        try:
            with self._send_lock:
                send_message(self._sock, {**msg, "id": rid})
        except OSError as e:
            with self._lock:
                self._calls.pop(rid, None)
            raise self._died(f"the data-plane process is gone ({e})") from None
        if not call.event.wait(timeout_s):
            with self._lock:
                self._calls.pop(rid, None)
            raise TransportError(f"the data-plane process did not answer {msg['op']!r} within {timeout_s:g} s")
        return call.result()

    def send_quietly(self, msg: dict) -> None:
        """Send a request that needs no reply (an abort). If the socket is gone, so is the child:
        the reader thread then fails every pending handle with the reason, so nothing is lost."""
        try:
            with self._send_lock:
                send_message(self._sock, msg)
        except OSError:  # the child exited: reported through _read_replies, not here
            pass

    def _read_replies(self) -> None:
        while True:
            try:
                reply, fds = recv_message(self._sock)
            except (ControlClosed, OSError, ValueError) as e:
                if not self._closed:
                    self._died(f"the data-plane process exited (exit code {self._proc.poll()}; {e})")
                return
            for fd in fds:  # the child sends none; never leak one
                os.close(fd)
            rid = int(reply.get("id", -1))
            with self._lock:
                call = self._calls.pop(rid, None)
                handle = self._handles.pop(rid, None) if call is None else None
            if call is not None:
                call.resolve(reply)
                if "error" in reply:  # a refused collective: its handle gets no second reply
                    with self._lock:
                        self._handles.pop(rid, None)
            elif handle is not None:
                handle._take_reply(reply)

    def _died(self, reason: str) -> TransportError:
        with self._lock:
            if self._dead is None:
                self._dead = reason
        self._fail_all(self._dead)
        return TransportError(self._dead)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            calls, handles = list(self._calls.values()), list(self._handles.values())
            self._calls.clear()
            self._handles.clear()
        for call in calls:
            call.resolve({"error": {"type": "TransportError", "message": reason}})
        for h in handles:
            h._finish(None, TransportError(f"{h.tag!r}: {reason}"))

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._sock.close()

    def _unmap(self) -> None:
        with self._lock:
            segments, self._segments, self._free = self._segments, [], {}
        for seg in segments:
            seg.bytes = None
            try:
                seg.map.close()
            except BufferError:  # a result view still exported: the mapping goes with it
                pass


def _counter(name: str) -> property:
    return property(lambda self: self.counters()[name], doc=f"The data-plane transport's {name}.")


for _name in COUNTERS:
    setattr(ProcessTransport, _name, _counter(_name))


def _child_env() -> dict[str, str]:
    """The environment of the data-plane process: this one's, with this package importable and
    no GPU visible. The child works on host memory only; with a GPU visible its transport would
    pin its receive buffers (the default where CUDA is available), which creates a CUDA context
    (some hundreds of MiB) on GPU 0 for every rank's child, and fails where GPUs are in
    exclusive-process mode."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env
