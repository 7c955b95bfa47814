"""Faults between ring members, injected by a FaultProxy: the data plane never delivers a wrong value.

The link from ring member 0 (the "head") to member 1 runs through a `FaultProxy`: the head dials
it through `dial_overrides={member1.address: proxy.address}`, while the ring still names every
member by its own address (the handshake authenticates the address a dialer announces, never the
address it reached). Only the head's stream toward member 1 ("up") crosses the proxy.

A collective whose stream was corrupted, stalled or cut must, on every member, either return
exactly what a clean run returns (bit for bit, from a reference run without a proxy) or raise a
`TransportError` that names the cause.

The transport does not notice that a dialed connection was closed by the far end until a send on
it fails, so a head whose connection a fault killed may lose its next collective as well; after
such faults the tests give the ring a new head (members 1.. stay the same transports). Faults that
leave the connection up (a corrupted frame, a stall) are followed by a collective on the very
same transports.

A member whose collective has not started yet when the connection from its left peer breaks is
not told (the loss reaches only running collectives, and the left peer's abort cannot reach it
over the dead link), so it waits out its whole deadline. The tests therefore start the head
last: every member behind the proxy is in the collective before the first faulty byte.
"""

from __future__ import annotations

import functools
import os
import random
import re
import socket
import threading
import time
from typing import Iterator

import pytest
import torch

import compress
from transport import CollectiveAborted, FaultProxy, TcpTransport, TransportError
from transport.certs import write_pki
from transport_helpers import SECRET, closed_port_address

CHUNK_BYTES = 4096  # 1024 values per chunk: the head's first message is > 1000 bytes for every codec here
N = 6000
#: What an aborted member's message must name (the failing check, or the abort it was told of).
CAUSE = re.compile(
    r"checksum|bad frame|FrameError|WireError|length mismatch|protocol error|unexpected|timed out|"
    r"aborted by peer|lost the connection|authentication|TLS|SSL|cannot reach|sending to .* failed"
)


# -- leak check ------------------------------------------------------------------------------------
def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settled(count, baseline: int, timeout_s: float = 5.0) -> int:
    """count() once it is <= baseline, or its value after timeout_s (threads and sockets of closed
    transports end asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while count() > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    return count()


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Every test leaves no thread and no file descriptor behind."""
    threads, fds = threading.active_count(), _fds()
    yield
    assert _settled(threading.active_count, threads) <= threads, [t.name for t in threading.enumerate()]
    assert _settled(_fds, fds) <= fds


# -- helpers ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    return write_pki(tmp_path_factory.mktemp("pki"), ["a", "b", "c"])


def _close_all(things: list) -> None:
    """Close transports and proxies at once (a transport's close waits up to 0.2 s for its accept loop)."""
    closers = [threading.Thread(target=t.close) for t in things]
    for c in closers:
        c.start()
    for c in closers:
        c.join()


def _inputs(g: int, n: int = N) -> list[torch.Tensor]:
    return [torch.randn(n, generator=torch.Generator().manual_seed(1000 + i)) for i in range(g)]


def _transport(tls=None, **kw) -> TcpTransport:
    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("chunk_bytes", CHUNK_BYTES)
    return TcpTransport("127.0.0.1", 0, secret=SECRET, tls=tls, **kw)


def _collective(ts: list[TcpTransport], xs: list[torch.Tensor], tag: str, codec=None) -> list:
    """Run one all-reduce on every member; each member's result tensor, or its TransportError.

    The head starts last, so every other member's collective is running before a byte crosses
    the proxy (see the module docstring for a member that starts after its left link died)."""
    ring = [t.address for t in ts]
    handles = [ts[i].all_reduce(xs[i], ring, i, tag=tag, codec=codec) for i in reversed(range(len(ts)))][::-1]
    outs: list = []
    for h in handles:
        try:
            outs.append(h.wait(timeout_s=30))  # a safety net: each collective's own deadline is far shorter
        except TransportError as e:
            outs.append(e)
    return outs


@functools.lru_cache(maxsize=None)
def _reference(g: int, codec_name: str, n: int = N, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """The clean result for the members' inputs, from a ring without a proxy."""
    ts = [_transport(chunk_bytes=chunk_bytes) for _ in range(g)]
    try:
        outs = _collective(ts, _inputs(g, n), "reference", compress.get_codec(codec_name))
    finally:
        _close_all(ts)
    assert all(torch.equal(o, outs[0]) for o in outs), outs
    return outs[0]


def _same_bits(a: object, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _assert_exact(outs: list, ref: torch.Tensor) -> None:
    """Every member returned exactly ref."""
    assert all(_same_bits(o, ref) for o in outs), outs


def _check(outs: list, ref: torch.Tensor, tag: str) -> int:
    """Assert every member returned ref exactly or raised naming tag and a cause; returns how many raised."""
    aborted = 0
    for i, o in enumerate(outs):
        if isinstance(o, torch.Tensor):
            assert _same_bits(o, ref), f"member {i} of {tag!r} returned a wrong value"
        else:
            assert isinstance(o, CollectiveAborted), f"member {i}: {o!r}"
            assert tag in str(o) and CAUSE.search(str(o)), f"member {i}: {o}"
            aborted += 1
    return aborted


def _head(tail: list[TcpTransport], tls=None, **kw) -> tuple[TcpTransport, FaultProxy]:
    """A new member 0 whose link to member 1 (tail[0]) runs through a new FaultProxy."""
    proxy = FaultProxy(tail[0].address)
    try:
        head = _transport(tls, dial_overrides={tail[0].address: proxy.address}, **kw)
    except BaseException:
        proxy.close()
        raise
    return head, proxy


def _tail(g: int, tls_names: str | None, pki: dict | None, **kw) -> list[TcpTransport]:
    """Members 1..g-1."""
    return [_transport(pki[tls_names[i]] if tls_names else None, **kw) for i in range(1, g)]


# -- the proxy on its own --------------------------------------------------------------------------
class _Relay:
    """A client connected through a proxy to a server socket the test holds: (client, proxy, server)."""

    def __enter__(self) -> tuple[socket.socket, FaultProxy, socket.socket]:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(5)
        self.proxy = FaultProxy(f"127.0.0.1:{self.srv.getsockname()[1]}")
        host, port = self.proxy.address.rsplit(":", 1)
        self.client = socket.create_connection((host, int(port)), timeout=5)
        self.server, _ = self.srv.accept()
        self.server.settimeout(5)
        return self.client, self.proxy, self.server

    def __exit__(self, *exc: object) -> None:
        for s in (self.client, self.server, self.srv):
            s.close()
        self.proxy.close()


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        d = s.recv(n - len(got))
        assert d, f"EOF after {len(got)} of {n} bytes"
        got += d
    return bytes(got)


def test_proxy_relays_both_ways_and_counts() -> None:
    with _Relay() as (client, proxy, server):
        up, down = os.urandom(3 << 20), os.urandom(1 << 20)
        sender = threading.Thread(target=client.sendall, args=(up,))
        sender.start()
        assert _recv_exactly(server, len(up)) == up
        sender.join()
        server.sendall(down)
        assert _recv_exactly(client, len(down)) == down
        client.shutdown(socket.SHUT_WR)  # a half-close is passed on ...
        assert server.recv(1) == b""
        server.sendall(b"still open")  # ... and the other direction keeps working
        assert _recv_exactly(client, 10) == b"still open"
        server.close()
        assert client.recv(1) == b""
        assert proxy.wait_idle(5) and proxy.open_connections == 0
        # Counters are final once the connection is over (a byte may arrive before it is counted).
        assert proxy.bytes_forwarded("up") == len(up)
        assert proxy.bytes_forwarded("both") == len(up) + len(down) + 10
        assert proxy.connections == 1 and proxy.bytes_corrupted == 0 and proxy.resets == 0


def test_proxy_flips_one_bit_in_exactly_the_chosen_bytes() -> None:
    with _Relay() as (client, proxy, server):
        client.sendall(bytes(100))
        _recv_exactly(server, 100)  # positions count from the call, not from the connection's start
        proxy.corrupt(at_offset=250)
        client.sendall(bytes(1000))
        got = _recv_exactly(server, 1000)
        assert [i for i, b in enumerate(got) if b] == [250] and bin(got[250]).count("1") == 1
        proxy.corrupt(every_nth=100, direction="down", xor_mask=0xFF)
        server.sendall(bytes(1000))
        got = _recv_exactly(client, 1000)
        assert [i for i, b in enumerate(got) if b] == list(range(99, 1000, 100))
        assert set(got) == {0, 0xFF}
        flips = []
        for _ in range(2):  # a seed repeats the same flips
            proxy.corrupt(probability=0.01, seed=7)
            client.sendall(bytes(20000))
            flips.append([i for i, b in enumerate(_recv_exactly(server, 20000)) if b])
        assert flips[0] == flips[1] and 100 < len(flips[0]) < 300
        assert proxy.bytes_corrupted == 1 + 10 + 2 * len(flips[0])
        proxy.clear()
        client.sendall(bytes(5000))
        assert _recv_exactly(server, 5000) == bytes(5000)
        with pytest.raises(ValueError):
            proxy.corrupt(at_offset=1, every_nth=2)


def test_proxy_drop_after_forwards_exactly_n_bytes_then_resets_both_ends() -> None:
    with _Relay() as (client, proxy, server):
        data = os.urandom(1000)
        proxy.drop_after(300, direction="up")
        client.sendall(data)
        got = bytearray()
        with pytest.raises(ConnectionResetError):
            while d := server.recv(4096):
                got += d
        assert bytes(got) == data[:300]
        with pytest.raises(ConnectionResetError):
            client.recv(1)
        assert proxy.resets == 1 and proxy.wait_idle(5)
        assert proxy.bytes_forwarded("up") == 300


def test_proxy_stall_holds_bytes_until_it_ends_or_is_cleared() -> None:
    with _Relay() as (client, proxy, server):
        proxy.stall(0.4, direction="up")
        start = time.monotonic()
        client.sendall(b"late")
        server.sendall(b"free")  # the other direction is not stalled
        assert _recv_exactly(client, 4) == b"free"
        assert _recv_exactly(server, 4) == b"late"
        assert time.monotonic() - start >= 0.4
        proxy.stall(60)
        client.sendall(b"held")
        proxy.clear()
        assert _recv_exactly(server, 4) == b"held"  # long before the 60 s; the recv timeout is 5 s


def test_proxy_to_dead_target_resets_the_client_and_close_is_idempotent() -> None:
    proxy = FaultProxy(closed_port_address())
    try:
        host, port = proxy.address.rsplit(":", 1)
        try:  # the reset may come before connect() returns
            with socket.create_connection((host, int(port)), timeout=5) as c:
                c.recv(1)
        except ConnectionResetError:
            pass
        else:
            pytest.fail("the client was not reset")
        assert proxy.wait_idle(5) and proxy.connections == 1 and proxy.resets == 1
    finally:
        proxy.close()
        proxy.close()


# -- corruption never yields a wrong value ---------------------------------------------------------
CASES = [  # (ring size, codec, TLS)
    (2, "fp32", False),
    (2, "int8", False),
    (3, "fp32", False),
    (3, "int8", False),
    (2, "fp32", True),
    (3, "int8", True),
]


def _specs(tls: bool) -> list[dict]:
    """Corruptions of the head's stream, counted from the start of the faulty collective's bytes."""
    rng = random.Random(1234)
    offsets = [rng.randrange(1000) for _ in range(3)]  # inside the head's first message
    if tls:
        return [{"at_offset": o} for o in [2] + offsets]  # 2: a TLS record header
    # 5: message type; 20: vector length; 80: inside the codec frame's header
    return [{"at_offset": o} for o in [5, 20, 80] + offsets] + [{"probability": 2e-4, "seed": 3}]


@pytest.mark.parametrize("g,codec_name,tls", CASES, ids=[f"g{g}-{c}-{'tls' if t else 'hmac'}" for g, c, t in CASES])
def test_corrupted_stream_never_yields_a_wrong_value(g: int, codec_name: str, tls: bool, pki: dict) -> None:
    codec = compress.get_codec(codec_name)
    ref = _reference(g, codec_name)
    xs = _inputs(g)
    tail = _tail(g, "abc" if tls else None, pki)
    spent: list = []
    aborted_runs = corrupted = 0
    try:
        for k, spec in enumerate(_specs(tls)):
            head, proxy = _head(tail, pki["a"] if tls else None)
            spent += [head, proxy]
            ts = [head] + tail
            # A clean collective through the proxy first: the link is up, and the proxy is transparent.
            _assert_exact(_collective(ts, xs, f"clean-{k}", codec), ref)
            proxy.corrupt(direction="up", **spec)
            tag = f"corrupt-{k}"
            outs = _collective(ts, xs, tag, codec)
            aborted = _check(outs, ref, tag)
            if "at_offset" in spec:
                assert proxy.bytes_corrupted == 1, (spec, proxy.bytes_corrupted)
            if proxy.bytes_corrupted:
                assert aborted, f"{spec}: corrupted bytes went unnoticed: {outs}"
            aborted_runs += aborted > 0
            corrupted += proxy.bytes_corrupted
            proxy.close()
        # The members that stayed (1..g-1) still work, with a new head, through a clean proxy.
        head, proxy = _head(tail, pki["a"] if tls else None)
        spent += [head, proxy]
        _assert_exact(_collective([head] + tail, xs, "after", codec), ref)
    finally:
        _close_all(spent + tail)
    assert aborted_runs > 0 and corrupted > 0


@pytest.mark.parametrize("g", [2, 3])
def test_corrupted_frame_aborts_and_the_same_transports_recover(g: int) -> None:
    ref = _reference(g, "fp32")
    xs = _inputs(g)
    tail = _tail(g, None, None)
    head, proxy = _head(tail)
    ts = [head] + tail
    try:
        _assert_exact(_collective(ts, xs, "clean"), ref)
        # A byte inside the first frame's values: its checksum catches it, the stream stays in step.
        proxy.corrupt(at_offset=32 + len("bad") + 44 + 100)
        outs = _collective(ts, xs, "bad")
        assert _check(outs, ref, "bad") == g and proxy.bytes_corrupted == 1
        assert any("checksum" in str(o) for o in outs)
        proxy.clear()
        for r in range(3):
            _assert_exact(_collective(ts, xs, f"again-{r}"), ref)
        assert proxy.connections == 1  # the very same link carried on: nothing was redialed
    finally:
        _close_all(ts + [proxy])


# -- stalls ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("g", [2, 3])
def test_stall_longer_than_the_timeout_aborts_everyone_in_bounded_time(g: int) -> None:
    timeout = 1.0
    ref = _reference(g, "fp32")
    xs = _inputs(g)
    tail = _tail(g, None, None, timeout_s=timeout)
    head, proxy = _head(tail, timeout_s=timeout)
    ts = [head] + tail
    try:
        _assert_exact(_collective(ts, xs, "clean"), ref)
        proxy.stall(60)
        start = time.monotonic()
        outs = _collective(ts, xs, "stalled")
        elapsed = time.monotonic() - start
        assert _check(outs, ref, "stalled") == g
        assert any("timed out" in str(o) for o in outs)
        assert timeout * 0.9 <= elapsed < timeout + 2.0
        proxy.clear()  # the held bytes now reach member 1, which drops them (their collective is over)
        _assert_exact(_collective(ts, xs, "after"), ref)
        assert proxy.connections == 1
    finally:
        _close_all(ts + [proxy])


@pytest.mark.parametrize("g", [2, 3])
def test_stall_shorter_than_the_timeout_completes_exactly(g: int) -> None:
    ref = _reference(g, "fp32")
    xs = _inputs(g)
    tail = _tail(g, None, None, timeout_s=5.0)
    head, proxy = _head(tail, timeout_s=5.0)
    ts = [head] + tail
    try:
        _assert_exact(_collective(ts, xs, "clean"), ref)
        proxy.stall(0.5)
        start = time.monotonic()
        outs = _collective(ts, xs, "slow")
        assert time.monotonic() - start >= 0.5  # member 1 cannot finish before the head's bytes arrive
        _assert_exact(outs, ref)
    finally:
        _close_all(ts + [proxy])


# -- drops -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("g", [2, 3])
def test_drop_mid_stream_aborts_everyone_well_before_the_timeout(g: int) -> None:
    timeout, n = 10.0, 100_000  # the head sends member 1 hundreds of KB; the drop comes after 50 KB
    ref = _reference(g, "fp32", n, 64 << 10)
    xs = _inputs(g, n)
    tail = _tail(g, None, None, timeout_s=timeout, chunk_bytes=64 << 10)
    head, proxy = _head(tail, timeout_s=timeout, chunk_bytes=64 << 10)
    spent = [head, proxy]
    try:
        _assert_exact(_collective([head] + tail, xs, "clean"), ref)
        up = proxy.bytes_forwarded("up")
        proxy.drop_after(50_000, direction="up")
        start = time.monotonic()
        outs = _collective([head] + tail, xs, "dropped")
        assert time.monotonic() - start < 2.5
        assert _check(outs, ref, "dropped") == g
        assert any("lost the connection" in str(o) and "reset" in str(o) for o in outs), outs
        assert proxy.resets == 1 and proxy.bytes_forwarded("up") - up == 50_000
        # A new head, through the same (cleared) proxy, and the members that stayed work again.
        proxy.clear()
        head2 = _transport(timeout_s=timeout, chunk_bytes=64 << 10, dial_overrides={tail[0].address: proxy.address})
        spent.append(head2)
        _assert_exact(_collective([head2] + tail, xs, "after"), ref)
        assert proxy.connections == 2
    finally:
        _close_all(spent + tail)
