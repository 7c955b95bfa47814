"""The sync modes as strategies (``diloco.engine.sync_modes``), each against a scripted engine
(``Host``): when an exchange lands, what its outer step applies, and what each mode refuses."""

import pytest
import torch
import torch.nn as nn

from diloco.engine.averaging import Done
from diloco.engine.fragment import Fragment
from diloco.engine.modes import MODE_DEFAULTS, MODE_TRAITS, MODES, modes_where
from diloco.engine.outer import sgd
from diloco.engine.sync_modes import MODE_CLASSES, Blocking, Delayed, Eager, Overlap, choose


class _Shared:
    """A pending mean that says this group's share of it."""

    def __init__(self, value: torch.Tensor, share: float | None) -> None:
        self.value, self.own_share = value, share

    def wait(self) -> torch.Tensor:
        return self.value


class _Host:
    """Records what a mode asks of its engine: ``applied`` holds (round, update) of each outer step."""

    def __init__(self, delta: torch.Tensor, num_groups: int = 2) -> None:
        self.inner_step, self.delta = 0, delta
        self.averager = type("A", (), {"num_groups": num_groups, "group_index": 0})()
        self.applied: list[tuple[int, list[float] | None]] = []

    def _delta(self, frag):
        return self.delta.clone()

    def _land(self, frag):
        return frag.land()

    def _apply(self, frag, update, round, attempt=None):
        self.applied.append((round, None if update is None else update.tolist()))
        return ("commit", round)

    def _reset_local(self, frag):
        raise AssertionError("nothing was refused")

    def _event(self, frag, round, kind, **extra):
        return (kind, round)

    def _norm(self, flat):
        return float(flat.norm())

    def _shards(self, frag):
        return {}


def _fragment(values=(0.0, 0.0)) -> Fragment:
    param = nn.Parameter(torch.tensor(values))
    return Fragment(0, ["w"], [param], outer_optimizer=sgd(1.0, 0.0), device=None)


def _launch(mode, frag, host, mean):
    """What the engine does at a launch: the mode's first part, the exchange, its second part."""
    events, delta = mode.before_launch(frag)
    frag.launched(mean, host.inner_step, host.inner_step + mode.tau)
    return events + mode.after_launch(frag), delta


def test_every_mode_has_a_strategy():
    assert tuple(MODE_CLASSES) == MODES


def test_the_traits_say_what_each_mode_allows():
    # what the configuration's checks, the engine and the outer rule's defaults read (diloco/engine/modes.py)
    assert modes_where("time_rounds") == ("blocking", "overlap") and modes_where("round_grid") == ("overlap",)
    assert modes_where("error_feedback") == modes_where("final_codec") == ("blocking", "overlap", "delayed", "co2")
    assert modes_where("takes_tau") == ("overlap",) and modes_where("streams") == ("blocking", "overlap")
    assert MODE_DEFAULTS == {"blocking": (0.7, 0.9), "overlap": (0.7, 0.9), "eager": (0.7, 0.5), "delayed": (0.7, 0.0)}
    with pytest.raises(ValueError, match="unknown mode trait 'summary'"):
        modes_where("summary")


@pytest.mark.parametrize("mode, tau, alpha", [("blocking", 0, 0.0), ("overlap", 1, 0.5), ("eager", 0, 0.0),
                                              ("delayed", 0, 0.0), ("co2", 0, 0.0)])
def test_each_mode_has_its_defaults(mode, tau, alpha):
    cls, traits, got_tau, got_alpha = choose(mode, None, None, error_feedback=False)
    assert cls is MODE_CLASSES[mode] and traits is MODE_TRAITS[mode] and (got_tau, got_alpha) == (tau, alpha)


@pytest.mark.parametrize("mode, kw, message", [
    ("sync", {}, "unknown mode 'sync'"),
    ("delayed", {"overlap_steps": 2}, "overlap_steps applies to mode overlap only, not 'delayed'"),
    ("overlap", {"overlap_steps": -1}, "overlap_steps must be >= 0"),
    ("blocking", {"merge_alpha": 1.5}, r"merge_alpha must be in \[0, 1\]"),
    ("eager", {"error_feedback": True}, "mode 'eager' cannot use a codec that needs error feedback"),
])
def test_each_mode_refuses_what_it_cannot_run(mode, kw, message):
    with pytest.raises(ValueError, match=message):
        choose(mode, kw.get("overlap_steps"), kw.get("merge_alpha"), error_feedback=kw.get("error_feedback", False))


def test_blocking_commits_the_mean_at_its_launch():
    host, frag = _Host(torch.tensor([1.0, 2.0])), _fragment()
    mode = Blocking(host, 0, MODE_TRAITS["blocking"])
    events, delta = _launch(mode, frag, host, Done(torch.tensor([3.0, 4.0])))
    assert events == [("commit", 0)] and host.applied == [(0, [3.0, 4.0])] and frag.in_flight is None
    assert delta.tolist() == [1.0, 2.0]


def test_overlap_lands_tau_steps_after_its_launch():
    host, frag = _Host(torch.tensor([1.0, 2.0])), _fragment()
    mode = Overlap(host, 2, MODE_TRAITS["overlap"])
    host.inner_step = 10
    assert _launch(mode, frag, host, Done(torch.tensor([3.0, 4.0])))[0] == [] and frag.in_flight is not None
    host.inner_step = 11
    assert mode.due(frag) == [] and host.applied == []
    host.inner_step = 12
    assert mode.due(frag) == [("commit", 0)] and host.applied == [(0, [3.0, 4.0])] and frag.in_flight is None


def test_overlap_lands_the_previous_exchange_first_when_the_next_launch_comes_before_tau():
    host, frag = _Host(torch.tensor([1.0, 2.0])), _fragment()
    mode = Overlap(host, 5, MODE_TRAITS["overlap"])
    _launch(mode, frag, host, Done(torch.tensor([3.0, 4.0])))
    events, _ = _launch(mode, frag, host, Done(torch.tensor([5.0, 6.0])))
    assert events == [("commit", 0)] and frag.in_flight.round == 1
    assert mode.close(frag) == [("commit", 1)] and host.applied == [(0, [3.0, 4.0]), (1, [5.0, 6.0])]


def test_delayed_applies_the_previous_rounds_mean_at_the_next_launch():
    host, frag = _Host(torch.tensor([1.0, 2.0])), _fragment()
    mode = Delayed(host, 0, MODE_TRAITS["delayed"])
    assert _launch(mode, frag, host, Done(torch.tensor([3.0, 4.0])))[0] == [("commit", 0)]
    assert host.applied == [(0, None)]  # round 0: no mean yet, no outer step
    _launch(mode, frag, host, Done(torch.tensor([5.0, 6.0])))
    assert host.applied[1] == (1, [3.0, 4.0])
    assert mode.close(frag) == [("commit", 1)]  # close: the last mean's outer step (sgd, lr 1)
    assert frag.global_params[0].tolist() == [-5.0, -6.0]


@pytest.mark.parametrize("share, expected", [(None, [(2.0 + 2 * 3.0 - 1.0) / 2] * 2),  # (Δ + M·mean − Δ_prev) / M
                                             (0.25, [3.0 + 0.25 * (2.0 - 1.0)] * 2),  # mean + s·(Δ − Δ_prev)
                                             (0.0, [3.0, 3.0])])  # refused or healing: the mean as it is
def test_eager_replaces_its_own_share_of_the_previous_mean_by_its_fresh_delta(share, expected):
    host, frag = _Host(torch.tensor([1.0, 1.0])), _fragment()
    mode = Eager(host, 0, MODE_TRAITS["eager"])
    _launch(mode, frag, host, _Shared(torch.tensor([3.0, 3.0]), share))
    assert host.applied == [(0, [0.5, 0.5])]  # round 0: Δ / M
    host.delta = torch.tensor([2.0, 2.0])
    _launch(mode, frag, host, Done(torch.tensor([0.0, 0.0])))
    assert host.applied[1] == (1, expected)
    assert mode.close(frag) == [] and frag.in_flight is None  # its share went into the last launch


def test_eager_reconciles_the_global_copies_at_the_end():
    host, frag = _Host(torch.tensor([1.0, 1.0])), _fragment((2.0, 4.0))
    host.averager.start = lambda flat, *, tag, exact: Done(flat / 2)  # the other group holds zeros
    Eager(host, 0, MODE_TRAITS["eager"]).finish([frag])
    assert frag.global_params[0].tolist() == [1.0, 2.0]


class _Refused(_Shared):
    """A pending mean whose quorum refused this group's contribution (its share 0)."""

    own_rejected = True

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__(value, 0.0)


def test_a_checkpoint_taken_while_an_exchange_is_in_flight_keeps_what_the_quorum_said(tmp_path):
    """``sync_state`` waits for the exchange in flight and keeps its mean; whether its quorum refused
    this group and this group's share must survive too, in the live fragment and through the file,
    or the landing after a checkpoint skips the reset a refusal asks for (and eager uses 1/M)."""
    host, frag = _Host(torch.tensor([1.0, 2.0])), _fragment()
    mode = Overlap(host, 5, MODE_TRAITS["overlap"])
    _launch(mode, frag, host, _Refused(torch.tensor([3.0, 4.0])))
    saved = frag.sync_state()
    assert (saved["in_flight"]["own_rejected"], saved["in_flight"]["own_share"]) == (True, 0.0)
    torch.save(saved, tmp_path / "frag.pt")
    restored = _fragment()
    restored.load_sync_state(torch.load(tmp_path / "frag.pt", weights_only=True))
    for f in (frag, restored):
        resets = []
        host._reset_local = resets.append
        assert mode.commit(f) == ("commit", 0) and resets == [f], "a refused contribution was not reset after the cut"
    eager_host, eager_frag = _Host(torch.tensor([1.0, 1.0])), _fragment()
    eager = Eager(eager_host, 0, MODE_TRAITS["eager"])
    _launch(eager, eager_frag, eager_host, _Shared(torch.tensor([3.0, 3.0]), 0.25))
    eager_frag.load_sync_state(eager_frag.sync_state())
    eager_host.delta = torch.tensor([2.0, 2.0])
    _launch(eager, eager_frag, eager_host, Done(torch.tensor([0.0, 0.0])))
    assert eager_host.applied[1] == (1, [3.0 + 0.25 * (2.0 - 1.0)] * 2)  # the share, not 1/M
