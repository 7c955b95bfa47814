"""Relays in front of each group's data plane, for the fault drill's corrupting links.

``diloco run --chaos N --chaos-kinds ...,corrupt`` (and ``bench/goodput.py --kinds``) put a
``transport.FaultProxy`` in front of every group: the group listens on a port picked here
(``--data-port``) and tells the others to dial its relay instead (``--advertise-address``), so
everything it receives from the other groups passes through the relay, across its restarts (a
restarted group listens on the same port again). ``corrupt(group)`` flips one bit of what that
group receives next, at a random place in the next ``FLIP_WINDOW_BYTES``: a frame, or a handshake,
fails its check on arrival, and that exchange rolls back and runs again.

Loopback only, and groups of one rank (a rank's port is ``--data-port`` + its local rank, while
the relays' ports are the kernel's picks).
"""

from __future__ import annotations

import random
import socket

from transport import FaultProxy

FLIP_WINDOW_BYTES = 1 << 16


def _free_port(host: str) -> int:
    """A port the kernel would give now (free at the time of asking)."""
    with socket.create_server((host, 0)) as s:
        return s.getsockname()[1]


class CorruptingRelays:
    """One relay per group on ``host``; ``args(group)`` are the worker flags that route the group's
    incoming links through its relay."""

    def __init__(self, groups: int, *, host: str = "127.0.0.1", seed: int = 0) -> None:
        self.host, self.rng = host, random.Random(seed)
        self.ports: list[int] = []
        self.proxies: list[FaultProxy] = []
        self.flips: list[tuple[int, int]] = []  # (group, offset of the flipped byte)
        try:
            for _ in range(groups):
                port = _free_port(host)
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
