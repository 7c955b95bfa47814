"""The outer step range by range (``diloco.engine.streamed_outer``): the same bits whatever ranges
were stepped while the mean arrived, in which threads, or in attempts rolled back before."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

from diloco import DiLoCo
from diloco.engine.averaging import Done, InProcessGroups
from compress.fingerprint_parts import rows_part
from diloco.engine.outer_state import params_hash
from diloco.engine.streamed_outer import StreamedOuter, sgd_range, streamable

RULES = {
    "nesterov": dict(lr=0.7, momentum=0.9, nesterov=True),
    "momentum": dict(lr=0.5, momentum=0.8),
    "sgd": dict(lr=1.0),
}


def _params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in [(7, 13), (1,), (300,), (2, 3, 5)]]


def _cuts(n: int, gen: torch.Generator) -> list[tuple[int, int]]:
    edges = sorted({0, n, *torch.randint(0, n, (9,), generator=gen).tolist()})
    return list(zip(edges, edges[1:]))


@pytest.mark.parametrize("rule", RULES)
def test_streamed_ranges_give_the_bits_of_one_whole_step(rule: str) -> None:
    """Three rounds: each steps random ranges from two threads, a rolled-back attempt's garbage
    first; the result equals stepping the whole mean at the commit, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    streamed, whole = _params(0), _params(0)
    a = StreamedOuter(streamed, torch.optim.SGD(streamed, **RULES[rule]))
    b = StreamedOuter(whole, torch.optim.SGD(whole, **RULES[rule]))
    n = a.numel
    for _ in range(3):
        mean = torch.randn(n, generator=gen)
        a.begin()
        garbage = torch.full((n,), 1e6)
        for lo, hi in _cuts(n, gen):
            a.on_final(1, garbage, lo, hi)  # attempt 1, rolled back
        cuts = _cuts(n, gen)[:-1]  # attempt 2 reports all but its last range (another rank's stripe)
        threads = [threading.Thread(target=lambda part=part: [a.on_final(2, mean, lo, hi) for lo, hi in part])
                   for part in (cuts[0::2], cuts[1::2])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        a.commit(mean, 2)
        b.commit(mean, None)
        for x, y in zip(streamed, whole):
            assert torch.equal(x, y)
    assert all(torch.equal(a.optimizer.state[x].get("momentum_buffer", torch.zeros(1)),
                           b.optimizer.state[y].get("momentum_buffer", torch.zeros(1))) for x, y in zip(streamed, whole))


def test_one_step_is_torch_sgd_up_to_rounding_and_independent_of_the_cut() -> None:
    gen = torch.Generator().manual_seed(5)
    theta, buf, u = (torch.randn(10_003, generator=gen) for _ in range(3))
    whole_theta, whole_buf = torch.empty_like(theta), torch.empty_like(buf)
    sgd_range(theta, buf, u, lr=0.7, momentum=0.9, nesterov=True, theta_out=whole_theta, buf_out=whole_buf)
    pieces_theta, pieces_buf = torch.empty_like(theta), torch.empty_like(buf)
    for lo, hi in [(0, 1), (1, 17), (17, 5000), (5000, 10_003)]:  # odd cuts: vector tails in the middle
        sgd_range(theta[lo:hi], buf[lo:hi], u[lo:hi], lr=0.7, momentum=0.9, nesterov=True,
                  theta_out=pieces_theta[lo:hi], buf_out=pieces_buf[lo:hi])
    assert torch.equal(whole_theta, pieces_theta) and torch.equal(whole_buf, pieces_buf)
    ref = theta.clone().requires_grad_(False)
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    opt.state[ref]["momentum_buffer"] = buf.clone()
    ref.grad = u
    opt.step()
    torch.testing.assert_close(whole_theta, ref, rtol=0, atol=1e-6)


def test_only_sgd_without_extra_state_is_streamed() -> None:
    p = [torch.zeros(3, requires_grad=True)]
    assert streamable(torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True))
    assert not streamable(torch.optim.SGD(p, lr=0.7, momentum=0.9, dampening=0.1))
    assert not streamable(torch.optim.SGD(p, lr=0.7, weight_decay=0.01))
    assert not streamable(torch.optim.SGD(p, lr=0.7, maximize=True))
    assert not streamable(torch.optim.Adam(p, lr=1e-3))
    with pytest.raises(ValueError, match="SGD"):
        StreamedOuter(p, torch.optim.Adam(p, lr=1e-3))


class _Streaming:
    """One of InProcessGroups' members that reports the mean's final ranges as a ring would: a
    rolled-back attempt's garbage, then the committed attempt's ranges, some left unreported."""

    streams_final = True

    def __init__(self, member, seed: int) -> None:
        self.member, self.gen = member, torch.Generator().manual_seed(seed)
        self.reported = 0
        self.num_groups, self.group_index = member.num_groups, member.group_index

    def all_reduce_mean(self, flat, *, round):
        return self.member.all_reduce_mean(flat, round=round)

    def start(self, flat, *, tag, exact=False, on_final=None):
        mean = self.member.start(flat, tag=tag, exact=exact).wait()
        pending = Done(mean)
        if on_final is not None:
            n = mean.numel()
            for lo, hi in _cuts(n, self.gen):
                on_final(1, torch.full_like(mean, float("nan")), lo, hi)
            for lo, hi in _cuts(n, self.gen)[1:]:
                on_final(2, mean, lo, hi)
                self.reported += hi - lo
            pending.final_attempt = 2
        return pending


def _train(averagers, mode: str, fragments=None, after_step=None) -> list[list[torch.Tensor]]:
    results = [None] * len(averagers)
    models = []
    for _ in averagers:  # built here: torch's global generator is shared by the threads
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)))

    def run(i: int) -> None:
        model = models[i]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + i)
        with DiLoCo(model, opt, averager=averagers[i], sync_every=3, mode=mode, fragments=fragments) as engine:
            for _ in range(12):
                x = torch.randn(8, 6, generator=gen)
                nn.functional.mse_loss(model(x), x[:, :2]).backward()
                opt.step()
                opt.zero_grad()
                engine.step()
                if after_step is not None:
                    after_step(engine)
        results[i] = [p.detach().clone() for p in model.parameters()]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(averagers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("mode", ["blocking", "overlap"])
def test_an_engine_fed_final_ranges_ends_where_one_that_was_not_does(mode: str) -> None:
    groups = InProcessGroups(2)
    plain = _train([groups.member(i) for i in range(2)], mode)
    again = InProcessGroups(2)
    wrapped = [_Streaming(again.member(i), seed=i) for i in range(2)]
    streamed = _train(wrapped, mode)
    assert all(w.reported > 0 for w in wrapped)
    for a, b in zip(plain, streamed):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for x, y in zip(*streamed):
        assert torch.equal(x, y)


def _wide(seed: int) -> list[torch.Tensor]:
    """Parameters over a dozen 1,024-value rows of the fingerprint, with lengths that cut rows."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in [(70, 130), (1,), (3000,), (2, 3, 5)]]


def _rows_part_now(params: list[torch.Tensor], offset: int) -> int:
    at, pieces = offset, []
    for p in params:
        pieces.append((p, at))
        at += p.numel()
    return rows_part(pieces)


@pytest.mark.parametrize("rule", RULES)
def test_the_hash_folded_into_the_step_is_the_hash_of_the_values(rule: str) -> None:
    """The parts each range adds as it is stepped (in the rings' stepping thread or at the commit)
    sum to the committed values' hash part at the fragment's offset, however the mean was cut, and
    with no range streamed; a write to the global copy since, or a moved offset, voids the fold."""
    gen = torch.Generator().manual_seed(5)
    params = _wide(0)
    s = StreamedOuter(params, torch.optim.SGD(params, **RULES[rule]), offset=5_000)  # not on a row's start
    n = s.numel
    for streamed in (True, False, True, True):
        mean = torch.randn(n, generator=gen)
        s.begin()
        if streamed:
            for lo, hi in _cuts(n, gen):
                s.on_final(1, torch.full((n,), 1e6), lo, hi)  # rolled back
            for lo, hi in _cuts(n, gen)[:-1]:
                s.on_final(2, mean, lo, hi)
        s.commit(mean, 2 if streamed else None)
        assert s.folded_part() == _rows_part_now(params, 5_000)
    s.offset = 0
    assert s.folded_part() is None
    s.offset = 5_000
    assert s.folded_part() is not None
    params[2][7] = 0.5  # any in-place write
    assert s.folded_part() is None


def test_overlapping_ranges_leave_no_fold_but_the_right_values() -> None:
    params, twin = _wide(1), _wide(1)
    s = StreamedOuter(params, torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True))
    t = StreamedOuter(twin, torch.optim.SGD(twin, lr=0.7, momentum=0.9, nesterov=True))
    mean = torch.randn(s.numel, generator=torch.Generator().manual_seed(6))
    s.begin()
    for lo, hi in [(0, 4000), (3000, 9000)]:
        s.on_final(1, mean, lo, hi)
    s.commit(mean, 1)
    t.commit(mean, None)
    assert all(torch.equal(a, b) for a, b in zip(params, twin))
    assert s.folded_part() is None and t.folded_part() == _rows_part_now(twin, 0)


@pytest.mark.parametrize("late", ["rolled-back range after the commit's", "inverted", "out of bounds"])
def test_ranges_out_of_turn_or_of_no_range_give_the_right_values_and_hash(late: str) -> None:
    """Outside the rings' rules (an attempt reports all its ranges before the next one's), or not a
    range of the fragment: the values are still one whole step's and the hash theirs."""
    params, twin = _wide(2), _wide(2)
    s = StreamedOuter(params, torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True), offset=300)
    t = StreamedOuter(twin, torch.optim.SGD(twin, lr=0.7, momentum=0.9, nesterov=True), offset=300)
    n = s.numel
    mean = torch.randn(n, generator=torch.Generator().manual_seed(7))
    s.begin()
    s.on_final(2, mean, 0, 5000)
    if late == "rolled-back range after the commit's":
        s.on_final(1, torch.full((n,), 1e6), 2000, 3000)
    elif late == "inverted":
        s.on_final(2, mean, 6000, 5500)
    else:
        s.on_final(2, torch.full((n + 10,), 1e6), n - 5, n + 10)
    s.on_final(2, mean, 5000, 9000)
    s.commit(mean, 2)
    t.commit(mean, None)
    assert all(torch.equal(a, b) for a, b in zip(params, twin))
    assert s.folded_part() == _rows_part_now(params, 300)


def test_a_step_by_torchs_own_rule_voids_the_fold() -> None:
    """A rule the engine does not stream (here: weight decay set in a loaded state) steps through
    torch.optim, fused on the host, which bumps no tensor version: the fold is dropped anyway."""
    from diloco.engine.outer_state import OuterFragment

    gen = torch.Generator().manual_seed(8)
    local = [torch.randn(50, 30, generator=gen), torch.randn(700, generator=gen)]
    frag = OuterFragment(["a", "b"], local, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9,
                                                                                         fused=True))
    frag.outer_step(torch.randn(frag.local_numel, generator=gen))
    assert frag.streamed.folded_part() == frag.hash_part() == _rows_part_now(frag.global_params, 0)
    frag.optimizer.param_groups[0]["weight_decay"] = 0.1
    frag.outer_step(torch.randn(frag.local_numel, generator=gen))
    assert frag.streamed.folded_part() is None
    assert frag.hash_part() == _rows_part_now(frag.global_params, 0)
    frag.optimizer.param_groups[0]["weight_decay"] = 0.0
    frag.place_in_hash(0, fold=False)  # a sharded engine hashes its own way: no part taken in the pass
    frag.outer_step(torch.randn(frag.local_numel, generator=gen))
    assert frag.streamed.folded_part() is None


@pytest.mark.parametrize("fragments", [None, [["0.weight", "0.bias"], ["2.weight", "2.bias"]]])
def test_an_engines_hash_from_folded_parts_is_the_hash_of_its_global_copy(fragments) -> None:
    """After every inner step of a streamed blocking run (one fragment, or two that sync in turn)
    the engine's state hash equals ``params_hash`` of its global parameters, and after a sync the
    synced fragment's part came from the fold, not a second pass."""
    again = InProcessGroups(2)
    wrapped = [_Streaming(again.member(i), seed=i) for i in range(2)]
    seen, wrong = [], []

    def check(engine) -> None:  # in the groups' threads: what it finds is asserted after they end
        if engine.global_hash() != params_hash(engine.global_params):
            wrong.append(engine.inner_step)
        seen.append(sum(f.streamed.folded_part() is not None for f in engine.fragments))

    results = _train(wrapped, "blocking", fragments=fragments, after_step=check)
    assert all(r is not None for r in results) and len(seen) == 24
    assert wrong == [] and max(seen) >= 1 and all(w.reported > 0 for w in wrapped)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("first", [True, False])
def test_the_c_kernel_gives_the_torch_paths_bits(rule: str, first: bool, monkeypatch) -> None:
    import diloco.engine.streamed_outer as so

    if so._KERNEL is None:
        pytest.skip("compress/_native.c is not built here (pip install -e . builds it)")
    gen = torch.Generator().manual_seed(9)
    n = 100_003
    theta, buf, u = (torch.randn(n, generator=gen) * 3 for _ in range(3))
    kw = RULES[rule]
    mu = kw.get("momentum", 0.0)
    outs = []
    for use in (True, False):
        monkeypatch.setattr(so, "USE_KERNEL", use)
        t_out, b_out = torch.empty(n), torch.empty(n) if mu else None
        sgd_range(theta, None if first or not mu else buf, u, lr=kw["lr"], momentum=mu,
                  nesterov=kw.get("nesterov", False), theta_out=t_out, buf_out=b_out)
        outs.append((t_out, b_out))
    assert torch.equal(outs[0][0], outs[1][0])
    if mu:
        assert torch.equal(outs[0][1], outs[1][1])
    with pytest.raises(ValueError, match="equal lengths"):
        sgd_range(theta, buf, u[:-1], lr=0.7, momentum=0.9, nesterov=True, theta_out=torch.empty(n),
                  buf_out=torch.empty(n))


def test_a_commit_with_nothing_streamed_steps_in_place_and_keeps_no_scratch() -> None:
    params = _params(1)
    s = StreamedOuter(params, torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True))
    storage = [p.data_ptr() for p in params]
    mean = torch.randn(s.numel, generator=torch.Generator().manual_seed(2))
    s.begin()
    s.commit(mean, None)
    assert s._theta is None and s._buf is None  # no copies of the fragment held
    assert [p.data_ptr() for p in params] == storage
    s.begin()
    s.stop()  # abandoned: a ring still reporting is not taken
    s.on_final(1, mean, 0, s.numel)
    assert s._worker is None and s._theta is None


def test_settings_a_loaded_state_changes_are_followed() -> None:
    """The optimizer's settings are read at every step: a state loaded with momentum where there was
    none starts its buffer; one with weight decay steps through torch's own rule."""
    from diloco.engine.outer_state import OuterFragment

    gen = torch.Generator().manual_seed(4)
    local = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    frag = OuterFragment(["a", "b"], local, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
    twin = [g.detach().clone() for g in frag.global_params]
    twin_opt = torch.optim.SGD(twin, lr=1.0)
    for settings in ({"momentum": 0.9, "nesterov": True}, {"momentum": 0.9, "weight_decay": 0.1}):
        for opt in (frag.optimizer, twin_opt):
            state = opt.state_dict()
            state["param_groups"][0].update(settings)
            opt.load_state_dict(state)
        mean = torch.randn(frag.local_numel, generator=gen)
        frag.outer_step(mean)
        offset = 0
        for t in twin:
            t.grad = mean[offset:offset + t.numel()].view_as(t)
            offset += t.numel()
        twin_opt.step()
        for g, t in zip(frag.global_params, twin):
            torch.testing.assert_close(g, t, rtol=0, atol=1e-6)
    assert not frag.feeds_ranges  # weight decay: nothing is stepped as it arrives
