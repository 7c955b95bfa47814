"""Addresses of the links, whatever their type: ``host:port`` split, loopback told apart, and
plain text refused off loopback unless asked for. Shared by ``tcp`` and ``grpclink``."""

from __future__ import annotations

import ipaddress

from .tls import TlsConfig


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" (IPv6 hosts may be bracketed)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad address {address!r}, want host:port")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IP literals."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_plaintext(link: str, host: str, tls: TlsConfig | None, allow_plaintext: bool) -> None:
    """Refuse an unencrypted link on a non-loopback host unless plain text was asked for."""
    if tls is None and not allow_plaintext and not is_loopback(host):
        raise ValueError(
            f"refusing plain-text {link} on non-loopback host {host!r}: pass tls=TlsConfig(...) "
            "or allow_plaintext=True"
        )
