"""Mutual handshake (HMAC-SHA256 challenge-response) that also proves each side's group.

    client -> HELLO     aux = cg | payload = Nc (32 B) | client's own address (UTF-8)
    server -> CHALLENGE aux = sg | payload = Ns (32 B) | HMAC(K, "srv" | Nc | Ns | addr [| cg | sg])
    client -> PROOF     payload = HMAC(K, "cli" | Nc | Ns | addr [| cg | sg])   (after checking the server)
    server -> ACCEPT    (or REJECT with a reason, then close)

A client that finds the server's MAC wrong (or cannot key it) sends REJECT with the reason instead
of PROOF, so both sides of a wrong secret raise PeerAuthError, not one of them a lost connection.

cg, sg: each side's group + 1 in the envelope's aux field (0: no group identity). K is the key the
two groups share (`transport.identity`: K(cg, sg)), or the job-wide secret when neither side has
a group (the MACs then omit the groups: the handshake of wire version 1 as it always was). Both
sides prove knowledge of K over fresh nonces, so a recorded handshake cannot be replayed, and the
MACs bind both groups and the client's claimed address: a peer that proves group g at address A
holds a key of group g (a `GroupKeys` of g, or the job secret). The
client checks the server first, so it never sends data to an impostor; the server reads no data
message from a client before its PROOF checks out.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from typing import Callable, NamedTuple

from .errors import PeerAuthError, WireError
from .identity import MAX_GROUP, Credentials, as_credentials
from .wire import MsgType, read_message, send_message

NONCE_BYTES = 32
MAC_BYTES = 32
MAX_ADDRESS_BYTES = 256
_HANDSHAKE_MAX_PAYLOAD = NONCE_BYTES + MAX_ADDRESS_BYTES + MAC_BYTES
_GROUP = struct.Struct("!Q")


class PeerIdentity(NamedTuple):
    """What a handshake proved about the peer: its claimed address and its group (None: none)."""

    address: str
    group: int | None


def _wire_group(group: int | None) -> int:
    """The envelope's aux for a group: group + 1, 0 for none."""
    return 0 if group is None else group + 1


def _read_group(aux: int) -> int | None:
    if aux > MAX_GROUP + 1:
        raise WireError(f"group {aux - 1} out of range")
    return None if aux == 0 else aux - 1


def _mac(key: bytes, role: bytes, nc: bytes, ns: bytes, cg: int, sg: int, addr: bytes) -> bytes:
    groups = b"" if cg == sg == 0 else _GROUP.pack(cg) + _GROUP.pack(sg)
    return hmac.new(key, role + nc + ns + len(addr).to_bytes(2, "big") + addr + groups, hashlib.sha256).digest()


def _expect(sock: socket.socket, want: MsgType, on_bytes: Callable[[int], None] | None):
    msg = read_message(sock, _HANDSHAKE_MAX_PAYLOAD, frozenset({want, MsgType.REJECT}), on_bytes)
    if msg.type == MsgType.REJECT:
        reason = "".join(c if c.isprintable() else "?" for c in bytes(msg.payload[:200]).decode("utf-8", "replace"))
        raise PeerAuthError(f"peer rejected the handshake: {reason!r}")  # the peer's words, unproven: quoted
    return msg


def _reject(sock: socket.socket, reason: str) -> int:
    try:
        return send_message(sock, MsgType.REJECT, payload=reason.encode("utf-8")[:200])
    except OSError:
        return 0


def dial_handshake(
    sock: socket.socket,
    creds: "bytes | Credentials",
    my_address: str,
    peer: str,
    on_bytes: Callable[[int], None] | None = None,
    expect_group: int | None = None,
) -> tuple[int, int | None]:
    """Authenticate both ways as the dialing side; returns (bytes sent, the group the server
    proved). ``expect_group``: refuse (PeerAuthError, before proving anything) a server that
    proves another group. Raises PeerAuthError/WireError."""
    creds = as_credentials(creds)
    addr = my_address.encode("utf-8")
    if len(addr) > MAX_ADDRESS_BYTES:
        raise ValueError(f"address too long: {my_address!r}")
    nc, cg = os.urandom(NONCE_BYTES), _wire_group(creds.group)
    sent = send_message(sock, MsgType.HELLO, payload=nc + addr, aux=cg)
    msg = _expect(sock, MsgType.CHALLENGE, on_bytes)
    if len(msg.payload) != NONCE_BYTES + MAC_BYTES:
        raise WireError(f"bad CHALLENGE from {peer}: {len(msg.payload)} bytes")
    ns, server_mac = bytes(msg.payload[:NONCE_BYTES]), bytes(msg.payload[NONCE_BYTES:])
    sg = msg.aux
    server_group = _read_group(sg)
    try:
        key = creds.key_for(server_group)  # PeerAuthError: no key for the group it claims
    except PeerAuthError as e:
        _reject(sock, f"the dialing side holds no key for this side: {e}")
        raise
    if not hmac.compare_digest(server_mac, _mac(key, b"srv", nc, ns, cg, sg, addr)):
        what = "wrong shared secret?" if creds.group is None else f"wrong credentials for group {server_group}?"
        # the server learns it too: both sides of a wrong secret stop with the same error (exit 2)
        _reject(sock, f"authentication failed: the dialing side found this side's proof wrong ({what})")
        raise PeerAuthError(f"peer {peer} failed authentication ({what})")
    if expect_group is not None and creds.group is not None and server_group != expect_group:
        _reject(sock, f"proved group {server_group}, the dialing side expected group {expect_group}")
        raise PeerAuthError(f"peer {peer} proved group {server_group}, expected group {expect_group}")
    sent += send_message(sock, MsgType.PROOF, payload=_mac(key, b"cli", nc, ns, cg, sg, addr))
    _expect(sock, MsgType.ACCEPT, on_bytes)
    return sent, server_group


def client_handshake(
    sock: socket.socket,
    secret: "bytes | Credentials",
    my_address: str,
    peer: str,
    on_bytes: Callable[[int], None] | None = None,
) -> int:
    """Authenticate both ways as the dialing side; returns bytes sent. Raises PeerAuthError/WireError."""
    return dial_handshake(sock, secret, my_address, peer, on_bytes)[0]


def accept_handshake(
    sock: socket.socket,
    creds: "bytes | Credentials",
    on_bytes: Callable[[int], None] | None = None,
    on_sent: Callable[[int], None] | None = None,
) -> PeerIdentity:
    """Authenticate both ways as the accepting side; returns what the peer proved."""
    creds = as_credentials(creds)
    msg = read_message(sock, _HANDSHAKE_MAX_PAYLOAD, frozenset({MsgType.HELLO}), on_bytes)
    if not NONCE_BYTES < len(msg.payload) <= NONCE_BYTES + MAX_ADDRESS_BYTES:
        raise WireError(f"bad HELLO: {len(msg.payload)} bytes")
    nc, addr, cg = bytes(msg.payload[:NONCE_BYTES]), bytes(msg.payload[NONCE_BYTES:]), msg.aux
    try:
        peer = addr.decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("HELLO address is not UTF-8") from None
    client_group = _read_group(cg)
    try:
        key = creds.key_for(client_group)
    except PeerAuthError as e:
        n = _reject(sock, str(e))
        if on_sent is not None:
            on_sent(n)
        raise PeerAuthError(f"peer claiming {peer!r}: {e}") from None
    ns, sg = os.urandom(NONCE_BYTES), _wire_group(creds.group)
    n = send_message(sock, MsgType.CHALLENGE, payload=ns + _mac(key, b"srv", nc, ns, cg, sg, addr), aux=sg)
    try:  # a client that found this side's proof wrong says so (REJECT) rather than hang up
        msg = _expect(sock, MsgType.PROOF, on_bytes)
    except PeerAuthError as e:
        raise PeerAuthError(f"peer claiming {peer!r}: {e}") from None
    if not hmac.compare_digest(bytes(msg.payload), _mac(key, b"cli", nc, ns, cg, sg, addr)):
        n += _reject(sock, "authentication failed")
        what = "wrong shared secret?" if client_group is None else f"no credentials of group {client_group}"
        raise PeerAuthError(f"peer claiming {peer!r} failed authentication ({what})")
    n += send_message(sock, MsgType.ACCEPT)
    if on_sent is not None:
        on_sent(n)
    return PeerIdentity(peer, client_group)


def server_handshake(
    sock: socket.socket,
    secret: "bytes | Credentials",
    on_bytes: Callable[[int], None] | None = None,
    on_sent: Callable[[int], None] | None = None,
) -> str:
    """Authenticate both ways as the accepting side; returns the peer's (authenticated) address."""
    return accept_handshake(sock, secret, on_bytes, on_sent).address
