"""Group identity on the data plane: pair keys, the handshake that proves groups, and rings that
take data and aborts only from their actual left neighbour (transport/identity.py, auth.py, ring.py)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

import compress
from transport import CollectiveAborted, PeerAuthError, TcpTransport
from transport import auth
from transport.auth import accept_handshake, dial_handshake
from transport.identity import GroupKeys, SharedSecret, pair_key
from transport.wire import MsgType, pack_header, read_message, send_message

JOB = b"identity-test-job-secret-0123456789"


def keys(g: int) -> GroupKeys:
    return GroupKeys.derive(JOB, g)


def _handshake(client, server, address: str = "10.0.0.1:5000", expect_group: int | None = None):
    """Run both sides over a socket pair: (client result or error, server result or error)."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    got: dict = {}

    def serve() -> None:
        try:
            got["server"] = accept_handshake(b, server)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            got["server"] = e
        finally:
            b.close()

    th = threading.Thread(target=serve)
    th.start()
    try:
        got["client"] = dial_handshake(a, client, address, "server", expect_group=expect_group)
    except Exception as e:  # noqa: BLE001
        got["client"] = e
    a.close()
    th.join(5)
    return got["client"], got["server"]


def _catch(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return e


def test_pair_keys_are_symmetric_and_distinct() -> None:
    assert pair_key(JOB, 1, 2) == pair_key(JOB, 2, 1) == keys(1).key_for(2) == keys(2).key_for(1)
    assert len({pair_key(JOB, a, b) for a in range(4) for b in range(a, 4)}) == 10
    assert pair_key(b"another-job-secret-0000", 1, 2) != pair_key(JOB, 1, 2)


def test_handshake_proves_both_groups() -> None:
    client, server = _handshake(keys(1), keys(2))
    assert client[1] == 2, "the client learns the group the server proved"
    assert server.address == "10.0.0.1:5000" and server.group == 1


def test_a_group_cannot_pose_as_another_towards_a_third() -> None:
    # Group 0's keyring alone (what a confined group 0 holds): it cannot make group 2 believe it is group 1.
    own = GroupKeys.derive(JOB, 0, peers=range(4))
    forged = GroupKeys(1, {h: own.key_for(h) for h in range(4)})  # claims 1, keys of 0
    client, server = _handshake(forged, keys(2))
    assert isinstance(client, PeerAuthError) and "group 2" in str(client), "it cannot even check the server"
    assert isinstance(server, Exception)
    # A client that skips that check and proves with the keys it has is rejected by the server.
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    got: list = []
    th = threading.Thread(target=lambda: got.append(_catch(lambda: accept_handshake(b, keys(2)))))
    th.start()
    nc, addr = b"n" * auth.NONCE_BYTES, b"10.0.0.9:1"
    send_message(a, MsgType.HELLO, payload=nc + addr, aux=1 + 1)  # claims group 1
    ch = read_message(a, 1024, frozenset({MsgType.CHALLENGE}))
    proof = auth._mac(own.key_for(2), b"cli", nc, bytes(ch.payload[:auth.NONCE_BYTES]), 2, ch.aux, addr)
    send_message(a, MsgType.PROOF, payload=proof)
    assert read_message(a, 1024, frozenset({MsgType.ACCEPT, MsgType.REJECT})).type == MsgType.REJECT
    th.join(5)
    a.close()
    b.close()
    assert isinstance(got[0], PeerAuthError) and "no credentials of group 1" in str(got[0])
    # With its real identity it gets in, as group 0.
    client, server = _handshake(own, keys(2))
    assert client[1] == 2 and server.group == 0


def test_a_keyring_without_the_peer_group_and_mixed_modes_are_refused() -> None:
    confined = GroupKeys.derive(JOB, 0, peers=[1])
    client, server = _handshake(confined, keys(3))
    assert isinstance(client, PeerAuthError) and "no key for peer group 3" in str(client)
    client, server = _handshake(SharedSecret(JOB), keys(1))
    assert isinstance(server, PeerAuthError) and "no group identity" in str(server)
    assert isinstance(client, PeerAuthError)
    client, server = _handshake(keys(1), SharedSecret(JOB))
    assert isinstance(server, PeerAuthError) and "no group credentials" in str(server)


def test_dialer_refuses_a_server_of_an_unexpected_group_before_proving_anything() -> None:
    client, server = _handshake(keys(1), keys(2), expect_group=3)
    assert isinstance(client, PeerAuthError) and "proved group 2, expected group 3" in str(client)
    assert isinstance(server, Exception), "the server never got a proof"


def test_keyring_text_round_trip_and_secrecy() -> None:
    ring = GroupKeys.derive(JOB, 4, peers=[0, 1, 2])
    text = ring.to_text()
    back = GroupKeys.from_text(text)
    assert back.group == 4 and back.peers == [0, 1, 2] and back.key_for(1) == pair_key(JOB, 1, 4)
    assert GroupKeys.is_text(text) and not GroupKeys.is_text("00ff")
    with pytest.raises(ValueError, match="explicit list of peers"):
        keys(4).to_text()  # a keyring that holds the job secret is never written out
    assert JOB.hex() not in repr(keys(4)) and pair_key(JOB, 1, 4).hex() not in repr(ring)
    with pytest.raises(ValueError, match="not a diloco-group-keys"):
        GroupKeys.from_text("diloco-group-keys/v1:x:")


@pytest.fixture
def ring3():
    ts = [TcpTransport("127.0.0.1", 0, secret=keys(g), timeout_s=5.0) for g in range(3)]
    yield ts
    for t in ts:
        t.close(flush_timeout_s=1.0)


def _run(ts, xs, tag, groups=(0, 1, 2), **kw):
    ring = [t.address for t in ts]
    hs = [t.all_reduce(x, ring, i, tag=tag, groups=list(groups), **kw) for i, (t, x) in enumerate(zip(ts, xs))]
    return [h.wait(10) for h in hs]


def _insider(target: TcpTransport, claimed: str, group: int) -> socket.socket:
    host, port = target.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    dial_handshake(s, keys(group), claimed, target.address)
    return s


def test_ring_with_groups_averages_exactly(ring3) -> None:
    xs = [torch.full((1000,), float(g + 1)) for g in range(3)]
    outs = _run(ring3, xs, "plain")
    assert all(o.tolist() == [2.0] * 1000 for o in outs)
    assert all(t.group == g for g, t in enumerate(ring3))


def test_aborts_and_data_from_a_non_neighbour_are_ignored(ring3) -> None:
    """An insider (real keys of group 5, outside this ring) claims member 1's left neighbour's
    address and sends an ABORT and a chunk for the running collective: member 1 drops both and
    the collective ends with the right mean."""
    victim, left = ring3[1], ring3[0]
    ring = [t.address for t in ring3]
    n = 4096
    x = torch.arange(n, dtype=torch.float32)
    # member 1 starts first and waits for its left neighbour, which has not started yet
    h1 = victim.all_reduce(x, ring, 1, tag="target", groups=[0, 1, 2])
    s = _insider(victim, left.address, group=5)
    try:
        reason = b"forged"
        frame = compress.get_codec("fp32").encode(torch.full((n // 3,), 1e6))
        s.sendall(pack_header(MsgType.ABORT, b"target", 0, 0, 0, len(reason)) + reason)
        s.sendall(pack_header(MsgType.RS, b"target", 0, 0, n, len(frame)) + frame)
        deadline = time.monotonic() + 5
        while victim.ignored_messages < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert victim.ignored_messages == 2
        assert not h1.done()
        h0 = left.all_reduce(x, ring, 0, tag="target", groups=[0, 1, 2])
        h2 = ring3[2].all_reduce(x, ring, 2, tag="target", groups=[0, 1, 2])
        assert all(torch.equal(h.wait(10), x) for h in (h0, h1, h2))
    finally:
        s.close()


def test_the_true_neighbour_can_still_abort(ring3) -> None:
    victim, left = ring3[1], ring3[0]
    ring = [t.address for t in ring3]
    h1 = victim.all_reduce(torch.ones(64), ring, 1, tag="t", groups=[0, 1, 2])
    s = _insider(victim, left.address, group=0)  # group 0's keys, at group 0's address
    try:
        s.sendall(pack_header(MsgType.ABORT, b"t", 0, 0, 0, 4) + b"stop")
        with pytest.raises(CollectiveAborted, match="aborted by peer stop"):
            h1.wait(5)
    finally:
        s.close()


def test_ring_refuses_a_right_neighbour_of_another_group(ring3) -> None:
    """The ring says member 1's right neighbour is group 7, but whoever listens there proves group
    2: nothing is sent to it, and the collective aborts at once."""
    victim = ring3[1]
    start = time.monotonic()
    h = victim.all_reduce(torch.ones(64), [t.address for t in ring3], 1, tag="wrong", groups=[0, 1, 7])
    with pytest.raises(CollectiveAborted, match="proved group 2, the ring says group 7"):
        h.wait(5)
    assert time.monotonic() - start < 2.0
    with pytest.raises(ValueError, match="not this transport's group"):
        victim.all_reduce(torch.ones(4), [t.address for t in ring3], 1, tag="x", groups=[0, 3, 2])


def test_finite_collectives_refuse_nan_frames_and_plain_ones_carry_them(ring3) -> None:
    a, b = ring3[0], ring3[1]
    ring = [a.address, b.address]
    x = torch.ones(8)
    y = torch.ones(8)
    y[3] = float("nan")
    ha = a.all_reduce(x, ring, 0, tag="nan", groups=[0, 1], finite=True)
    hb = b.all_reduce(y, ring, 1, tag="nan", groups=[0, 1], finite=True)
    with pytest.raises(CollectiveAborted, match="NaN or Inf"):
        hb.wait(5)  # its own input: refused before anything is sent
    with pytest.raises(CollectiveAborted):
        ha.wait(5)
    # without finite=True the fp32 ring is lossless: a NaN is a value like any other
    outs = [a.all_reduce(x, ring, 0, tag="nan2", groups=[0, 1]), b.all_reduce(y, ring, 1, tag="nan2", groups=[0, 1])]
    got = [h.wait(5) for h in outs]
    assert all(bool(torch.isnan(g[3])) and g[0] == 1.0 for g in got)


def test_a_probe_is_answered_only_towards_the_group_that_sent_it(ring3) -> None:
    """An insider of group 5 sends a PROBE claiming member 2's address: member 0 would dial member
    2 (group 2) to answer, sees another group, and answers nobody."""
    s = _insider(ring3[0], ring3[2].address, group=5)
    try:
        before = ring3[2].bytes_received
        s.sendall(pack_header(MsgType.PROBE, b"", 1, 0, 0, 16) + bytes(16))
        time.sleep(1.0)
        assert ring3[2].bytes_received - before < 200  # at most a handshake, no PROBE_ACK
    finally:
        s.close()
