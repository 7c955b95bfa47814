"""--codec-fast: the 4-bit codecs without their scale search, the same wire format."""

import time

import pytest
import torch

from diloco.job.config import Config


@pytest.mark.parametrize("name", ["int4", "fp4-e2m1", "fp4-e3m0", "lloyd4"])
def test_codec_fast_turns_the_scale_search_off_and_frames_stay_decodable(name):
    cfg = Config()
    cfg.transport.codec = name
    searched = cfg.validate().transport.codec_spec().build()
    cfg.transport.codec_fast = True
    fast = cfg.validate().transport.codec_spec().build()
    assert searched.params["search"] is True and fast.params["search"] is False
    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(0)) * torch.rand(1 << 14) ** 4
    f_fast, f_searched = fast.encode(x), searched.encode(x)
    assert len(f_fast) == len(f_searched)  # same bits per value
    # a member that searches decodes a fast member's frame, and the search costs error only when off
    back = searched.decode(f_fast)
    err = lambda y: float((y - x).norm() / x.norm())  # noqa: E731
    assert torch.equal(back, fast.decode(f_fast))
    assert err(searched.decode(f_searched)) < err(back)


def test_codec_fast_encodes_faster():
    cfg = Config()
    cfg.transport.codec = "int4"
    searched = cfg.validate().transport.codec_spec().build()
    cfg.transport.codec_fast = True
    fast = cfg.validate().transport.codec_spec().build()
    x = torch.randn(1 << 22)  # the search is ~1/3 of an encode here: large enough to show above noise
    best = {fast: float("inf"), searched: float("inf")}
    for _ in range(25):  # interleaved, so a burst of load on a shared machine slows both alike
        for codec in best:
            t0 = time.perf_counter()
            codec.encode(x)
            best[codec] = min(best[codec], time.perf_counter() - t0)
    assert best[fast] < best[searched]
