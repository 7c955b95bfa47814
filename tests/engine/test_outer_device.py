"""Where the global copy lives: on the model's device, or in page-locked host memory for a model on
a GPU (``--outer-device cpu``), with queued copies that must still give the synchronous bits."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import sleep_on_cuda_stream

from diloco.engine.outer import nesterov
from diloco.engine.outer_state import OuterFragment

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _params(device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    shapes_dtypes = [((64, 33), torch.float32), ((1000,), torch.bfloat16), ((7,), torch.float32)]
    return [torch.randn(s, generator=gen).to(device=device, dtype=dt) for s, dt in shapes_dtypes]


def _reference(frag_params: list[torch.Tensor], globals_: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(g - p.detach().to("cpu", torch.float32)).reshape(-1) for g, p in zip(globals_, frag_params)])


def test_a_global_copy_beside_its_model_is_neither_staged_nor_pinned() -> None:
    params = _params("cpu")
    frag = OuterFragment(["a", "b", "c"], params, outer_optimizer=nesterov(0.7, 0.9))
    assert not frag.staged and not any(g.is_pinned() for g in frag.global_params)
    with torch.no_grad():
        for p in params:
            p.add_(0.25)
    assert torch.equal(frag.pseudo_gradient(), _reference(params, frag.global_params))


@cuda
def test_a_host_global_copy_of_a_gpu_model_is_pinned_and_gives_the_synchronous_bits() -> None:
    params = _params("cuda")
    frag = OuterFragment(["a", "b", "c"], params, outer_optimizer=nesterov(0.7, 0.9), device=torch.device("cpu"))
    assert frag.staged and all(g.is_pinned() and g.dtype == torch.float32 for g in frag.global_params)
    with torch.no_grad():
        for p in params:
            p.mul_(0.9).add_(0.1)
    delta = frag.pseudo_gradient()
    assert torch.equal(delta, _reference(params, frag.global_params))

    frag.outer_step(delta)
    merged = [g.clone() for g in frag.global_params]
    sleep_on_cuda_stream(1.0)  # the merge's copies queue behind this on the model's stream
    frag.merge_into_model(0.0)
    frag.outer_step(delta)  # writes the global copy: must wait for the queued copies first
    torch.cuda.synchronize()
    for p, g in zip(params, merged):
        assert torch.equal(p.cpu(), g.to(p.dtype)), "a queued copy read a global copy written after the merge"

    frag.merge_into_model(0.5)
    torch.cuda.synchronize()
    for p, g, before in zip(params, frag.global_params, merged):
        expect = before.to("cuda", p.dtype).lerp_(g.to("cuda", p.dtype), 0.5)
        assert torch.equal(p, expect)
