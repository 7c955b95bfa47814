"""CUDA tensors take the same code path; peers on CPU and GPU decode the same bits."""
import pytest
import torch

import compress
from compress_helpers import SMALL

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("name", compress.available_codecs())
@pytest.mark.parametrize("zstd", [False, True])
def test_cuda_encode_matches_cpu_decode_bit_for_bit(name, zstd):
    codec = compress.get_codec(name, zstd=zstd, **SMALL[name])
    x = torch.randn(1000, device="cuda")
    frame, mine = codec.encode_with_decoded(x)
    assert mine.device.type == "cuda"
    on_cpu = codec.decode(frame)
    on_gpu = codec.decode(frame, device="cuda")
    assert on_gpu.device.type == "cuda"
    assert torch.equal(mine.cpu().view(torch.int32), on_cpu.view(torch.int32))
    assert torch.equal(on_gpu.cpu().view(torch.int32), on_cpu.view(torch.int32))


@cuda
def test_error_feedback_on_cuda():
    ef = compress.ErrorFeedback(compress.get_codec("topk", chunk=64, k=4))
    x = torch.randn(640, device="cuda")
    frame, dec = ef.encode_with_decoded(x)
    assert ef.residual.device.type == "cuda"
    assert torch.allclose(dec + ef.residual, x)


def test_decode_to_an_explicit_cpu_device():
    codec = compress.get_codec("int4")
    frame, mine = codec.encode_with_decoded(torch.randn(300))
    assert torch.equal(codec.decode(frame, device="cpu"), mine)
    assert torch.equal(codec.decode(frame, device=torch.device("cpu")), mine)


@cuda
@pytest.mark.parametrize("name", ["int8", "int4", "fp4-e2m1", "fp4-e3m0", "lloyd4"])
@pytest.mark.parametrize("search", [False, True])
def test_cuda_encode_writes_the_cpu_frame(name, search):
    """The torch path on a GPU makes the same choices (scale search included) as the C kernels
    on CPU: a ring of CPU and GPU members sends the same bytes."""
    params = {} if name == "int8" else {"search": search}
    codec = compress.get_codec(name, **params)
    g = torch.Generator().manual_seed(3)
    for n in (1, 1001, 70001):
        x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
        assert codec.encode(x.cuda()) == codec.encode(x)
