"""Why a TLS connection to the coordinator fails, in words, from one handshake.

gRPC reports a refused certificate as ``UNAVAILABLE: Socket closed`` or ``Ssl handshake failed``
and retries; a rank would wait its whole deadline before saying anything useful. ``tls_problem``
makes one TLS handshake to the coordinator's address with the rank's own files (as gRPC would) and
names what went wrong: this side does not trust the coordinator's certificate (another CA, an
expired certificate, a name the certificate does not carry), or the coordinator refused this side's
(its CA did not sign it, it expired). An address where nothing answers is not a TLS problem (the
coordinator may not be up yet): None, and the caller keeps waiting.
"""

from __future__ import annotations

import socket
import ssl
import time


def check_coordinator(address: str, *, cert: str, key: str, ca: str, timeout_s: float, poll_s: float = 1.0) -> None:
    """Wait until the coordinator at ``address`` completes a TLS handshake with this side's files;
    raise ``ConfigError`` naming the cause as soon as a handshake fails (a certificate problem does
    not heal by waiting). While nothing answers it keeps trying, and returns after ``timeout_s``
    (the client then reports the coordinator unreachable)."""
    from diloco.job.config import ConfigError

    deadline = time.monotonic() + timeout_s
    while True:
        state, problem = _attempt(address, cert=cert, key=key, ca=ca, timeout_s=min(5.0, timeout_s))
        if state == "failed":
            raise ConfigError(f"coordinator TLS: {problem}")
        if state == "ok" or time.monotonic() + poll_s > deadline:
            return
        time.sleep(poll_s)


def tls_problem(address: str, *, cert: str, key: str, ca: str, timeout_s: float = 5.0) -> str | None:
    """What is wrong with TLS between this side's files and the TLS server at ``address``
    (``host:port``), or None when the handshake succeeds or nothing answers there. OSError /
    ssl.SSLError from reading the files propagate (a configuration error)."""
    return _attempt(address, cert=cert, key=key, ca=ca, timeout_s=timeout_s)[1]


def _attempt(address: str, *, cert: str, key: str, ca: str, timeout_s: float) -> tuple[str, str | None]:
    """``("ok", None)``, ``("unreachable", None)`` or ``("failed", why)`` for one handshake."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ValueError(f"bad address {address!r}, want host:port")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])  # what gRPC offers
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout_s)
    except OSError:
        return "unreachable", None
    try:
        with ctx.wrap_socket(raw, server_hostname=host) as tls:
            # with TLS 1.3 the server judges the client's certificate after the client's handshake
            # is done: its refusal is the first thing read
            tls.settimeout(min(1.0, timeout_s))
            refused = (f"the coordinator at {address} refused this side's certificate {cert} ({{}}): is it "
                       "signed by the CA the coordinator trusts, and valid now?")
            try:
                data = tls.recv(1)
            except (socket.timeout, TimeoutError):
                return "ok", None  # it waits for this side's first frame: the certificate passed
            except ssl.SSLError as e:  # an alert, or the connection cut inside TLS
                return "failed", refused.format(e.reason or e)
            except OSError as e:
                return "failed", refused.format(f"the connection was reset: {e}")
            # an HTTP/2 server speaks first (its settings); a closed connection is a refusal
            if data:
                return "ok", None
            return "failed", refused.format("it closed the connection after the handshake")
    except ssl.SSLCertVerificationError as e:
        return "failed", (f"this side does not trust the certificate of the coordinator at {address}: "
                          f"{e.verify_message} (CA file {ca}; the coordinator's certificate must be signed by it, "
                          f"be valid now and name {host!r})")
    except ssl.SSLError as e:
        return "failed", f"the TLS handshake with the coordinator at {address} failed: {e.reason or e}"
    except OSError:
        return "unreachable", None
    finally:
        raw.close()
