"""Helpers of the job-checkpoint tests (tests/runtime/test_resume.py, test_job_checkpoint_files.py): a
job's configuration, and a tiny engine trained a few steps alone, to checkpoint."""

import torch
import torch.nn as nn

from diloco.engine.averaging import SingleGroup
from diloco.engine.diloco import DiLoCo
from diloco.job.config import Config

G = 2  # groups of a job unless a test says otherwise


def job_config(mode="blocking", groups=G, **train):
    cfg = Config()
    cfg.topology.groups, cfg.topology.ranks_per_group, cfg.sync.mode = groups, 1, mode
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def single(cfg):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    engine = DiLoCo(model, inner, averager=SingleGroup(), sync_every=2)
    for _ in range(3):
        model(torch.ones(1, 4)).sum().backward()
        inner.step()
        engine.step()
    return model, inner, engine
