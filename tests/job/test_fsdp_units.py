"""Which modules ``diloco.shard_model`` wraps with ``fully_shard``, and what it refuses."""

from __future__ import annotations

import pytest
import torch.nn as nn

from diloco.demo.model import GPT, GPTConfig
from diloco.job.fsdp import ShardingConfigError, shard_model, units_of
from diloco.job.task import Task, TaskError


def gpt() -> GPT:
    return GPT(GPTConfig(n_layer=3, n_embd=16, n_head=2, block_size=8))


def test_default_units_are_the_blocks_of_every_module_list():
    model = gpt()
    assert units_of(model) == list(model.blocks) == units_of(model, True)
    assert units_of(nn.Sequential(nn.Linear(2, 2))) == []  # no ModuleList: the root alone


def test_units_by_name_module_class_predicate_and_list():
    model = gpt()
    assert units_of(model, "blocks") == list(model.blocks) == units_of(model, model.blocks)
    assert units_of(model, "blocks.1") == [model.blocks[1]]
    assert units_of(model, nn.LayerNorm) == [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert units_of(model, lambda name, m: name.endswith("attn")) == [b.attn for b in model.blocks]
    assert units_of(model, ["blocks.0", model.ln_f]) == [model.blocks[0], model.ln_f]


def test_unknown_names_and_foreign_modules_are_refused_with_the_top_level_names():
    model = gpt()
    with pytest.raises(ShardingConfigError, match="no module 'layers'.*blocks"):
        units_of(model, "layers")
    with pytest.raises(ShardingConfigError, match=r"no module\(s\) \['blocks.9'\]"):
        units_of(model, ["blocks.0", "blocks.9"])
    with pytest.raises(ShardingConfigError, match="not one of its submodules"):
        units_of(model, [nn.Linear(2, 2)])


def test_sharding_needs_torch_distributed():
    with pytest.raises(ShardingConfigError, match="torch.distributed initialized"):
        shard_model(gpt())


def test_a_task_asks_for_sharding_with_a_valid_spec():
    model = gpt()
    assert Task(model=model, train_batches=[], loss=lambda m, b: b, shard="blocks").shard == "blocks"
    assert Task(model=model, train_batches=[], loss=lambda m, b: b, shard=True).shard is True
    with pytest.raises(TaskError, match="Task.shard"):
        Task(model=model, train_batches=[], loss=lambda m, b: b, shard=3)
