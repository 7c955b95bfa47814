"""The drill's relays in front of each group's data plane: traffic passes through them, and a
corrupt fault makes the receiving side refuse what it got instead of using it."""

import pytest
import torch

from diloco.runtime.launch.link_relays import CorruptingRelays
from transport import TcpTransport
from transport.errors import CollectiveAborted

SECRET = b"relay-test-secret-0123456789"


def pair(relays: CorruptingRelays) -> list[TcpTransport]:
    """Two members listening where ``relays.args`` tell their groups to, advertising the relays."""
    out = []
    for g in range(2):
        flags = relays.args(g)
        port, advertised = int(flags[flags.index("--data-port") + 1]), flags[flags.index("--advertise-address") + 1]
        out.append(TcpTransport("127.0.0.1", port, advertise=advertised, secret=SECRET, timeout_s=5.0))
    return out


def ring(ts, xs, tag):
    addrs = [t.address for t in ts]
    handles = [t.all_reduce(x, addrs, i, tag=tag) for i, (t, x) in enumerate(zip(ts, xs))]
    return [h.wait(timeout_s=20) for h in handles]


def test_members_reach_each_other_through_the_relays_and_a_flipped_bit_is_refused():
    xs = [torch.randn(200_000, generator=torch.Generator().manual_seed(g)) for g in range(2)]
    with CorruptingRelays(2) as relays:
        ts = pair(relays)
        try:
            assert [t.address for t in ts] == [p.address for p in relays.proxies]
            means = ring(ts, xs, "clean")
            assert torch.equal(means[0], means[1]) and torch.allclose(means[0], (xs[0] + xs[1]) / 2)
            relays.corrupt(1)
            with pytest.raises(CollectiveAborted):
                ring(ts, xs, "corrupted")
            assert relays.flips and relays.flips[0][0] == 1
            means = ring(ts, xs, "again")  # the link works again after the bad stream
            assert torch.equal(means[0], means[1])
        finally:
            for t in ts:
                t.close(flush_timeout_s=1.0)


def test_the_groups_ports_come_from_below_the_kernels_ephemeral_range_and_are_free():
    """A group binds its port seconds after the drill picked it; a port from the ephemeral range
    could be handed meanwhile to any outgoing connection (CI once: 'Address already in use')."""
    import socket

    from diloco.runtime.launch.link_relays import PORTS_BELOW_EPHEMERAL, ephemeral_ports

    low, high = ephemeral_ports()
    assert 1024 <= low < high <= 65535
    with CorruptingRelays(3) as relays:
        ports = [int(relays.args(g)[1]) for g in range(3)]
        assert len(set(ports)) == 3 and all(low - PORTS_BELOW_EPHEMERAL <= p < low for p in ports), (ports, low)
        for p in ports:  # free: the group can bind it
            with socket.create_server(("127.0.0.1", p)):
                pass
