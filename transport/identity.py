"""Who a data-plane peer is: per-group credentials, derived from the job secret.

With one secret shared by the whole job, any holder can pose as any member. Here each *pair* of
groups has its own key, derived from the job secret::

    K(a, b) = HMAC-SHA256(job_secret, "diloco/data-plane/pair/v1:" min(a,b) ":" max(a,b))

A group's credentials (`GroupKeys`) are its keys with every other group. The handshake
(`transport.auth`) names both sides' groups and is keyed with K(client group, server group), so:

* a successful handshake proves to each side that the other holds a key of that pair, i.e. is
  the group it claims (or the operator holding the job secret);
* group g's credentials cannot pose as group h towards group k: that needs K(h, k), which only
  h and k hold. (A process that holds the job secret itself can derive every key: give each
  group only its own keys, `GroupKeys.derive(secret, g, peers=...).to_text()`, to confine it.)

The group a connection proved travels with every message it carries, so a collective takes data
and aborts only from its actual ring neighbour (see `transport.ring`). `SharedSecret` is the
job-wide secret of old: no group identity, every holder is every member.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Iterable, Mapping, Protocol

from .errors import PeerAuthError

#: Largest group id (the coordinator's ids are 0..1023; leave room).
MAX_GROUP = (1 << 31) - 1
_TEXT_PREFIX = "diloco-group-keys/v1"
_PAIR_LABEL = b"diloco/data-plane/pair/v1:"


class Credentials(Protocol):
    """What the handshake needs: this side's group (None: no group identity) and the key
    shared with a peer of a given group."""

    group: int | None

    def key_for(self, peer_group: int | None) -> bytes:
        """The handshake key with a peer of ``peer_group``; PeerAuthError if there is none."""


def _check_group(group: object) -> int:
    if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group <= MAX_GROUP:
        raise ValueError(f"group must be an int in [0, {MAX_GROUP}], got {group!r}")
    return group


def pair_key(job_secret: bytes, a: int, b: int) -> bytes:
    """K(a, b) = K(b, a): the key groups a and b share (32 bytes)."""
    lo, hi = sorted((_check_group(a), _check_group(b)))
    return hmac.new(bytes(job_secret), _PAIR_LABEL + f"{lo}:{hi}".encode(), hashlib.sha256).digest()


class SharedSecret:
    """The job-wide shared secret: no group identity (every holder can be any member)."""

    group = None

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) == 0:
            raise ValueError("secret must be non-empty bytes")
        self._secret = bytes(secret)

    def key_for(self, peer_group: int | None) -> bytes:
        if peer_group is not None:
            raise PeerAuthError(f"peer claims group {peer_group}, but this side has no group credentials "
                                "(only a job-wide shared secret)")
        return self._secret


class GroupKeys:
    """The data-plane credentials of one group: its pair key with each peer group.

    Build them with `derive` (from the job secret) or `from_text` (a provisioned keyring).
    ``peers=None`` in `derive` keeps the job secret and derives any pair on demand (what a rank
    does that was given the job secret anyway); a list of peers derives only those keys and
    forgets the secret (what to hand to a group that should be able to be only itself).
    """

    def __init__(self, group: int, keys: Mapping[int, bytes], *, job_secret: bytes | None = None) -> None:
        self.group = _check_group(group)
        self._keys = {_check_group(h): bytes(k) for h, k in keys.items()}
        if any(len(k) != 32 for k in self._keys.values()):
            raise ValueError("pair keys must be 32 bytes")
        if job_secret is not None and len(job_secret) == 0:
            raise ValueError("job_secret must be non-empty bytes")
        self._job_secret = bytes(job_secret) if job_secret is not None else None

    @classmethod
    def derive(cls, job_secret: bytes, group: int, peers: Iterable[int] | None = None) -> "GroupKeys":
        """Group ``group``'s keys from the job secret: with every group (``peers=None``, derived
        on demand) or only with ``peers`` (the secret is not kept)."""
        if not isinstance(job_secret, (bytes, bytearray)) or len(job_secret) == 0:
            raise ValueError("job_secret must be non-empty bytes")
        if peers is None:
            return cls(group, {}, job_secret=bytes(job_secret))
        return cls(group, {h: pair_key(job_secret, group, h) for h in peers})

    @property
    def peers(self) -> list[int] | None:
        """The peer groups this keyring holds keys for (None: any, derived from the job secret)."""
        return None if self._job_secret is not None else sorted(self._keys)

    def key_for(self, peer_group: int | None) -> bytes:
        if peer_group is None:
            raise PeerAuthError(f"peer has no group identity (a job-wide shared secret?); group {self.group} "
                                "talks only to peers with group credentials")
        key = self._keys.get(peer_group)
        if key is None and self._job_secret is not None:
            key = pair_key(self._job_secret, self.group, peer_group)
        if key is None:
            raise PeerAuthError(f"group {self.group} holds no key for peer group {peer_group}")
        return key

    def to_text(self) -> str:
        """The keyring as one line of text (secret: hand it only to the group's own ranks);
        only for keyrings of listed peers (the job secret is never written out)."""
        if self._job_secret is not None:
            raise ValueError("derive the keyring with an explicit list of peers before writing it out")
        keys = ",".join(f"{h}={self._keys[h].hex()}" for h in sorted(self._keys))
        return f"{_TEXT_PREFIX}:{self.group}:{keys}"

    @classmethod
    def from_text(cls, text: str) -> "GroupKeys":
        """Parse `to_text`'s output (ValueError if it is not one)."""
        try:
            prefix, group, keys = text.strip().split(":", 2)
            if prefix != _TEXT_PREFIX:
                raise ValueError(prefix)
            pairs = (item.split("=", 1) for item in keys.split(",") if item)
            return cls(int(group), {int(h): bytes.fromhex(k) for h, k in pairs})
        except ValueError as e:
            raise ValueError(f"not a {_TEXT_PREFIX} keyring: {e}") from None

    @staticmethod
    def is_text(text: str) -> bool:
        """Whether text looks like `to_text`'s output."""
        return text.strip().startswith(_TEXT_PREFIX + ":")

    def __repr__(self) -> str:  # never the keys
        return f"GroupKeys(group={self.group}, peers={'any' if self.peers is None else self.peers})"


def as_credentials(secret: "bytes | bytearray | Credentials") -> Credentials:
    """Credentials from what a transport was given: bytes are a job-wide `SharedSecret`."""
    if isinstance(secret, (bytes, bytearray)):
        return SharedSecret(secret)
    if not hasattr(secret, "key_for") or not hasattr(secret, "group"):
        raise ValueError(f"secret must be bytes or transport.identity credentials, got {type(secret).__name__}")
    return secret
