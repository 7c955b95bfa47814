"""Error types of the transport package.

Everything the transport raises on purpose is a `TransportError` (itself a `RuntimeError`), so a
caller can catch one type. `CollectiveAborted` is the one error a collective (all-reduce) raises.
"""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)


class TransportError(RuntimeError):
    """Base class of every error raised on purpose by `transport`."""


class WireError(TransportError):
    """Bytes from a peer do not follow the wire format (bad magic, version, type, length, tag)."""


class PeerAuthError(TransportError):
    """A peer failed the shared-secret handshake (wrong secret, or not a transport peer at all)."""


class PeerDisconnected(TransportError):
    """The connection to a peer ended (EOF or reset), possibly in the middle of a message."""


class CollectiveAborted(TransportError):
    """A collective could not finish: a peer died, never connected, sent garbage, or timed out.

    The message names the collective's tag, the peer concerned and what happened. The caller's
    input tensor is left unchanged.
    """


def raised_within(exc: BaseException, kind: type[E]) -> E | None:
    """The exception of type ``kind`` that ``exc`` is, or that it was raised from or while handling
    (its ``__cause__``/``__context__`` chain, cycles cut), or None."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def auth_cause(exc: BaseException) -> "PeerAuthError | None":
    """The ``PeerAuthError`` that ``exc`` is or was raised from (its ``__cause__``/``__context__``
    chain), or None: a wrong secret or certificate behind a collective that aborted."""
    return raised_within(exc, PeerAuthError)
