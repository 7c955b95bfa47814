"""torchtitan training jobs as DiLoCo groups: each torchrun job of torchtitan is a group, its
data-parallel replicas (FSDP2) that group's ranks, and pseudo-gradients cross between groups through
this project's coordinator and data plane.

Built on torchtitan's own extension points (torchtitan 0.3.0):

- a ``Trainer`` subclass with its ``Config``: ``DiLoCoTrainer`` (``titan_trainer.py``), adding a
  ``diloco`` section (``--diloco.group``, ``--diloco.sync_every``, ``--diloco.codec`` ...) and one
  engine step after each of torchtitan's optimizer steps; its checkpoints stay torchtitan's DCP;
- ``Configurable`` components: ``ByteTokenizer`` (a ``BaseTokenizer``: bytes, no tokenizer files) and
  ``CorpusDataLoader`` (a ``BaseDataLoader``: the bundled corpus, one shard per group) in ``titan_data.py``;
- a model converter: ``CausalSDPA`` (``titan_model.py``), eager causal attention for CPUs in place of the
  compiled FlexAttention;
- a ``config_registry`` function, ``llama3_debugmodel_diloco`` below: torchtitan's own
  ``llama3_debugmodel`` (the debug Llama 3, its optimizer, lr schedule and checkpoint settings) with the
  above swapped in and a CPU-sized batch, read by torchtitan's ``ConfigManager`` as
  ``--module diloco.integrations.titan --config llama3_debugmodel_diloco`` plus ``--section.key`` overrides.
  (torchtitan 0.3.0 has no TOML job files any more: a config is such a function, overridden on the
  command line.)

``parse_config(argv)`` returns the config; ``examples/titan_llama.py`` connects (``diloco.connect``) and
trains. torchtitan is imported on first use; without it every function raises ModuleNotFoundError
naming ``pip install -e ".[titan]"``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from diloco.integrations import titan_env

INSTALL_HINT = titan_env.INSTALL_HINT
MODULE = "diloco.integrations.titan"  # what --module names for torchtitan's ConfigManager
CONFIGS = ("llama3_debugmodel_diloco", "llama3_debugmodel_dp")


def llama3_debugmodel_diloco() -> Any:
    """torchtitan's ``llama3_debugmodel`` as a ``DiLoCoTrainer.Config``: the debug Llama 3 (6 layers,
    width 256, 2,048-token vocabulary; 6.2M parameters), AdamW lr 8e-4 with torchtitan's warmup and
    linear decay, gradient clipping at 1.0, FSDP2 over the group's ranks; then for this project: byte
    tokens from the bundled corpus (``CorpusDataLoader``), eager causal attention (``CausalSDPA``), fp32
    parameters (CPU), a fixed seed (every group starts from the same weights, as DiLoCo needs), no
    activation checkpointing, sequences of 128 tokens, 4 per rank, 200 steps, H = 20."""
    titan_env.load()
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from diloco.integrations.titan_data import ByteTokenizer, CorpusDataLoader
    from diloco.integrations.titan_model import CausalSDPA, sum_reductions_on_gloo
    from diloco.integrations.titan_trainer import DiLoCoTrainer

    base = llama3_debugmodel()
    config = DiLoCoTrainer.Config(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)
                                     if f.name != "diloco"})
    config.model_spec = model_registry("debugmodel", converters=[CausalSDPA.Config()])
    config.model_spec.parallelize_fn = sum_reductions_on_gloo(config.model_spec.parallelize_fn)
    config.hf_assets_path = ""  # no tokenizer files: ByteTokenizer
    config.tokenizer = ByteTokenizer.Config()
    config.dataloader = CorpusDataLoader.Config()
    config.validator.enable = False  # torchtitan's validator reads its c4 test set; the engine evaluates
    config.activation_checkpoint = None
    # FSDP2 over a 1-D mesh of the group's ranks (fully_shard as torchtitan applied it before its SPMD
    # backends): the DTensors the engine exchanges shard by shard. The default, "spmd_types", fails on CPU
    # with torch 2.13 in fully_shard (bench/pages/titan.md has the traceback).
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.mixed_precision_param = "float32"
    config.training.seq_len, config.training.local_batch_size, config.training.steps = 128, 4, 200
    config.training.disable_cuda_graphs = True
    config.lr_scheduler.warmup_steps = 10
    config.checkpoint.interval = 100
    config.metrics.log_freq = 10
    config.debug.seed = 0
    config.dump_folder = "./outputs/titan-diloco"
    return config


def llama3_debugmodel_dp() -> Any:
    """The same job as ``llama3_debugmodel_diloco`` for torchtitan's own ``Trainer`` alone: the
    baseline a DiLoCo run is measured against (data parallel over all of its ranks, the whole
    training text, no DiLoCo in the training path)."""
    titan_env.load()
    from torchtitan.trainer import Trainer

    config = llama3_debugmodel_diloco()
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(Trainer.Config)}
    plain = Trainer.Config(**fields)
    plain.dump_folder = "./outputs/titan-dp"
    return plain


def parse_config(argv: Sequence[str]) -> Any:
    """torchtitan's logger started and its ``ConfigManager`` on ``argv`` (``--config NAME`` defaults to
    ``llama3_debugmodel_diloco``; ``--module`` to this module; ``--section.key value`` overrides)."""
    titan_env.load()
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()  # torchtitan's log lines (steps, loss, checkpoints), as its own train.py starts them

    args = list(argv)
    if not any(a == "--module" or a.startswith("--module=") for a in args):
        args = ["--module", MODULE, *args]
    if not any(a == "--config" or a.startswith("--config=") for a in args):
        args = ["--config", CONFIGS[0], *args]
    return ConfigManager().parse_args(args)
