"""The gather's reductions on hand-computed cases (transport.gather_reduce: pure, no sockets)."""

from __future__ import annotations

import math

import pytest
import torch

import compress
from transport.control import codec_from_spec, codec_spec
from transport.gather_reduce import (clip_to_median_norm, mean_over_all, mean_over_senders, median_norm,
                                     norms_in_fixed_order, reduce_gathered)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def senders(decoded, scales=None):
    return mean_over_senders(decoded, scales, torch.empty_like(decoded[0]))


def over_all(decoded, scales=None):
    return mean_over_all(decoded, scales, torch.empty_like(decoded[0]))


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def test_two_groups_overlapping_and_disjoint_indices() -> None:
    d = [t(1, 0, 2, 0, -4), t(3, 4, 0, 0, 2)]
    # index 0 and 4 sent by both, 1 and 2 by one each, 3 by none
    assert torch.equal(senders(d), t(2, 4, 2, 0, -1))
    assert torch.equal(over_all(d), t(2, 2, 1, 0, -1))


def test_three_groups_an_index_sent_by_one_group_only() -> None:
    d = [t(3, 0, 0, 1, 1), t(0, 0, 6, 1, 2), t(0, 0, 0, 4, 4)]
    assert torch.equal(senders(d), t(3, 0, 6, 2, torch.tensor(7.0).div(3).item()))
    assert torch.equal(over_all(d), t(1, 0, 2, 2, torch.tensor(7.0).div(3).item()))


def test_four_groups_disjoint_indices_keep_each_value_whole() -> None:
    d = [t(8, 0, 0, 0), t(0, -2, 0, 0), t(0, 0, 0.5, 0), t(0, 0, 0, 1)]
    assert torch.equal(senders(d), t(8, -2, 0.5, 1))
    assert torch.equal(over_all(d), t(2, -0.5, 0.125, 0.25))


def test_weights_divide_by_the_senders_weights_and_a_zero_weight_sends_nothing() -> None:
    d = [t(2, 4, 0), t(2, 0, 0), t(100, 100, 100)]
    out = senders(d, [0.5, 1.5, 0.0])
    assert torch.equal(out, t(2, 4, 0))  # (0.5*2 + 1.5*2) / 2, 0.5*4 / 0.5, none: 0
    assert torch.equal(over_all(d, [0.5, 1.5, 0.0]), t(4 / 3, 2 / 3, 0))


def test_matches_the_authors_scatter_reduce_mean() -> None:
    gen = torch.Generator().manual_seed(0)
    n, g, k = 512, 4, 40
    decoded, idx, val = [], [], []
    for _ in range(g):
        i = torch.randperm(n, generator=gen)[:k]
        v = torch.randn(k, generator=gen)
        d = torch.zeros(n)
        d[i] = v
        decoded.append(d)
        idx.append(i)
        val.append(v)
    theirs = torch.zeros(n).scatter_reduce_(0, torch.cat(idx), torch.cat(val), reduce="mean", include_self=False)
    torch.testing.assert_close(senders(decoded), theirs, rtol=1e-6, atol=0)
    assert not torch.allclose(over_all(decoded), theirs)  # the rules differ on these inputs


def test_inputs_unchanged_and_results_repeatable() -> None:
    gen = torch.Generator().manual_seed(1)
    d = [torch.randn(300, generator=gen) * (torch.rand(300, generator=gen) < 0.2) for _ in range(3)]
    before = [x.clone() for x in d]
    first = reduce_gathered(d, [0.5, 1.0, 2.0], torch.empty(300), compress.get_codec("topk", mean="senders",
                                                                                  clip_median=True))
    again = reduce_gathered(d, [0.5, 1.0, 2.0], torch.empty(300), compress.get_codec("topk", mean="senders",
                                                                                  clip_median=True))
    assert torch.equal(bits(first), bits(again))
    assert all(torch.equal(x, b) for x, b in zip(d, before))


def test_median_of_odd_and_even_counts() -> None:
    assert median_norm([5.0, 1.0, 10.0]) == 5.0
    assert median_norm([4.0, 1.0, 3.0, 2.0]) == 2.0  # the lower middle one, as torch.median
    assert median_norm([7.0]) == 7.0
    assert torch.median(torch.tensor([4.0, 1.0, 3.0, 2.0])).item() == 2.0


def test_clip_three_groups_scales_the_one_above_the_median() -> None:
    d = [t(3, 4), t(6, 8), t(0, 1)]  # norms 5, 10, 1: median 5
    clipped = clip_to_median_norm(d, None)
    assert torch.equal(clipped[1], t(3, 4))
    assert clipped[0] is d[0] and clipped[2] is d[2]


def test_clip_even_count_takes_the_lower_middle_norm() -> None:
    d = [t(1, 0), t(0, 2), t(3, 0), t(0, 4)]  # norms 1, 2, 3, 4: median 2
    clipped = clip_to_median_norm(d, None)
    assert [c.tolist() for c in clipped] == [[1, 0], [0, 2], [2, 0], [0, 2]]
    codec = compress.get_codec("topk", mean="senders", clip_median=True)
    assert torch.equal(reduce_gathered(d, None, torch.empty(2), codec), t(1.5, 2))  # (1+2)/2, (2+2)/2
    clip_all = compress.get_codec("topk", clip_median=True)
    assert torch.equal(reduce_gathered(d, None, torch.empty(2), clip_all), t(0.75, 1))  # 3/4, 4/4


def test_clip_two_groups_brings_the_larger_to_the_smaller() -> None:
    clipped = clip_to_median_norm([t(6, 8), t(0, 5)], None)  # norms 10, 5: median 5
    assert torch.equal(clipped[0], t(3, 4)) and torch.equal(clipped[1], t(0, 5))


def test_clip_factor_is_rounded_to_fp32_once() -> None:
    clipped = clip_to_median_norm([t(7), t(3), t(1)], None)  # median 3: 7 * fp32(3/7)
    factor = torch.tensor(3 / 7, dtype=torch.float32)
    assert torch.equal(clipped[0], t(7) * factor)


def test_clip_median_leaves_out_members_of_weight_zero() -> None:
    d = [t(3, 4), t(6, 8), t(0, 1000)]  # the last one's weight is 0: median of 5 and 10 is 5
    clipped = clip_to_median_norm(d, [1.0, 1.0, 0.0])
    assert torch.equal(clipped[1], t(3, 4)) and clipped[2] is d[2]


def test_norms_are_the_l2_norm_and_independent_of_threads() -> None:
    gen = torch.Generator().manual_seed(2)
    d = [torch.randn(100_003, generator=gen) * 10 ** i for i in range(3)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = norms_in_fixed_order(d)
        torch.set_num_threads(max(2, threads))
        many = norms_in_fixed_order(d)
    finally:
        torch.set_num_threads(threads)
    assert one == many
    for n, x in zip(one, d):
        assert math.isclose(n, math.sqrt(math.fsum(v * v for v in x.double().tolist())), rel_tol=1e-12)
    assert norms_in_fixed_order([t(3, 4, 0)]) == [5.0]
    with pytest.raises(ValueError, match="different lengths"):
        norms_in_fixed_order([t(1, 2), t(1)])


@pytest.mark.parametrize("clip", [False, True])
def test_nan_and_inf_pass_through_as_with_the_plain_mean(clip: bool) -> None:
    d = [t(1, float("nan"), 0, 2), t(3, 0, float("inf"), 0), t(0, 1, 1, 4)]
    plain = over_all(d)
    out = reduce_gathered(d, None, torch.empty(4), compress.get_codec("topk", mean="senders", clip_median=clip))
    assert torch.equal(torch.isnan(out), torch.isnan(plain)) and torch.equal(torch.isinf(out), torch.isinf(plain))
    assert out[0].item() == 2.0 and out[3].item() == 3.0  # no clip: a norm is not finite
    assert clip_to_median_norm(d, None) == d


def test_codecs_without_a_rule_and_the_data_plane_spec() -> None:
    d = [t(1, 0), t(3, 4)]
    assert torch.equal(reduce_gathered(d, None, torch.empty(2), compress.get_codec("int2")), over_all(d))
    assert torch.equal(reduce_gathered(d, None, torch.empty(2), None), over_all(d))
    codec = codec_from_spec(codec_spec(compress.get_codec("topk", mean="senders", clip_median=True)))
    assert (codec.mean, codec.clip_median) == ("senders", True)
    with pytest.raises(ValueError, match="mean must be one of all, senders"):
        compress.get_codec("topk", mean="peers")
    with pytest.raises(ValueError, match="clip_median must be a bool"):
        compress.get_codec("topk", clip_median=1)


def test_nothing_to_reduce_is_an_error():
    with pytest.raises(ValueError, match="no contributions"):
        reduce_gathered([], None, torch.empty(4))
