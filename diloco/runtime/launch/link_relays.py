"""Relays in front of each group's data plane, for the fault drill's corrupting links.

``diloco run --chaos N --chaos-kinds ...,corrupt`` (and ``bench/goodput.py --kinds``) put a
``transport.FaultProxy`` in front of every group: the group listens on a port picked here
(``--data-port``) and tells the others to dial its relay instead (``--advertise-address``), so
everything it receives from the other groups passes through the relay, across its restarts (a
restarted group listens on the same port again). ``corrupt(group)`` flips one bit of what that
group receives next, at a random place in the next ``FLIP_WINDOW_BYTES``: a frame, or a handshake,
fails its check on arrival, and that exchange rolls back and runs again.

Loopback only, and groups of one rank (a rank's port is ``--data-port`` + its local rank, while
the relays' ports are the kernel's picks). A group's port is picked below the kernel's ephemeral
range: the group binds it seconds later, and a port in that range may be handed meanwhile to any
outgoing connection (CI once: ``Address already in use`` for a group's data port).
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from pathlib import Path

from transport import FaultProxy

FLIP_WINDOW_BYTES = 1 << 16
#: where the ports picked here come from: below the kernel's ephemeral range, this many of them
PORTS_BELOW_EPHEMERAL = 8192


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections and bind(0) (Linux's default where it is not readable)."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def reserved_free_port(host: str, rng: random.Random, taken: Collection[int] = ()) -> int:
    """A port free now, below the ephemeral range and not in ``taken``: no connection or bind(0) is
    handed it before the group binds it, as one in the range could be."""
    low = ephemeral_ports()[0]
    first = max(1024, low - PORTS_BELOW_EPHEMERAL)
    for _ in range(200):
        port = rng.randrange(first, low)
        if port in taken:
            continue
        try:
            with socket.create_server((host, port)):
                return port
        except OSError:  # taken: another one
            continue
    raise OSError(f"no free port in [{first}, {low}) on {host} after 200 tries")


class CorruptingRelays:
    """One relay per group on ``host``; ``args(group)`` are the worker flags that route the group's
    incoming links through its relay."""

    def __init__(self, groups: int, *, host: str = "127.0.0.1", seed: int = 0) -> None:
        self.host, self.rng = host, random.Random(seed)
        ports = random.SystemRandom()  # not the seeded drill's: two runs at once must not pick alike
        self.ports: list[int] = []
        self.proxies: list[FaultProxy] = []
        self.flips: list[tuple[int, int]] = []  # (group, offset of the flipped byte)
        try:
            for _ in range(groups):
                port = reserved_free_port(host, ports, taken=self.ports)
                self.ports.append(port)
                self.proxies.append(FaultProxy(f"{host}:{port}", listen_host=host))
        except BaseException:
            self.close()
            raise

    def args(self, group: int) -> list[str]:
        """``diloco worker`` flags: listen on the group's port, advertise its relay."""
        return ["--data-port", str(self.ports[group]), "--advertise-address", self.proxies[group].address]

    def corrupt(self, group: int) -> None:
        """Flip one random bit of one byte among the next ``FLIP_WINDOW_BYTES`` ``group`` receives."""
        offset = self.rng.randrange(FLIP_WINDOW_BYTES)
        self.proxies[group].corrupt(at_offset=offset, direction="up", seed=self.rng.randrange(1 << 30))
        self.flips.append((group, offset))

    def close(self) -> None:
        for p in self.proxies:
            p.close()

    def __enter__(self) -> "CorruptingRelays":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
