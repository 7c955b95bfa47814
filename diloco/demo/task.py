"""The demo task: the small GPT on a byte-level corpus (bundled Shakespeare by default)."""

from __future__ import annotations

import torch

from diloco.demo import data as data_mod
from diloco.demo.model import GPT, GPTConfig
from diloco.engine.fragments import gpt_fragments
from diloco.job.config import Config
from diloco.job.task import Task, TaskContext


def gpt_task(ctx: TaskContext) -> Task:
    """The demo: the small GPT (``--n-layer`` ...) on ``--data`` (bundled Shakespeare by default)."""
    cfg = ctx.config if ctx.config is not None else Config()
    corpus = data_mod.load_corpus(cfg.data.path or None)
    train, val = data_mod.split(corpus, cfg.data.val_fraction)
    lo, hi = data_mod.shard_bounds(len(train), ctx.num_groups, ctx.group)
    sampler: data_mod.BatchSampler | data_mod.EpochSampler
    if cfg.data.order == "epochs":  # one permutation per group, each rank its slice of every step
        sampler = data_mod.EpochSampler(train[lo:hi], cfg.data.batch_size, cfg.model.block_size,
                                        seed=ctx.seed + 7919 * (ctx.group + 1), rank=ctx.rank,
                                        group_size=ctx.group_size)
    else:
        sampler = data_mod.BatchSampler(train[lo:hi], cfg.data.batch_size, cfg.model.block_size,
                                        seed=ctx.seed + 7919 * (ctx.group + 1) + 104729 * ctx.rank,
                                        group_size=ctx.group_size)
    torch.manual_seed(ctx.seed)  # identical initial weights in every group
    m = cfg.model
    model = GPT(GPTConfig(corpus.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd, m.dropout))

    return Task(
        model=model, train_batches=sampler, loss=lambda net, b: net(b[0], b[1])[1],
        eval_batches=data_mod.eval_batches(val, cfg.data.batch_size, m.block_size, cfg.data.eval_batches),
        tokens_per_batch=cfg.data.batch_size * m.block_size,
        fragments=lambda net, p: gpt_fragments(net, p, cfg.sync.fragment_pattern),
    )
