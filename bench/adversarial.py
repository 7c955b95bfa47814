"""Adversarial benchmark: every attack class of issue 15 against real listeners on 127.0.0.1.

Honest members (one transport per group, each with its group's credentials derived from a job
secret) run ring all-reduces over and over while an attacker runs one attack; then they run one
more. Each attack gives one record:

  attack            name of the attack (see ATTACKS)
  honest_ok         every honest collective during and after the attack completed, bit-exact,
                    within its deadline (timeout_s); for coordinator attacks also: every honest
                    quorum committed, and Ping and heartbeats answered within 1 s
  rss_growth_mb     peak growth of this process's resident memory during the attack, over the
                    level after a warm-up round (honest members *and* attacker live in this
                    process, so it is an upper bound for a member)
  unauth_slots_max  the most unauthenticated connections (or gRPC streams) from strangers any
                    honest listener held at once (the shared slots; cap: max_unauthenticated)
  reserved_slots_max  the same for connections from members' addresses (their reserved slots;
                    cap: transport.guard.DEFAULT_MAX_PER_KNOWN_SOURCE per address)
  unauth_life_max_s the longest any honest listener held a connection unauthenticated, from
                    accepting it to having closed it (the deadline: handshake_timeout_s)
  ...               attack-specific counts: rejected / timed-out connections, how long the
                    attacker saw its connections live (client_life_max_s: the listener's close
                    plus the attacker's ~10 ms polling), messages ignored, Ping latency, ...

    python bench/adversarial.py --json bench/results/adversarial.json
    python bench/adversarial.py --quick --only slowloris-tcp abort-forgery

Attackers bind loopback addresses 127.0.0.2.. (per-source caps tell them from the members on
127.0.0.1), except over gRPC, whose Python client cannot choose its source address: its streams
come from the members' own address and so meet the reserved slots' cap.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import select
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402

import compress  # noqa: E402
from compress import frame as cframe  # noqa: E402
from diloco.coordinator import CoordinatorClient, CoordinatorError, CoordinatorServer  # noqa: E402
from diloco.coordinator.credentials import group_token  # noqa: E402
from diloco.coordinator.messages import (SERVICE, Ack, CommitRequest, HeartbeatRequest,  # noqa: E402
                                         HeartbeatResponse, JoinRequest, JoinResponse, Ping, QuorumRequest,
                                         RoundRequest, StopRequest, SummaryRequest)
from transport import TcpTransport  # noqa: E402
from transport.auth import dial_handshake  # noqa: E402
from transport.errors import PeerAuthError, TransportError  # noqa: E402
from transport.grpclink import METHOD, GrpcTransport  # noqa: E402
from transport.identity import GroupKeys  # noqa: E402
from transport.wire import MsgType, pack_header  # noqa: E402

JOB_SECRET = b"adversarial-bench-job-secret-0123456789"
JOB_TOKEN = "adversarial-bench-job-token"
INSIDER = 5  # a group of the job that is not in the honest ring: holds real credentials of group 5
SOURCES = [f"127.0.0.{i}" for i in range(2, 14)]


@dataclass
class Settings:
    """Sizes of the honest job and of the attacks (``quick`` / ``test`` shrink the attacks)."""

    n: int = 1 << 20  # elements of the honest vector (fp32: 4 MiB)
    timeout_s: float = 5.0  # the collectives' deadline
    handshake_timeout_s: float = 2.0
    max_unauthenticated: int = 64
    max_per_source: int = 8
    max_pending_bytes: int = 16 << 20
    pending_ttl_s: float | None = None  # None: the transport's default, 2 x timeout_s
    chunk_bytes: int = 256 << 10
    period_s: float = 0.2  # pause between honest collectives during an attack
    duration_s: float = 6.0  # how long each attack runs
    loris: int = 200  # slow-loris connections kept open at once
    idle_tcp: int = 1100
    idle_grpc: int = 600
    claims: int = 6  # connections announcing 255 MiB each
    pending_frames: int = 2000
    flood: int = 300  # blocking coordinator calls
    slow_calls: int = 100  # coordinator calls that never send their request


QUICK = dict(n=1 << 16, duration_s=3.0, loris=40, idle_tcp=200, idle_grpc=100, claims=3, pending_frames=400,
             flood=60, slow_calls=20, handshake_timeout_s=1.0)
#: what the test suite runs (tests/transport/test_transport_adversarial.py and the coordinator's)
TEST = dict(QUICK, n=1 << 14, duration_s=2.0, loris=24, idle_tcp=150, idle_grpc=40, claims=2, pending_frames=200,
            flood=30, slow_calls=10, handshake_timeout_s=0.8, max_pending_bytes=4 << 20, pending_ttl_s=1.5,
            chunk_bytes=64 << 10)


# --- measuring ---------------------------------------------------------------------------------

def rss_bytes() -> int:
    """Resident memory of this process (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def start_cuda_host_side() -> None:
    """Where CUDA is available the transports receive into pinned buffers, and the first one
    starts the CUDA driver: a one-time ~100 MB of host mappings (measured on an H200 host: 104 MB
    in the first attack of a process, 0.5 MB in the second). A GPU worker has it before any peer
    connects, so it belongs in the baseline, not in an attack's growth."""
    if torch.cuda.is_available():
        torch.empty(1, dtype=torch.uint8, pin_memory=True)


class RssPeak:
    """Samples RSS every 5 ms in a thread; ``growth_mb``: peak minus the level at start."""

    def __init__(self) -> None:
        self.base = rss_bytes()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> "RssPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def growth_mb(self) -> float:
        return round((self.peak - self.base) / 2**20, 1)


# --- the honest members ------------------------------------------------------------------------

class Honest:
    """Honest members of groups ``groups`` (one transport each) and their ring all-reduce."""

    def __init__(self, s: Settings, link: str = "tcp", groups: tuple[int, ...] = (0, 1, 2)) -> None:
        cls = TcpTransport if link == "tcp" else GrpcTransport
        self.s, self.groups = s, list(groups)
        self.ts = [cls("127.0.0.1", 0, secret=GroupKeys.derive(JOB_SECRET, g), timeout_s=s.timeout_s,
                       handshake_timeout_s=s.handshake_timeout_s, max_unauthenticated=s.max_unauthenticated,
                       max_unauthenticated_per_source=s.max_per_source, max_pending_bytes=s.max_pending_bytes,
                       pending_ttl_s=s.pending_ttl_s, chunk_bytes=s.chunk_bytes) for g in groups]
        gen = torch.Generator().manual_seed(0)
        # integers: the ring's sums are exact in any order, so the mean is known bit for bit
        self.xs = [torch.randint(-1000, 1000, (s.n,), generator=gen).float() for _ in groups]
        self.rounds: list[tuple[bool, float, str]] = []
        self._seq = 0

    @property
    def ring(self) -> list[str]:
        return [t.address for t in self.ts]

    def member(self, group: int):
        return self.ts[self.groups.index(group)]

    def left_of(self, group: int) -> tuple[str, int]:
        """(address, group) of the left neighbour of ``group`` in the ring."""
        i = self.groups.index(group)
        return self.ts[i - 1].address, self.groups[i - 1]

    def all_reduce(self, tag: str, idx: list[int] | None = None) -> tuple[bool, float, str]:
        """One ring all-reduce among members ``idx`` (all by default); (ok, seconds, error)."""
        idx = list(range(len(self.ts))) if idx is None else idx
        ring, groups = [self.ts[i].address for i in idx], [self.groups[i] for i in idx]
        want = sum(self.xs[i] for i in idx) / len(idx)
        start = time.monotonic()
        try:
            hs = [self.ts[i].all_reduce(self.xs[i], ring, k, tag=tag, groups=groups, finite=True)
                  for k, i in enumerate(idx)]
            outs = [h.wait(self.s.timeout_s * 3) for h in hs]
        except Exception as e:  # noqa: BLE001 - recorded
            return False, time.monotonic() - start, f"{type(e).__name__}: {e}"[:300]
        took = time.monotonic() - start
        exact = all(torch.equal(o, want) for o in outs)
        ok = exact and took <= self.s.timeout_s
        return ok, took, "" if ok else ("wrong result" if not exact else f"took {took:.2f} s")

    def round(self) -> tuple[bool, float, str]:
        self._seq += 1
        r = self.all_reduce(f"honest/{self._seq}")
        self.rounds.append(r)
        return r

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Run honest collectives back to back (period_s apart) while the block runs."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                self.round()
                stop.wait(self.s.period_s)

        th = threading.Thread(target=loop, name="honest", daemon=True)
        th.start()
        try:
            yield
        finally:
            stop.set()
            th.join(self.s.timeout_s * 4)

    def unauth_peak(self) -> int:
        """The most strangers' connections (shared slots) any member held unauthenticated."""
        return max(t.max_unauthenticated_seen for t in self.ts)

    def listener_view(self) -> dict[str, Any]:
        """Reserved slots used and the longest any member held a connection unauthenticated."""
        return {"reserved_slots_max": max(t.max_reserved_seen for t in self.ts),
                "unauth_life_max_s": round(max(t.longest_unauthenticated_s for t in self.ts), 3)}

    def counters(self) -> dict[str, int]:
        return {"rejected_connections": sum(t.rejected_connections for t in self.ts),
                "handshake_timeouts": sum(t.handshake_timeouts for t in self.ts),
                "ignored_messages": sum(t.ignored_messages for t in self.ts),
                "dropped_pending": sum(t.dropped_pending_messages for t in self.ts)}

    def close(self) -> None:
        for t in self.ts:
            t.close(flush_timeout_s=1.0)


# --- attacker tools ----------------------------------------------------------------------------

def raw_connect(target: str, source: str) -> socket.socket | None:
    """A raw TCP connection from ``source`` (None if refused outright)."""
    host, port = target.rsplit(":", 1)
    try:
        return socket.create_connection((host, int(port)), timeout=2, source_address=(source, 0))
    except OSError:
        return None


def insider_connection(target: str, claimed: str, group: int = INSIDER, source: str = "127.0.0.1") -> socket.socket:
    """An authenticated connection into ``target`` by a holder of ``group``'s real credentials
    that claims to be at ``claimed``."""
    host, port = target.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))
    dial_handshake(s, GroupKeys.derive(JOB_SECRET, group), claimed, target)
    return s


def closed(s: socket.socket) -> bool:
    """Whether the peer closed s (EOF or reset), without blocking."""
    try:
        r, _, _ = select.select([s], [], [], 0)
        if not r:
            return False
        return s.recv(1) == b""
    except OSError:
        return True


class Lifetimes:
    """Attacker connections: a thread watches them (epoll) and records, to within ~10 ms, how long
    each lived until the listener closed it."""

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._opened: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self.lives: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lifetimes", daemon=True)
        self._thread.start()

    def add(self, s: socket.socket) -> None:
        with self._lock:
            self._opened[s] = time.monotonic()
            self._sel.register(s, selectors.EVENT_READ)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._opened)

    def sockets(self) -> list[socket.socket]:
        with self._lock:
            return list(self._opened)

    def _watch(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                empty = not self._opened
            if empty:
                time.sleep(0.01)
                continue
            for key, _ in self._sel.select(timeout=0.01):
                s = key.fileobj
                if closed(s):
                    now = time.monotonic()
                    with self._lock:
                        self.lives.append(now - self._opened.pop(s))
                        self._sel.unregister(s)
                    s.close()

    def close_all(self) -> None:
        time.sleep(0.05)  # let the watcher see the last closes
        self._stop.set()
        self._thread.join(2)
        with self._lock:
            for s in self._opened:
                s.close()
            self._opened.clear()
        self._sel.close()

    @property
    def max_life_s(self) -> float:
        return round(max(self.lives, default=0.0), 2)


def grpc_stream(target: str, messages: Iterator[bytes], timeout_s: float) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    return channel, channel.stream_stream(METHOD)(messages, timeout=timeout_s)


# --- the attacks on the data plane -------------------------------------------------------------

def no_attack(h: Honest, s: Settings) -> dict[str, Any]:
    """The control: the honest members alone for the attack's duration (what the other rows'
    RSS growth is compared with)."""
    time.sleep(s.duration_s)
    return {}


def slowloris_tcp(h: Honest, s: Settings) -> dict[str, Any]:
    """Connections that send their HELLO one byte every 0.5 s (a per-read timeout would never fire)."""
    victim = h.ts[0].address
    hello = pack_header(MsgType.HELLO, b"", 0, 0, 0, 60) + bytes(60)
    conns = Lifetimes()
    pos: dict[socket.socket, int] = {}
    end = time.monotonic() + s.duration_s
    last_byte = 0.0
    while time.monotonic() < end:
        k = 0
        while conns.count < s.loris and k < s.loris:
            c = raw_connect(victim, SOURCES[(conns.count + k) % len(SOURCES)])
            k += 1
            if c is not None:
                conns.add(c)
                pos[c] = 0
        if time.monotonic() - last_byte >= 0.5:
            last_byte = time.monotonic()
            for c in conns.sockets():
                try:
                    c.send(hello[pos[c] % len(hello):pos[c] % len(hello) + 1])
                    pos[c] += 1
                except OSError:
                    pass
        time.sleep(0.05)
    conns.close_all()
    return {"connections_cut": len(conns.lives), "client_life_max_s": conns.max_life_s,
            "handshake_deadline_s": s.handshake_timeout_s}


def attacker(mode: str, **args: Any) -> dict[str, Any]:
    """Run bench/attacker.py in its own process (its memory is not the members'); what it saw."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "attacker.py"), mode, json.dumps(args)],
                         capture_output=True, text=True, timeout=float(args.get("duration_s", 30)) + 60)
    if out.returncode:
        raise RuntimeError(f"attacker {mode} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def slowloris_grpc(h: Honest, s: Settings) -> dict[str, Any]:
    """gRPC streams that send their HELLO one byte every 0.5 s (from another process)."""
    hello = pack_header(MsgType.HELLO, b"", 0, 0, 0, 60) + bytes(60)
    n = min(s.loris, 50)
    seen = attacker("grpc-loris", target=h.ts[0].address, streams=n, duration_s=s.duration_s, hello_hex=hello.hex())
    return {**seen, "concurrent_streams": n, "handshake_deadline_s": s.handshake_timeout_s}


def idle_flood_tcp(h: Honest, s: Settings) -> dict[str, Any]:
    """``idle_tcp`` idle connections at once (the issue: 1,100 took all 1,024 TCP slots), refilled
    as they are closed; a newcomer member dials a member under the flood and runs a collective."""
    victim = h.ts[0].address
    conns = Lifetimes()
    end = time.monotonic() + s.duration_s
    newcomer: dict[str, Any] = {}

    def join_newcomer() -> None:  # a member that connects for the first time during the flood
        time.sleep(s.duration_s / 3)
        t = TcpTransport("127.0.0.1", 0, secret=GroupKeys.derive(JOB_SECRET, 9), timeout_s=s.timeout_s)
        try:
            x = torch.ones(4096)
            start = time.monotonic()
            hs = [t.all_reduce(x, [t.address, victim], 0, tag="newcomer", groups=[9, 0]),
                  h.ts[0].all_reduce(x * 3, [t.address, victim], 1, tag="newcomer", groups=[9, 0])]
            outs = [hh.wait(s.timeout_s * 2) for hh in hs]
            newcomer["ok"] = all(torch.equal(o, torch.full((4096,), 2.0)) for o in outs)
            newcomer["seconds"] = round(time.monotonic() - start, 2)
        except Exception as e:  # noqa: BLE001 - recorded
            newcomer["ok"], newcomer["error"] = False, str(e)[:200]
        finally:
            t.close(1.0)

    th = threading.Thread(target=join_newcomer, daemon=True)
    th.start()
    opened = 0
    while time.monotonic() < end:
        while conns.count < s.idle_tcp and time.monotonic() < end:
            c = raw_connect(victim, SOURCES[opened % len(SOURCES)])
            opened += 1
            if c is not None:
                conns.add(c)
        time.sleep(0.05)
    th.join(s.timeout_s * 3)
    conns.close_all()
    return {"connections_opened": opened, "client_life_max_s": conns.max_life_s,
            "newcomer_ok": newcomer.get("ok", False), "newcomer_s": newcomer.get("seconds"),
            **({"newcomer_error": newcomer["error"]} if "error" in newcomer else {})}


def idle_streams_grpc(h: Honest, s: Settings) -> dict[str, Any]:
    """``idle_grpc`` idle gRPC streams at once (the issue: 600 exhausted the 512 concurrent RPCs)."""
    seen = attacker("grpc-idle", target=h.ts[0].address, streams=s.idle_grpc, duration_s=s.duration_s)
    return {"streams": s.idle_grpc, **seen}


def big_message_grpc(h: Honest, s: Settings) -> dict[str, Any]:
    """A gRPC stream whose first message, before any handshake, is 64 MiB (three times)."""
    seen = attacker("grpc-big", target=h.ts[0].address, megabytes=64, times=3, timeout_s=s.timeout_s)
    return {**seen, "refused": all(r == "RESOURCE_EXHAUSTED" for r in seen["answers"])}


def huge_claims(h: Honest, s: Settings) -> dict[str, Any]:
    """An insider (real credentials of a group outside the ring) opens ``claims`` connections to a
    member, each announcing a 255 MiB payload: for a tag not running there, and for the running
    collective (posing as the member's left neighbour's address)."""
    victim = h.ts[0]
    left, _ = h.left_of(h.groups[0])
    closed_by_victim = sent = 0
    end = time.monotonic() + s.duration_s
    while time.monotonic() < end:
        conns = []
        for i in range(s.claims):
            running = [tag for tag in list(victim._ops) if tag.startswith("honest/")]
            tag = (running[0] if running and i % 2 else f"never/{i}").encode()
            c = insider_connection(victim.address, left)
            c.sendall(pack_header(MsgType.RS, tag, 0, 0, s.n, 255 << 20))
            sent += 1
            conns.append(c)
        time.sleep(0.5)
        for c in conns:
            closed_by_victim += closed(c)
            c.close()
    return {"claims_sent": sent, "closed_by_member": closed_by_victim, "claimed_bytes_each": 255 << 20}


def zstd_bomb_frame(count: int) -> bytes:
    """A small fp32+zstd frame of ``count`` zero values (compressed in a stream: never held raw)."""
    raw_len = 4 * count
    cobj = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(size=raw_len)
    zero = bytes(1 << 20)
    packed = b"".join(cobj.compress(zero) for _ in range(raw_len // len(zero))) + cobj.flush()
    codec = compress.get_codec("fp32")
    head = cframe.pack_header(cframe.Header(codec.codec_id, cframe.FLAG_ZSTD, *codec.header_params, count, raw_len,
                                            len(packed)))
    return head + packed + cframe.trailer(head, packed)


def side_collective(h: Honest, s: Settings, codec: Any, attacker_group: int, send: Callable[[socket.socket, int], None],
                    expect: str, n: int = 4096) -> tuple[bool, str]:
    """Member 0 runs a 2-member collective whose left neighbour is a compromised member of
    ``attacker_group`` (it holds that group's credentials); ``send(conn, n)`` is what it sends.
    True if the member refused it (aborted with ``expect`` in the error, returned nothing)."""
    victim = h.ts[0]
    # the compromised member: a real listener holding its group's keys (it takes the victim's
    # chunks), and a raw connection from its address that sends what the attack says
    evil = TcpTransport("127.0.0.1", 0, secret=GroupKeys.derive(JOB_SECRET, attacker_group), timeout_s=s.timeout_s)
    handle = victim.all_reduce(torch.ones(n), [victim.address, evil.address], 0, tag="side", codec=codec,
                               groups=[h.groups[0], attacker_group], finite=True)
    c = insider_connection(victim.address, evil.address, group=attacker_group)
    try:
        send(c, n // 2)  # the chunk the victim expects from its left: segment 0, n/2 values
        try:
            handle.wait(s.timeout_s)
            return False, "applied"
        except TransportError as e:
            why = str(e).split(": ", 1)[-1]
            return expect in why, why[:300]
    finally:
        c.close()
        evil.close(1.0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def zstd_bomb(h: Honest, s: Settings) -> dict[str, Any]:
    """A 32 KB zstd fp32 frame declaring 2^28 values (2.2 GB decompressed in the issue), sent by
    a compromised neighbour into a zstd collective, and by an insider for a tag never started."""
    bomb = zstd_bomb_frame(1 << 28)

    def send(c: socket.socket, n: int) -> None:
        c.sendall(pack_header(MsgType.RS, b"side", 0, 0, 2 * n, len(bomb)) + bomb)

    start = time.monotonic()
    refused, why = side_collective(h, s, compress.get_codec("fp32", zstd=True), 7, send, "announces")
    took = time.monotonic() - start
    c = insider_connection(h.ts[1].address, h.left_of(h.groups[1])[0])
    c.sendall(pack_header(MsgType.RS, b"never/bomb", 0, 0, s.n, len(bomb)) + bomb)
    time.sleep(0.5)
    c.close()
    return {"bomb_bytes": len(bomb), "declared_values": 1 << 28, "refused": refused, "refused_in_s": round(took, 3),
            "error": why}


def pending_flood(h: Honest, s: Settings) -> dict[str, Any]:
    """An insider sends ``pending_frames`` chunk-sized frames for tags that never start."""
    victim = h.ts[0]
    frame = compress.get_codec("fp32").encode(torch.ones(s.chunk_bytes // 4))
    c = insider_connection(victim.address, h.left_of(h.groups[0])[0])
    peak = 0
    for i in range(s.pending_frames):
        c.sendall(pack_header(MsgType.RS, f"never/{i}".encode(), 0, 0, s.chunk_bytes // 4, len(frame)) + frame)
        if i % 50 == 0:
            peak = max(peak, victim.pending_bytes)
    time.sleep(0.3)
    peak = max(peak, victim.pending_bytes)
    c.close()
    ttl = victim.pending_ttl_s
    deadline = time.monotonic() + ttl + 3
    while victim.pending_bytes and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"frames_sent": s.pending_frames, "bytes_sent": s.pending_frames * len(frame),
            "pending_peak_bytes": peak, "max_pending_bytes": s.max_pending_bytes,
            "pending_after_ttl_bytes": victim.pending_bytes, "pending_ttl_s": ttl}


def abort_forgery(h: Honest, s: Settings) -> dict[str, Any]:
    """An insider connects to every member posing as its left neighbour's address and sends
    ABORTs and garbage chunks for the collectives running there; it also tries to prove the
    left neighbour's group without its key."""
    conns = {}
    for i, t in enumerate(h.ts):
        conns[i] = insider_connection(t.address, h.left_of(h.groups[i])[0])
    impersonation_refused = 0
    for i, t in enumerate(h.ts):
        addr, group = h.left_of(h.groups[i])
        host, port = t.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            fake = GroupKeys(group, {g: GroupKeys.derive(JOB_SECRET, INSIDER).key_for(g) for g in h.groups})
            try:  # claims the left neighbour's group, keyed with the insider's own keys
                dial_handshake(raw, fake, addr, t.address)
            except (PeerAuthError, OSError):
                impersonation_refused += 1
    sent = 0
    end = time.monotonic() + s.duration_s
    while time.monotonic() < end:
        for i, t in enumerate(h.ts):
            for tag in [tag for tag in list(t._ops) if tag.startswith("honest/")]:
                raw_tag = tag.encode()
                reason = b"forged abort"
                try:
                    conns[i].sendall(pack_header(MsgType.ABORT, raw_tag, 0, 0, 0, len(reason)) + reason)
                    conns[i].sendall(pack_header(MsgType.RS, raw_tag, 0, 0, s.n, 64) + os.urandom(64))
                    sent += 2
                except OSError:
                    conns[i] = insider_connection(t.address, h.left_of(h.groups[i])[0])
        time.sleep(0.01)
    for c in conns.values():
        c.close()
    return {"forged_messages": sent, "impersonation_refused": impersonation_refused,
            "impersonation_tries": len(h.ts)}


def bad_values(h: Honest, s: Settings) -> dict[str, Any]:
    """A compromised neighbour sends values no encoder writes: an int8 frame with scale 0 over
    non-zero codes, and an fp32 frame holding NaN into a finite collective."""
    int8 = compress.get_codec("int8")

    def zero_scale(c: socket.socket, n: int) -> None:
        f = bytearray(int8.encode(torch.randn(n)))
        struct.pack_into("<f", f, cframe.HEADER_SIZE, 0.0)  # the first block's scale
        cframe.seal(memoryview(f))
        c.sendall(pack_header(MsgType.RS, b"side", 0, 0, 2 * n, len(f)) + f)

    def nan_frame(c: socket.socket, n: int) -> None:
        x = torch.randn(n)
        x[7] = float("nan")
        f = compress.get_codec("fp32").encode(x)
        c.sendall(pack_header(MsgType.RS, b"side", 0, 0, 2 * n, len(f)) + f)

    scale_refused, scale_why = side_collective(h, s, int8, 7, zero_scale, "scale of 0")
    nan_refused, nan_why = side_collective(h, s, compress.get_codec("fp32"), 7, nan_frame, "NaN or Inf")
    return {"refused": scale_refused and nan_refused, "int8_zero_scale": scale_why, "fp32_nan": nan_why}


# --- the attacks on the coordinator ------------------------------------------------------------

class Job:
    """A coordinator with a token, honest groups 0 and 1 (their own credentials only) running
    quorum -> all-reduce -> commit exchanges, and group 2 held by the attacker: it joined so the
    job could start, then fell silent and was declared failed."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self.server = CoordinatorServer("127.0.0.1", 0, expected_groups=3, token=JOB_TOKEN, heartbeat_timeout_s=2.0,
                                        join_timeout_s=s.duration_s + 5, max_group_size=4,
                                        max_blocking_per_caller=16, max_blocking_calls=64, max_quick_calls=32,
                                        max_quick_per_caller=8, request_timeout_s=min(2.0, s.duration_s / 3))
        self.server.start()
        self.h = Honest(s, groups=(0, 1))
        self.clients = {g: CoordinatorClient(self.server.address, token=group_token(JOB_TOKEN, g), timeout_s=10)
                        for g in (0, 1, 2)}
        members: dict[int, Any] = {}

        def join(g: int, address: str) -> None:
            members[g] = self.clients[g].join(g, 0, 1, address, incarnation=f"inc{g}")

        threads = [threading.Thread(target=join, args=(g, a)) for g, a in
                   ((0, self.h.ts[0].address), (1, self.h.ts[1].address), (2, f"127.0.0.1:{_free_port()}"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        self.exchange = 0
        self.latency = {"ping": [], "heartbeat": []}
        self.failures: list[str] = []
        # group 2 falls silent: wait until the coordinator has declared it failed
        deadline = time.monotonic() + 10
        while 2 not in self.server.snapshot()["rounds_state"]["failed_groups"] and time.monotonic() < deadline:
            self._heartbeats()
            time.sleep(0.3)

    def _heartbeats(self) -> None:
        for g in (0, 1):
            start = time.monotonic()
            self.clients[g].heartbeat(g, 0, self.exchange, f"inc{g}")
            self.latency["heartbeat"].append(time.monotonic() - start)

    def run_exchange(self) -> bool:
        """One exchange among the honest groups: quorum, all-reduce, commit; True if it committed
        with the exact mean."""
        k, self.exchange = self.exchange, self.exchange + 1
        results: dict[int, Any] = {}

        def member(i: int, g: int) -> None:
            c, t, x = self.clients[g], self.h.ts[i], self.h.xs[i]
            try:
                resp = c.quorum(QuorumRequest(g, 0, f"inc{g}", k, tag=f"x{k}", numel=x.numel(), weight=1.0,
                                              delta_norm=float(x.norm()), healable=False), timeout_s=self.s.timeout_s)
                groups = sorted(resp.members)
                ring = [resp.members[h][0] for h in groups]
                out = t.all_reduce(x, ring, groups.index(g), tag=f"{resp.tag}/{resp.id}", groups=groups,
                                   finite=True).wait(self.s.timeout_s)
                decision = c.commit(CommitRequest(g, 0, f"inc{g}", resp.id, resp.exchange, tuple(groups), True, ""),
                                    timeout_s=self.s.timeout_s)
                results[g] = (decision.committed and groups == [0, 1], out)
            except Exception as e:  # noqa: BLE001 - recorded
                results[g] = (False, None)
                self.failures.append(f"exchange {k} group {g}: {type(e).__name__}: {e}"[:300])

        threads = [threading.Thread(target=member, args=(i, g)) for i, g in enumerate((0, 1))]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.s.timeout_s * 4)
        want = (self.h.xs[0] + self.h.xs[1]) / 2
        ok = all(results.get(g, (False, None))[0] and torch.equal(results[g][1], want) for g in (0, 1))
        took = time.monotonic() - start
        self.h.rounds.append((ok and took <= 3 * self.s.timeout_s, took, ""))
        return ok

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Honest exchanges, heartbeats and pings (every 50 ms, timed) while the block runs."""
        stop = threading.Event()

        def exchanges() -> None:
            while not stop.is_set():
                self.run_exchange()
                stop.wait(self.s.period_s)

        def pings() -> None:
            probe = CoordinatorClient(self.server.address, token=group_token(JOB_TOKEN, 0), timeout_s=10)
            n = 0
            while not stop.wait(0.05):
                start = time.monotonic()
                try:
                    probe._call("Ping", Ping(), Ack, timeout_s=5)
                except CoordinatorError as e:
                    self.failures.append(f"ping: {e}"[:200])
                self.latency["ping"].append(time.monotonic() - start)
                n += 1
                if n % 5 == 0:
                    try:
                        self._heartbeats()
                    except CoordinatorError as e:
                        self.failures.append(f"heartbeat: {e}"[:200])
            probe.close()

        threads = [threading.Thread(target=f, daemon=True) for f in (exchanges, pings)]
        for t in threads:
            t.start()
        try:
            yield
        finally:
            stop.set()
            for t in threads:
                t.join(self.s.timeout_s * 4)

    def coordinator_ok(self) -> bool:
        return (not self.failures and max(self.latency["ping"], default=0) < 1.0
                and max(self.latency["heartbeat"], default=0) < 1.0)

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.server.stop()
        self.h.close()


def coordinator_impersonation(job: Job, s: Settings) -> dict[str, Any]:
    """Without a credential, and with group 2's: join as group 0 (the squatter of the issue),
    heartbeat as group 1, forge round hashes and summaries for groups 0 and 1, ask to stop."""
    anon = grpc.insecure_channel(job.server.address)
    refused: dict[str, str] = {}
    try:
        anon.unary_unary(f"/{SERVICE}/Join")(JoinRequest(0, 0, 1, "127.0.0.1:9").encode(), timeout=5)
        refused["anonymous join"] = "ACCEPTED"
    except grpc.RpcError as e:
        refused["anonymous join"] = e.code().name
    anon.close()
    evil = job.clients[2]
    tries: dict[str, Callable[[], Any]] = {
        "join as group 0": lambda: evil._call("Join", JoinRequest(0, 0, 1, "127.0.0.1:9"), JoinResponse, 5),
        "heartbeat as group 1": lambda: evil._call("Heartbeat", HeartbeatRequest(1, 0, 1), HeartbeatResponse, 5),
        "round hash for group 0": lambda: evil._call("ReportRound", RoundRequest(0, 1, "forged"), Ack, 5),
        "summary for group 1": lambda: evil._call("ReportSummary", SummaryRequest(1, {"forged": True}), Ack, 5),
        "request stop": lambda: evil._call("RequestStop", StopRequest("forged"), Ack, 5),
    }
    end = time.monotonic() + s.duration_s
    while time.monotonic() < end:
        for what, call in tries.items():
            try:
                call()
                refused[what] = "ACCEPTED"
            except CoordinatorError as e:
                refused[what] = e.code or "?"
        time.sleep(0.2)
    snap = job.server.snapshot()
    forged = bool(snap["summaries"]) or any(h == "forged" for r in snap["divergence"] for h in r["hashes"].values())
    return {"answers": refused, "refused": all(v != "ACCEPTED" for v in refused.values()) and not forged,
            "stop_requested": snap["rounds_state"]["stop"]}


def coordinator_flood(job: Job, s: Settings) -> dict[str, Any]:
    """From another process: ``flood`` callers holding group 2's credential making blocking joins
    (healer joins that wait for the rest of a 4-rank group), as many without any credential, and
    ``slow_calls`` calls that never send their request, all kept up for the attack's duration."""
    evil = [["authorization", f"Bearer {group_token(JOB_TOKEN, 2)}"]]
    requests = [JoinRequest(2, i % 3, 4, f"127.0.0.9:{1000 + i % 3}", incarnation="evil").encode().hex()
                for i in range(s.flood)]
    seen = attacker("coord-flood", target=job.server.address, method=f"/{SERVICE}/Join",
                    requests_hex=requests * 2, callers=[evil] * s.flood + [[]] * s.flood, duration_s=s.duration_s,
                    slow_method=f"/{SERVICE}/Heartbeat", slow_calls=s.slow_calls, slow_metadata=evil)
    return {**seen, "call_stats": job.server.call_stats}


DATA_ATTACKS: dict[str, tuple[str, Callable[[Honest, Settings], dict[str, Any]]]] = {
    "none": ("tcp", no_attack),
    "slowloris-tcp": ("tcp", slowloris_tcp),
    "slowloris-grpc": ("grpc", slowloris_grpc),
    "idle-flood-tcp": ("tcp", idle_flood_tcp),
    "idle-streams-grpc": ("grpc", idle_streams_grpc),
    "big-message-grpc": ("grpc", big_message_grpc),
    "huge-claims": ("tcp", huge_claims),
    "zstd-bomb": ("tcp", zstd_bomb),
    "pending-flood": ("tcp", pending_flood),
    "abort-forgery": ("tcp", abort_forgery),
    "bad-values": ("tcp", bad_values),
}
COORDINATOR_ATTACKS: dict[str, Callable[[Job, Settings], dict[str, Any]]] = {
    "coordinator-impersonation": coordinator_impersonation,
    "coordinator-flood": coordinator_flood,
}
ATTACKS = [*DATA_ATTACKS, *COORDINATOR_ATTACKS]


def run_attack(name: str, s: Settings) -> dict[str, Any]:
    """Run one attack against fresh honest members; its record."""
    start = time.monotonic()
    start_cuda_host_side()
    if name in DATA_ATTACKS:
        link, attack = DATA_ATTACKS[name]
        h = Honest(s, link)
        try:
            warm = h.round()  # links open, buffers in the pool: the baseline
            with RssPeak() as rss, h.running():
                details = attack(h, s)
            after = h.round()
            during = h.rounds[1:-1]
            ok = warm[0] and after[0] and bool(during) and all(r[0] for r in during)
            extra = {**h.counters(), **h.listener_view()}
            unauth = h.unauth_peak()
        finally:
            h.close()
    else:
        job = Job(s)
        try:
            if not job.run_exchange():
                raise RuntimeError(f"the honest job does not run before the attack: {job.failures}")
            with RssPeak() as rss, job.running():
                details = COORDINATOR_ATTACKS[name](job, s)
            after = job.run_exchange()
            during = job.h.rounds[1:-1]
            ok = after and bool(during) and all(r[0] for r in during) and job.coordinator_ok()
            extra = {"ping_max_s": round(max(job.latency["ping"], default=0), 3),
                     "heartbeat_max_s": round(max(job.latency["heartbeat"], default=0), 3),
                     "failures": job.failures[:5], **job.h.listener_view()}
            unauth = job.h.unauth_peak()
        finally:
            job.close()
    rounds = [r for r in (during or [])]
    return {"attack": name, "honest_ok": bool(ok), "rss_growth_mb": rss.growth_mb, "unauth_slots_max": unauth,
            "honest_rounds": len(rounds) + 1, "honest_max_s": round(max((r[1] for r in rounds), default=0.0), 3),
            "deadline_s": s.timeout_s, "max_unauthenticated": s.max_unauthenticated, **extra, **details,
            "seconds": round(time.monotonic() - start, 1)}


def markdown_table(records: list[dict[str, Any]]) -> str:
    """The README table of a run's records."""
    rows = ["| attack | honest_ok | honest rounds | slowest honest (s) | RSS growth (MiB) | unauth. slots max | notes |",
            "|---|---|---|---|---|---|---|"]
    for r in records:
        notes = []
        for key in ("unauth_life_max_s", "client_life_max_s", "reserved_slots_max", "rejected_connections", "handshake_timeouts", "ignored_messages",
                    "dropped_pending", "refused", "newcomer_ok", "ping_max_s", "heartbeat_max_s"):
            if key in r and r[key] not in (0, None, {}):
                notes.append(f"{key}={r[key]}")
        rows.append(f"| {r['attack']} | {'yes' if r['honest_ok'] else 'NO'} | {r['honest_rounds']} | {r['honest_max_s']} "
                    f"| {r['rss_growth_mb']} | {r['unauth_slots_max']} | {', '.join(notes)} |")
    return "\n".join(rows)


def steady_malloc() -> str:
    """Fix glibc's mmap threshold at 256 KiB (no sliding up) and its arenas at 4, so that freed
    big buffers go back to the OS and RSS follows live memory rather than what the allocator
    keeps from earlier rounds; returns what is in force."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(-3, 256 << 10) and libc.mallopt(-8, 4)  # M_MMAP_THRESHOLD, M_ARENA_MAX
        return "M_MMAP_THRESHOLD=256KiB, M_ARENA_MAX=4" if ok else "default"
    except OSError:
        return "default"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the records here")
    p.add_argument("--quick", action="store_true", help="smaller attacks, shorter runs")
    p.add_argument("--only", nargs="+", choices=ATTACKS, help="run only these attacks")
    p.add_argument("--default-malloc", action="store_true", help="leave glibc's malloc as it is (see steady_malloc)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    malloc = "default" if a.default_malloc else steady_malloc()
    s = replace(Settings(), **QUICK) if a.quick else Settings()
    records = []
    for name in a.only or ATTACKS:
        rec = run_attack(name, s)
        print(json.dumps(rec), flush=True)
        records.append(rec)
    print(markdown_table(records))
    if a.json:
        out = {"settings": asdict(s), "torch": torch.__version__, "cpus": os.cpu_count(), "malloc": malloc,
               "command": "python bench/adversarial.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "records": records}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(r["honest_ok"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
