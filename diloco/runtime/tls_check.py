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


def tls_problem(address: str, *, cert: str, key: str, ca: str, timeout_s: float = 5.0) -> str | None:
    """What is wrong with TLS between this side's files and the TLS server at ``address``
    (``host:port``), or None when the handshake succeeds or nothing answers there. OSError /
    ssl.SSLError from reading the files propagate (a configuration error)."""
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
        return None
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
                return None  # it waits for this side's first frame: the certificate passed
            except ssl.SSLError as e:  # an alert, or the connection cut inside TLS
                return refused.format(e.reason or e)
            except OSError as e:
                return refused.format(f"the connection was reset: {e}")
            # an HTTP/2 server speaks first (its settings); a closed connection is a refusal
            return None if data else refused.format("it closed the connection after the handshake")
    except ssl.SSLCertVerificationError as e:
        return (f"this side does not trust the certificate of the coordinator at {address}: {e.verify_message} "
                f"(CA file {ca}; the coordinator's certificate must be signed by it, be valid now and "
                f"name {host!r})")
    except ssl.SSLError as e:
        return f"the TLS handshake with the coordinator at {address} failed: {e.reason or e}"
    except OSError:
        return None
    finally:
        raw.close()
