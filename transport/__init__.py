"""Moving bytes between worker groups: authenticated links and ring collectives over them.

    t = TcpTransport("127.0.0.1", 0, secret=b"...")
    h = t.all_reduce(x, ring=[...], index=i, tag="r12/s3")
    mean = h.wait()

Modules: wire (message format), auth (the handshake), identity (per-group credentials derived
from a job secret, `GroupKeys`), tls / certs (mutual TLS),
conn (sender threads), core (collectives and dispatch, any link type), pending (frames kept for
collectives not started here yet), tcp and grpclink (the
link types; addresses: their host:port and loopback helpers),
process and dataplane (a transport run in a child process, `ProcessTransport`, and
that process; control is their channel), ring (the all-reduce), gather (the all-gather mean, for
error-feedback codecs), frames (codec frames, the raw fp32 fast path), partition (segments and
chunks), outputs (checks on out= buffers), shaping (token bucket), plan (stripes), probe (ring order),
faultproxy (a fault-injecting TCP relay for tests and benchmarks), link_spec (the link types by name and
what an endpoint is built from, `LinkSpec`).
"""

import importlib
from typing import TYPE_CHECKING, Any

from .errors import CollectiveAborted, PeerAuthError, PeerDisconnected, TransportError, WireError
from .faultproxy import FaultProxy
from .identity import GroupKeys
from .link_spec import LinkSpec, link_names
from .plan import Stripe, StripePlan, stripe_plan
from .probe import ring_order
from .shaping import TokenBucket
from .tls import TlsConfig

if TYPE_CHECKING:
    from .grpclink import GrpcTransport
    from .process import ProcessTransport
    from .process_handle import ProcessHandle
    from .ring_collective import Handle
    from .tcp import TcpTransport

#: the names whose modules load on first use: the links and collectives import torch (seconds on a
#: CUDA host), which the coordinator (errors, TLS settings) does without; gRPC is heavy and does not
#: like fork()
_LAZY = {"GrpcTransport": ".grpclink", "ProcessHandle": ".process_handle", "ProcessTransport": ".process",
         "Handle": ".ring_collective", "TcpTransport": ".tcp"}

__all__ = [
    "CollectiveAborted",
    "FaultProxy",
    "GroupKeys",
    "GrpcTransport",
    "Handle",
    "LinkSpec",
    "PeerAuthError",
    "PeerDisconnected",
    "ProcessHandle",
    "ProcessTransport",
    "Stripe",
    "StripePlan",
    "TcpTransport",
    "TlsConfig",
    "TokenBucket",
    "TransportError",
    "WireError",
    "link_names",
    "ring_order",
    "stripe_plan",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'transport' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
