"""The link family's spec: the link types by name, and what an endpoint of any of them is built from.

``LINKS`` is the registry: a link type's name and where its class lives (a ``TransportBase``
subclass, imported on ``build``, so this module, and a configuration that names a link, stay
torch-free). ``LinkSpec`` holds the settings every link type takes, spelled once (the link classes
take them as keywords, ``TransportBase`` checks them), their checks and ``build()``: the endpoint
in this process, or in a child process (``data_plane="process"``, ``ProcessTransport``).

A new link type: its module with a ``TransportBase`` subclass, and one line in ``LINKS``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Mapping

from .guard import DEFAULT_HANDSHAKE_TIMEOUT_S, DEFAULT_MAX_UNAUTHENTICATED, DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE
from .pending import DEFAULT_MAX_PENDING_BYTES

if TYPE_CHECKING:
    from .identity import Credentials
    from .shaping import TokenBucket
    from .tls import TlsConfig

#: the rings' pipelining unit, bytes of fp32 input per chunk. 4 MiB made a 19M-parameter model's blocking
#: fp32 sync 7-12 % shorter on loopback and veth, but fp32 with zstd at 1 Gbit/s 7-16 % longer
#: (each hop compresses a whole chunk before it sends): bench/pages/sync_stall.md, "chunk size"
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20

#: every link type by name: "module:class" of its ``TransportBase`` subclass
LINKS: dict[str, str] = {"tcp": "transport.tcp:TcpTransport", "grpc": "transport.grpclink:GrpcTransport"}
#: where an endpoint runs: in the trainer's process, or in a child process of its own
DATA_PLANES = ("thread", "process")


def link_names() -> tuple[str, ...]:
    """The link types' names, in ``LINKS`` order."""
    return tuple(LINKS)


def check_link(name: str) -> str:
    """``name`` when it is a link type; ValueError listing the known ones otherwise."""
    if name not in LINKS:
        raise ValueError(f"unknown link {name!r}: {' or '.join(LINKS)}")
    return name


def link_class(name: str) -> type:
    """The ``TransportBase`` subclass of link type ``name`` (imports it: torch)."""
    module, _, cls = LINKS[check_link(name)].partition(":")
    return getattr(importlib.import_module(module), cls)


@dataclass(frozen=True)
class LinkSpec:
    """An endpoint's settings, for every link type (units: seconds, bytes)."""

    link: str = "tcp"
    host: str = "127.0.0.1"
    port: int = 0  # 0: one the kernel picks
    advertise: str | None = None  # what peers dial, when not host:port
    timeout_s: float = DEFAULT_TIMEOUT_S
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # pipelining unit, bytes of fp32 input
    connections_per_peer: int = 1
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    tls: TlsConfig | None = None
    allow_plaintext: bool = False
    pin_memory: bool | None = None  # None: when CUDA is available
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED
    max_unauthenticated_per_source: int = DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    pending_ttl_s: float | None = None  # None: 2 x timeout_s
    dial_overrides: Mapping[str, str] | None = field(default=None, hash=False)
    data_plane: str = "thread"
    threads: int = 1  # torch threads of a data-plane process

    def problems(self) -> list[str]:
        """What keeps this spec from building, one sentence each (the link checks the rest)."""
        out = []
        for check in (_known_link, _known_data_plane, _threads):
            problem = check(self)
            if problem:
                out.append(problem)
        return out

    def keywords(self) -> dict[str, Any]:
        """The link class's keywords (all but ``link``, ``data_plane``, ``threads``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("link", "data_plane", "threads")}

    def build(self, secret: bytes | Credentials, shaper: TokenBucket | None = None) -> Any:
        """The endpoint, listening: ValueError for a bad setting, OSError when it cannot listen."""
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))
        if self.data_plane == "process":
            from .process import ProcessTransport

            return ProcessTransport(self.link, secret=secret, shaper=shaper, threads=self.threads, **self.keywords())
        return link_class(self.link)(secret=secret, shaper=shaper, **self.keywords())


def _known_link(s: LinkSpec) -> str | None:
    return None if s.link in LINKS else f"unknown link {s.link!r}: {' or '.join(LINKS)}"


def _known_data_plane(s: LinkSpec) -> str | None:
    return None if s.data_plane in DATA_PLANES else f"unknown data plane {s.data_plane!r}: {' or '.join(DATA_PLANES)}"


def _threads(s: LinkSpec) -> str | None:
    return None if s.threads >= 1 else f"threads must be >= 1, got {s.threads}"
