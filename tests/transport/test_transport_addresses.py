"""transport/addresses.py: the address helpers both link types use, and grpclink free of tcp."""

import sys
from pathlib import Path

import pytest

from transport.addresses import check_plaintext, is_loopback, split_address
from transport.tls import TlsConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_layout import imports_of  # noqa: E402


def test_split_address_takes_bracketed_ipv6_and_refuses_a_missing_port():
    assert split_address("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert split_address("[::1]:7") == ("::1", 7)
    for bad in ("10.0.0.1", ":80", "host:http"):
        with pytest.raises(ValueError, match="want host:port"):
            split_address(bad)


def test_plain_text_is_refused_off_loopback_unless_asked_for():
    assert is_loopback("localhost") and is_loopback("127.0.0.2") and is_loopback("[::1]")
    assert not is_loopback("10.0.0.1") and not is_loopback("example.org")
    check_plaintext("gRPC", "127.0.0.1", None, allow_plaintext=False)
    check_plaintext("TCP", "10.0.0.1", None, allow_plaintext=True)
    check_plaintext("TCP", "10.0.0.1", TlsConfig("c.pem", "k.pem", "ca.pem"), allow_plaintext=False)
    with pytest.raises(ValueError, match="refusing plain-text gRPC on non-loopback host '10.0.0.1'"):
        check_plaintext("gRPC", "10.0.0.1", None, allow_plaintext=False)


def test_the_grpc_link_does_not_import_the_tcp_link():
    assert "transport.tcp" not in imports_of("transport.grpclink")
    assert "transport.addresses" in imports_of("transport.grpclink") & imports_of("transport.tcp")
