"""This rank's data-plane endpoint and its credentials: the job secret or a group's keyring, the
group's keys, the address the other groups dial, the tcp/grpc transport listening there, and the
TLS files the coordinator is dialled with. Also what one group's ranks are given and nothing more
(``group_credentials``: what ``diloco run`` hands each group and ``diloco credentials`` writes for
an operator's per-group Secrets). Torch-free until a transport is made."""

from __future__ import annotations

import os
from pathlib import Path

from diloco.coordinator.credentials import group_token, parse_group_token
from diloco.job.config import ConfigError, TransportConfig
from transport.identity import GroupKeys
from transport.link_spec import LinkSpec
from transport.tls import TlsConfig

SECRET_ENV = "DILOCO_SECRET"
TOKEN_ENV = "DILOCO_TOKEN"
#: the files ``diloco credentials`` writes per group (the keys of its Secret), by the variable they fill
CREDENTIAL_FILES = {SECRET_ENV: "data-plane-keys", TOKEN_ENV: "coordinator-credential"}


class ConnectError(RuntimeError):
    """This rank cannot join the job; the message says why."""


def read_secret(value: bytes | str | GroupKeys | None = None) -> bytes | GroupKeys:
    """The data plane's job secret: ``value`` (bytes, or hex text) or ``$DILOCO_SECRET`` (hex); or
    one group's keyring (``GroupKeys``, or its ``to_text()`` form), which lets a rank be only
    that group (see ``transport.identity``)."""
    if isinstance(value, GroupKeys):
        return value
    if isinstance(value, bytes):
        secret = value
    else:
        text = value if value is not None else os.environ.get(SECRET_ENV, "")
        if not text:
            raise ConnectError(f"no secret: pass secret= or set {SECRET_ENV} (hex, 16+ bytes)")
        if GroupKeys.is_text(text):
            try:
                return GroupKeys.from_text(text)
            except ValueError as e:
                raise ConnectError(str(e)) from None
        try:
            secret = bytes.fromhex(text)
        except ValueError as e:
            raise ConnectError("the secret must be hex text (or bytes)") from e
    if len(secret) < 16:
        raise ConnectError("the secret must hold at least 16 bytes (32 hex digits)")
    return secret


def group_keys(secret: bytes | GroupKeys, group: int) -> GroupKeys:
    """Group ``group``'s data-plane credentials: derived from the job secret, or the keyring given
    (which must be that group's). Its handshakes then prove the group to every peer."""
    if isinstance(secret, GroupKeys):
        if secret.group != group:
            raise ConnectError(f"the data-plane keyring is group {secret.group}'s, not group {group}'s")
        return secret
    return GroupKeys.derive(secret, group)


def group_credentials(job_token: str, job_secret: bytes, group: int, groups: int) -> dict[str, str]:
    """What group ``group`` of a job of ``groups`` groups is given, as its ranks' environment, and
    nothing more: ``DILOCO_SECRET``, its data-plane keyring (its pair key with each group, the job
    secret not kept: ``GroupKeys.to_text``), and ``DILOCO_TOKEN``, its coordinator credential
    (``credentials.group_token``). With them a rank proves it is group ``group`` and can be no other
    group; it cannot stop the job, read ``/status`` or derive anything else."""
    if not job_token or parse_group_token(job_token) is not None:
        raise ValueError("the job token must be the coordinator's own token, not a group's credential")
    if isinstance(group, bool) or not (isinstance(group, int) and isinstance(groups, int) and 0 <= group < groups):
        raise ValueError(f"group must be in 0..{groups - 1}, got {group!r}")
    keys = GroupKeys.derive(job_secret, group, peers=range(groups))
    return {SECRET_ENV: keys.to_text(), TOKEN_ENV: group_token(job_token, group)}


def write_secret_file(path: Path, text: str) -> None:
    """Write ``text`` to a new file ``path`` readable by its owner only (mode 0600; an existing file
    is replaced, never written through, and a symbolic link there is an error)."""
    path = Path(path)
    if path.is_symlink():
        raise OSError(f"{path} is a symbolic link: not writing a secret through it")
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def advertised_address(t: TransportConfig, local_rank: int) -> str | None:
    """What this rank tells the other groups to dial (``--advertise-address``, its port + the local
    rank when it names one, else ``--data-port`` + the local rank), or None: the address listened on."""
    if not t.advertise_address:
        return None
    if not t.data_port:
        raise ConfigError("--advertise-address needs --data-port: whatever is in front of the rank (a load "
                          "balancer, a NodePort, a NAT) forwards a port it knows")
    host, sep, port = t.advertise_address.rpartition(":")
    if not sep or "]" in port:
        host, port = t.advertise_address, ""
    host = host if host.startswith("[") or ":" not in host else f"[{host}]"
    return f"{host}:{(int(port) if port else t.data_port) + local_rank}"


def make_transport(t: TransportConfig, secret: bytes | GroupKeys, local_rank: int = 0):
    """This rank's data-plane endpoint (tcp or grpc), listening on ``t.host`` (port ``--data-port`` +
    ``local_rank``, or one the kernel picks) and advertising ``advertised_address``, as configured."""
    return link_spec(t, local_rank).build(secret)


def link_spec(t: TransportConfig, local_rank: int = 0) -> LinkSpec:
    """The link settings of this rank's endpoint (``--link``, ``--data-plane`` and the endpoint's
    flags): the one place a ``TransportConfig`` becomes a ``transport.link_spec.LinkSpec``."""
    threads = 1
    if t.data_plane == "process":  # its codecs and sums get as many threads as this rank's own ops
        import torch

        threads = torch.get_num_threads()
    return LinkSpec(
        link=t.link, host=t.host, port=t.data_port + local_rank if t.data_port else 0,
        advertise=advertised_address(t, local_rank), timeout_s=t.timeout_s,
        tls=TlsConfig(t.tls_cert, t.tls_key, t.tls_ca) if t.tls_cert else None, allow_plaintext=t.plaintext,
        connections_per_peer=t.connections, chunk_bytes=t.chunk_bytes, handshake_timeout_s=t.handshake_timeout,
        max_unauthenticated=t.max_unauthenticated, max_unauthenticated_per_source=t.max_unauthenticated_per_source,
        max_pending_bytes=t.max_pending_bytes, data_plane=t.data_plane, threads=threads)


def coordinator_tls(t: TransportConfig, coordinator: str) -> TlsConfig | None:
    """The TLS files this rank dials the coordinator ``host:port`` with: the data plane's own
    (``--tls-cert/--tls-key/--tls-ca``), so one PKI covers both; none without them, or when the
    coordinator is on a loopback address (``diloco run`` serves it there in plain text)."""
    from transport.addresses import is_loopback

    if not t.tls_cert or is_loopback(coordinator.rsplit(":", 1)[0]):
        return None
    return TlsConfig(t.tls_cert, t.tls_key, t.tls_ca)
