"""compress.finite.all_finite: exact, whatever the sum does."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from compress.finite import all_finite

BIG = float(np.finfo(np.float32).max)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 4097, -1])
def test_one_nan_or_infinity_anywhere_is_found(bad, where):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    assert all_finite(x)
    x[where] = bad
    assert not all_finite(x)


def test_finite_values_whose_sum_overflows_are_still_finite():
    x = torch.full((1000,), BIG)
    assert torch.isinf(x.sum())  # the fast path cannot decide: the exact check must
    assert all_finite(x)
    assert all_finite(torch.tensor([BIG, -BIG, BIG, BIG]))
    assert all_finite(torch.full((100,), 60000.0, dtype=torch.bfloat16))


def test_infinities_of_both_signs_and_empty_tensors():
    assert not all_finite(torch.tensor([float("inf"), float("-inf")]))
    assert all_finite(torch.empty(0))


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.integers(1, 300),
              elements=st.floats(width=32, allow_nan=True, allow_infinity=True)))
def test_agrees_with_isfinite_on_arbitrary_floats(x):
    assert all_finite(torch.from_numpy(x)) == bool(np.isfinite(x).all())
