"""The engine's contract with its averager is written down (``diloco.engine.averaging``): an averager
with exactly ``Averager``'s members runs every mode, and the engine reads no member of an averager
that the Protocol or a declared capability does not name."""

import pytest
import torch
import torch.nn as nn

import compress
from diloco.engine.averaging import (
    Capabilities,
    CodecSwitching,
    Done,
    ErrorFed,
    Healing,
    InProcessGroups,
    Observing,
    SingleGroup,
    Weighted,
)
from diloco.engine.diloco import MODES, DiLoCo
from diloco.engine.schedule import FixedSchedule

#: every member ``Averager`` and its capabilities name
DECLARED = {"num_groups", "group_index", "start", "all_reduce_mean", "weighted", "screens_contributions",
            "exchanges_shards", "error_feedback", "streams_final", "writes_into", "codec", "set_codec", "attach", "heal",
            "observe"}


class Minimal:
    """Exactly ``Averager``: one group, nothing optional."""

    num_groups, group_index = 1, 0

    def start(self, flat: torch.Tensor, *, tag: str, exact: bool = False) -> Done:
        return Done(flat.detach().clone())

    def all_reduce_mean(self, flat: torch.Tensor, *, round: int) -> torch.Tensor:
        return flat.detach().clone()


class Recording:
    """Forwards every member to ``inner`` and records the names read."""

    def __init__(self, inner) -> None:
        self.__dict__["_inner"], self.__dict__["read"] = inner, set()

    def __getattr__(self, name: str):
        self.read.add(name)
        return getattr(self._inner, name)


def _train(averager, steps: int = 14, **kw) -> DiLoCo:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = DiLoCo(model, inner, averager=averager, fragments=[["0.weight", "0.bias"], ["2.weight", "2.bias"]], **kw)
    for s in range(steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(s))
        model(x).square().mean().backward()
        inner.step()
        inner.zero_grad()
        engine.step()
    engine.close()
    return engine


@pytest.mark.parametrize("mode", MODES)
def test_an_averager_with_only_the_protocols_members_runs_every_mode(mode):
    """Bit for bit what the engine computes with ``SingleGroup``, which declares shard exchanges."""
    minimal = _train(Minimal(), mode=mode, sync_every=4)
    single = _train(SingleGroup(), mode=mode, sync_every=4)
    assert minimal.round == single.round > 2 and minimal.global_hash() == single.global_hash()
    assert Capabilities.of(Minimal()) == Capabilities()


@pytest.mark.parametrize("mode", MODES)
def test_the_engine_reads_only_declared_members(mode):
    averager = Recording(InProcessGroups(1, weighted=True).member(0))
    _train(averager, mode=mode, sync_every=4)
    assert {"start", "weighted"} <= averager.read <= DECLARED, averager.read - DECLARED


def test_error_feedback_and_a_final_codec_read_only_declared_members():
    averager = Recording(InProcessGroups(1, codec=compress.get_codec("sign1")).member(0))
    engine = _train(averager, mode="overlap", sync_every=FixedSchedule(4, total_steps=12),
                    final_codec=compress.get_codec("int8"))
    assert {"error_feedback", "codec", "set_codec"} <= averager.read <= DECLARED, averager.read - DECLARED
    assert averager.codec.name == "int8" and engine.error_feedback is None  # the last exchange flushed them


def test_in_process_averagers_declare_what_they_take():
    member = InProcessGroups(2, weighted=True, codec=compress.get_codec("sign1")).member(0)
    assert isinstance(member, Weighted) and isinstance(member, ErrorFed) and isinstance(member, CodecSwitching)
    assert Capabilities.of(member) == Capabilities(weighted=True, error_feedback=True)
    assert Capabilities.of(SingleGroup()) == Capabilities(exchanges_shards=True)
    assert not isinstance(SingleGroup(), Healing) and not isinstance(SingleGroup(), Observing)


class WritingInto(Minimal):
    """Declares ``WritesInto``: the mean in the caller's ``out``, except at the exchanges in ``own``
    (as after a retry: a vector of its own, and ``out`` possibly still written by the abandoned attempt)."""

    writes_into = True

    def __init__(self, own: set[int]) -> None:
        self.outs: list[torch.Tensor | None] = []
        self.own = own

    def start(self, flat: torch.Tensor, *, tag: str, exact: bool = False, out: torch.Tensor | None = None) -> Done:
        if exact:  # eager's reconciliation of the global copies: a control exchange, no out
            assert out is None
            return Done(flat.detach().clone())
        self.outs.append(out)
        if out is None or len(self.outs) - 1 in self.own:
            return Done(flat.detach().clone())
        return Done(out.copy_(flat))


@pytest.mark.parametrize("mode", MODES)
def test_the_mean_comes_back_in_a_vector_the_engine_keeps_and_a_retry_s_own_vector_drops_it(mode):
    averager = WritingInto(own={2})
    engine = _train(averager, mode=mode, sync_every=4, steps=24)
    assert engine.global_hash() == _train(SingleGroup(), mode=mode, sync_every=4, steps=24).global_hash()
    # two fragments, exchanges in turn: fragment 0 launches exchanges 0, 2, 4 ...; its third (exchange 2)
    # came back in the averager's own vector, so its next launch writes into a new one, kept from then on
    mine = [o for o in averager.outs if o is not None]
    assert len(mine) == len(averager.outs) > 6  # every launch
    f0 = mine[0::2]
    assert f0[0] is f0[1] and f0[2] is not f0[1] and all(o is f0[2] for o in f0[3:])
    assert all(o is mine[1] for o in mine[1::2])


def test_a_loaded_state_takes_new_vectors():
    # an exchange a load replaces without waiting for it may still read the kept Δ and write the kept mean
    averager = WritingInto(own=set())
    engine = _train(averager, mode="overlap", sync_every=4, steps=12)
    kept = averager.outs[-1]
    engine.load_state_dict(engine.state_dict())
    assert all(f._delta is None and f._mean is None for f in engine.fragments)
    assert engine.fragments[0].mean_buffer() is not kept
