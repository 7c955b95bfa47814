"""The link family's spec: link types by name, one set of keywords every link takes, build()."""

import inspect
from dataclasses import fields

import pytest

from transport.core import TransportBase
from transport.link_spec import LINKS, LinkSpec, link_class, link_names

SECRET = b"k" * 32


def test_every_link_type_is_a_transport_and_takes_the_specs_keywords():
    assert link_names() == ("tcp", "grpc")
    base = set(inspect.signature(TransportBase.__init__).parameters) - {"self", "secret", "shaper"}
    for name in LINKS:
        cls = link_class(name)
        assert issubclass(cls, TransportBase)
        own = set(inspect.signature(cls.__init__).parameters) - {"self", "options"}
        assert set(LinkSpec().keywords()) == base | own, name


def test_an_unknown_link_or_data_plane_is_named_with_the_known_ones():
    assert LinkSpec(link="udp", data_plane="fork", threads=0).problems() == [
        "unknown link 'udp': tcp or grpc", "unknown data plane 'fork': thread or process", "threads must be >= 1, got 0"]
    with pytest.raises(ValueError, match="unknown link 'udp': tcp or grpc"):
        LinkSpec(link="udp").build(SECRET)
    with pytest.raises(ValueError, match="unknown link 'udp': tcp or grpc"):
        link_class("udp")


@pytest.mark.parametrize("link", ["tcp", "grpc"])
def test_build_listens_with_the_specs_settings(link):
    t = LinkSpec(link=link, chunk_bytes=1 << 16, connections_per_peer=2, timeout_s=5.0).build(SECRET)
    try:
        assert type(t) is link_class(link) and t.address.startswith("127.0.0.1:")
        assert (t.chunk_elems, t.timeout_s) == ((1 << 16) // 4, 5.0)
    finally:
        t.close()


def test_the_link_flags_choices_come_from_the_registry():
    from diloco.job.config import TransportConfig

    link = next(f for f in fields(TransportConfig) if f.name == "link")
    assert link.metadata["choices"] == link_names()
