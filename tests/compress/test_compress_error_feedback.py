"""ErrorFeedback: nothing given is ever lost, only delayed."""
import pytest
import torch

import compress
from compress_helpers import SMALL


@pytest.mark.parametrize("name", ["sign1", "int2", "topk", "int4", "fp4-e3m0", "int8", "bf16"])
def test_sum_of_decoded_plus_residual_equals_sum_of_inputs(name):
    torch.manual_seed(0)
    ef = compress.ErrorFeedback(compress.get_codec(name, **SMALL[name]))
    n = 203
    given = torch.zeros(n, dtype=torch.float64)
    decoded = torch.zeros(n, dtype=torch.float64)
    for step in range(40):
        x = torch.randn(n) * (1 + step % 3)
        given += x.double()
        frame, dec = ef.encode_with_decoded(x)
        assert torch.equal(compress.decode_frame(frame), dec)
        decoded += dec.double()
    total = decoded + ef.residual.double()
    # each call adds at most ~1 ulp of the running residual's magnitude
    assert torch.allclose(total, given, rtol=0, atol=40 * 1e-6 * given.abs().max().item())
    if name in ("sign1", "int2", "topk"):  # lossy enough that the residual matters
        assert ef.residual.abs().max() > 1e-3


def test_without_feedback_topk_loses_mass_and_with_it_does_not():
    torch.manual_seed(1)
    codec = compress.get_codec("topk", chunk=64, k=2, value_bits=4)
    ef = compress.ErrorFeedback(codec)
    x = torch.full((256,), 0.01)  # every value equal: plain top-k keeps 2 of 64 every time
    plain = sum(codec.decode(codec.encode(x)) for _ in range(64))
    fed = sum(ef.encode_with_decoded(x)[1] for _ in range(64))
    target = x * 64
    assert (plain - target).norm() / target.norm() > 0.9
    assert (fed - target).norm() / target.norm() < 0.35
    assert torch.allclose(fed + ef.residual, target, atol=1e-5)


def test_encode_matches_encode_with_decoded_and_updates_residual():
    ef = compress.ErrorFeedback(compress.get_codec("sign1", block_size=4))
    x = torch.tensor([1.0, -2.0, 3.0, 0.5])
    f = ef.encode(x)
    assert ef.name == "sign1"
    dec = ef.decode(f)
    assert torch.allclose(ef.residual, x - dec)


def test_beta_decays_the_residual():
    ef = compress.ErrorFeedback(compress.get_codec("topk", chunk=4, k=1, value_bits=8), beta=0.5)
    ef.encode(torch.tensor([4.0, 2.0, 0.0, 0.0]))
    assert torch.allclose(ef.residual, torch.tensor([0.0, 2.0, 0.0, 0.0]))
    _, dec = ef.encode_with_decoded(torch.tensor([0.0, 0.0, 0.0, 0.0]))
    assert torch.allclose(dec, torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_shape_change_is_refused_until_reset():
    ef = compress.ErrorFeedback(compress.get_codec("sign1"))
    ef.encode(torch.randn(10))
    with pytest.raises(ValueError, match="one per shard"):
        ef.encode(torch.randn(11))
    ef.reset()
    assert ef.residual is None
    ef.encode(torch.randn(11))
    assert ef.residual.shape == (11,)


def test_failed_encode_keeps_the_residual():
    ef = compress.ErrorFeedback(compress.get_codec("sign1"))
    ef.encode(torch.randn(10))
    before = ef.residual.clone()
    with pytest.raises(ValueError):
        ef.encode(torch.full((10,), float("nan")))
    assert torch.equal(ef.residual, before)


def test_requires_error_feedback_flags():
    flags = {n: compress.get_codec(n).requires_error_feedback for n in compress.available_codecs()}
    assert flags["sign1"] and flags["int2"] and flags["topk"]
    assert not any(v for k, v in flags.items() if k not in ("sign1", "int2", "topk"))


def test_bad_construction():
    with pytest.raises(TypeError):
        compress.ErrorFeedback("sign1")
    with pytest.raises(ValueError):
        compress.ErrorFeedback(compress.get_codec("sign1"), beta=1.5)
