"""The averagers of a job satisfy the engine's written contract (``diloco.engine.averaging``): the
striped averager, the quorum averager and ``diloco.connect``'s connection declare the capabilities
the engine uses, and the connection forwards what its quorum averager declares."""

from types import SimpleNamespace

import torch

import compress
from diloco.engine.averaging import (
    Capabilities,
    CodecSwitching,
    ErrorFed,
    Gathered,
    Healing,
    Observing,
    Refusable,
    Screening,
    Shared,
    ShardExchanging,
    Weighted,
)
from diloco.exchange.quorum_averager import QuorumAverager
from diloco.exchange.quorum_pending import QuorumPending
from diloco.exchange.striped import StripedAverager, _StripedPending
from diloco.runtime.rank.connection import GroupConnection

_BASE = ("num_groups", "group_index", "start", "all_reduce_mean")


def _ring(groups: int = 2) -> SimpleNamespace:
    return SimpleNamespace(groups=list(range(groups)), ring_order=list(range(groups)), ranks=lambda g: [f"addr{g}"])


def test_the_striped_averager_exchanges_shards_feeds_errors_back_and_switches_codecs():
    avg = StripedAverager(SimpleNamespace(), _ring(), group=1, rank=0, codec=compress.get_codec("sign1"))
    assert all(hasattr(avg, m) for m in _BASE) and (avg.num_groups, avg.group_index) == (2, 1)
    assert isinstance(avg, ShardExchanging) and isinstance(avg, ErrorFed) and isinstance(avg, CodecSwitching)
    assert not isinstance(avg, Weighted) and not isinstance(avg, Healing)
    assert Capabilities.of(avg) == Capabilities(exchanges_shards=True, error_feedback=True, writes_into=True)
    avg.set_codec(compress.get_codec("int8"))
    assert Capabilities.of(avg) == Capabilities(exchanges_shards=True, writes_into=True)
    assert isinstance(_StripedPending(avg, torch.zeros(1), None, 0, [], "cpu"), Gathered)  # says what was decoded


def test_the_quorum_averager_also_weighs_screens_and_heals():
    for member in ("weighted", "screens_contributions", "attach", "heal"):
        assert hasattr(QuorumAverager, member), member
    assert issubclass(QuorumAverager, StripedAverager)
    assert QuorumAverager.weighted and QuorumAverager.screens_contributions


def test_a_quorum_pending_result_says_refusal_share_and_what_was_decoded():
    pending = object.__new__(QuorumPending)
    pending.own_rejected, pending.own_share, pending.sent = False, 0.5, torch.zeros(1)
    assert isinstance(pending, Refusable) and isinstance(pending, Shared) and isinstance(pending, Gathered)


def test_the_connection_forwards_every_capability_of_its_averager():
    codec = compress.get_codec("sign1")
    quorum = SimpleNamespace(num_groups=3, group_index=2, error_feedback=True, writes_into=True, codec=codec,
                             set_codec=lambda c: None)
    link = GroupConnection(transport=None, client=None, membership=None, averager=quorum, reprobe=None,
                           metrics=None, group=2, rank=0, group_size=1)
    assert all(hasattr(link, m) for m in _BASE) and (link.num_groups, link.group_index) == (3, 2)
    for capability in (Weighted, Screening, ShardExchanging, ErrorFed, CodecSwitching, Healing, Observing):
        assert isinstance(link, capability), capability.__name__
    assert Capabilities.of(link) == Capabilities(True, True, True, True, writes_into=True)
    assert link.codec is codec
