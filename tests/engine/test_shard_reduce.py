"""The numbers a sharded engine computes from pieces: the same whatever the cut and the order."""

from __future__ import annotations

import math
import random

import pytest
import torch

from compress.fingerprint import fingerprint
from compress.fingerprint_parts import finish, rows_part
from diloco.engine.outer import co2
from diloco.engine.shard_layout import ShardLayout
from diloco.engine.shard_reduce import exact_sum_of_squares, group_fingerprint


def test_fingerprint_of_pieces_equals_the_whole_in_any_cut_and_order():
    torch.manual_seed(0)
    tensors = [torch.randn(37, 29), torch.randn(1000), torch.randn(3, 2048)]
    whole = fingerprint(tensors)
    pieces, offset = [], 0
    rng = random.Random(1)
    for t in tensors:
        flat = t.reshape(-1)
        cuts = sorted({0, flat.numel(), *(rng.randrange(flat.numel()) for _ in range(4))})
        pieces += [(flat[a:b], offset + a) for a, b in zip(cuts, cuts[1:])]
        offset += flat.numel()
    rng.shuffle(pieces)
    lengths = [t.numel() for t in tensors]
    assert finish(sum(rows_part([p]) for p in pieces), lengths) == whole
    assert finish(sum(rows_part([p], native=False) for p in pieces), lengths) == whole
    assert group_fingerprint(pieces, lengths, None) == whole
    flipped = [(pieces[0][0].clone().add_(1.0), pieces[0][1])] + pieces[1:]
    assert group_fingerprint(flipped, lengths, None) != whole
    with pytest.raises(ValueError, match="offset"):
        rows_part([(tensors[0], -1)])


def test_exact_sum_of_squares_is_correctly_rounded_and_cut_independent():
    torch.manual_seed(0)
    x = torch.randn(50_001) * torch.logspace(-30, 30, 50_001)
    x[7] = 1e-42  # subnormal
    exact = math.fsum(v * v for v in x.double().tolist())
    assert exact_sum_of_squares([x]) == exact
    assert exact_sum_of_squares([x[:123], x[123:40_000], x[40_000:]]) == exact
    assert exact_sum_of_squares([x.flip(0)]) == exact
    assert exact_sum_of_squares([torch.zeros(0), torch.zeros(3)]) == 0.0
    assert math.isnan(exact_sum_of_squares([torch.tensor([1.0, float("inf")])]))


def test_co2_with_exact_norms_steps_the_same_on_any_cut():
    """CO2's penalty needs the whole fragment's norms: with exactly rounded sums of squares the
    step on shards equals the step on the whole vector, bit for bit."""
    torch.manual_seed(3)
    whole = torch.randn(1000)
    grads = [torch.randn(1000) * 0.1 for _ in range(3)]
    cut = [0, 137, 600, 1000]

    def run(parts_of):
        params = [p.clone() for p in parts_of(whole)]
        opt = co2(momentum=0.5)(params)
        opt.sum_squares = lambda ts: exact_sum_of_squares(ts)  # one process holds every part here
        for g in grads:
            for p, gp in zip(params, parts_of(g)):
                p.grad = gp.clone()
            opt.step()
        return torch.cat(params)

    one = run(lambda t: [t])
    three = run(lambda t: [t[a:b] for a, b in zip(cut, cut[1:])])
    assert torch.equal(one, three)


def test_layout_pieces_and_counts():
    layout = ShardLayout(((5, 4), (3, 1)), 4, 2)
    assert layout.numel == 23 and layout.offsets() == [0, 20]
    assert layout.pieces() == [(16, 20), (22, 23)]  # rows 4..4 of the first, row 2 of the second
    assert layout.pieces(size=2, rank=1) == [(12, 20), (22, 23)]
    assert layout.local_numel(size=4, rank=3) == 0
    with pytest.raises(ValueError, match=">= 0"):
        ShardLayout(((-1, 2),), 1, 0)
