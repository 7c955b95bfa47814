"""Who can reach the coordinator: the PEM files of its mutual TLS, and the refusal to serve other
machines without both TLS and a token (the server's and the client's shared checks)."""

from __future__ import annotations

from typing import Protocol

from transport.addresses import is_loopback


class PemFiles(Protocol):
    """What the coordinator needs of a TLS setting (``transport.TlsConfig`` is one)."""

    def read_pem(self) -> tuple[bytes, bytes, bytes]:
        """(certificate, private key, CA certificate) PEM bytes."""


def read_tls(tls: PemFiles) -> tuple[bytes, bytes, bytes]:
    """(certificate, key, CA) PEM bytes; ValueError naming the file that cannot be read."""
    try:
        return tls.read_pem()
    except OSError as exc:
        raise ValueError(f"coordinator TLS: cannot read {exc.filename}: {exc.strerror}") from None


def check_exposure(host: str, *, token: str | None, tls: PemFiles | None, allow_insecure: bool) -> None:
    """Refuse a coordinator that other machines can reach without both mutual TLS and a token,
    unless ``allow_insecure`` accepts the risk (ValueError naming what is missing)."""
    if allow_insecure or is_loopback(host):
        return
    missing = [what for what, given in (("mutual TLS (--tls-cert, --tls-key, --tls-ca)", tls is not None),
                                        ("a token ($DILOCO_TOKEN)", token is not None)) if not given]
    if missing:
        raise ValueError(
            f"refusing to serve the coordinator on non-loopback host {host!r} without "
            f"{' and '.join(missing)}: anyone who reaches it could join as a group, vote on rounds or "
            "rewrite the bandwidth table. Give them, listen on 127.0.0.1, or accept the risk with "
            "--insecure-coordinator (allow_insecure=True)")
