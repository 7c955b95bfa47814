"""A torchtitan model converter: causal scaled-dot-product attention in place of FlexAttention.

torchtitan 0.3.0 builds every language model's attention with FlexAttention (``flex``, the debug
model's default), whose kernel is ``torch.compile``d with inductor at the first forward (a C++ build in
every rank on a CPU) and which takes its block-causal mask from per-document ``positions``.
``CausalSDPA`` is a ``ModelConfigConverter`` (torchtitan's extension point for rewriting the model
config before it is built, as its quantization and LoRA converters do): it swaps each
``FlexAttention.Config`` for ``ScaledDotProductAttention.Config``, which runs
``F.scaled_dot_product_attention(is_causal=True)`` eagerly. That is the same attention exactly when each
sequence is one document (no per-document masks), which is what ``CorpusDataLoader`` yields (it emits
no ``positions``). Parameters, their names and their initialization are unchanged.

``sum_reductions_on_gloo`` wraps a model spec's ``parallelize_fn`` so that FSDP2 inside a group runs
on Gloo (CPU) at all (its docstring says what fails without it).

Import this module only through ``diloco.integrations.titan`` (which fixes torchtitan's device first).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from diloco.integrations import titan_env

titan_env.load()

from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention  # noqa: E402
from torchtitan.protocols.model import ModelConfigConverter  # noqa: E402
from torchtitan.protocols.module import Module  # noqa: E402


class CausalSDPA(ModelConfigConverter):
    """Every FlexAttention of the model config becomes causal SDPA (eager; no compile)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        pass

    def __init__(self, config: Config | None = None) -> None:
        self.config = config

    def convert(self, model_config: Module.Config) -> Module.Config:
        """``model_config`` with each ``FlexAttention.Config`` replaced; ValueError if it has none."""
        found = list(model_config.traverse(FlexAttention.Config))
        if not found:
            raise ValueError("CausalSDPA: the model config has no FlexAttention to replace")
        for _fqn, _cfg, parent, attr in found:
            if parent is None:
                raise ValueError("CausalSDPA: the model config is itself an attention, not a model")
            replacement = ScaledDotProductAttention.Config()
            if isinstance(attr, int):
                parent[attr] = replacement  # type: ignore[index]
            else:
                setattr(parent, attr, replacement)
        return model_config


def sum_reductions_on_gloo(parallelize_fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``parallelize_fn`` (a model spec's), then, where the group's backend is Gloo, FSDP2's gradient
    reduce-scatter done as a plain SUM.

    torchtitan turns FSDP's gradient division off (``disable_fsdp_gradient_division``: factor 1.0; it
    scales the loss by the global token count itself), and FSDP2 then reduces with
    ``ReduceOp.PREMUL_SUM``, which Gloo refuses at the first backward (``RuntimeError: Cannot use
    ReduceOp.PREMUL_SUM with Gloo``, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:184).
    A premultiplied sum by 1.0 is a sum: ``set_force_sum_reduction_for_comms(True)`` on every FSDP module
    gives the same gradients with an op Gloo has."""

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, **kwargs: Any) -> nn.Module:
        model = parallelize_fn(model, **kwargs)
        if dist.is_initialized() and dist.get_backend() == "gloo":
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize
