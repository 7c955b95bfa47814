"""DCP checkpoints of the engine in one process (an unsharded model; the sharded ones, resharded
from 2 ranks onto 4, are tests/exchange/test_sharded_groups.py), and what the reader refuses."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.nn as nn

from diloco.engine.averaging import SingleGroup
from diloco.engine.dcp_state import DcpStateError
from diloco.engine.diloco import DiLoCo
from diloco.runtime.checkpoints import dcp_checkpoint
from diloco.runtime.checkpoints.dcp_checkpoint import CheckpointRefused, SafeReader


def build(mode: str = "delayed"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 2))
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, inner, DiLoCo(model, inner, averager=SingleGroup(), mode=mode, sync_every=3)


def train(model, inner, engine, start: int, stop: int) -> None:
    for t in range(start, stop):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(t))
        nn.functional.mse_loss(model(x), x[:, :2].sin()).backward()
        inner.step()
        inner.zero_grad()
        engine.step()


@pytest.mark.parametrize("mode", ["delayed", "eager"])
def test_save_stop_load_continue_equals_a_straight_run(tmp_path, mode):
    straight = build(mode)
    train(*straight, 0, 10)
    stopped = build(mode)
    train(*stopped, 0, 5)  # delayed: a round's mean is held between rounds; eager: its own previous Δ
    dcp_checkpoint.save(tmp_path / "ckpt", stopped[2], stopped[0], stopped[1], extra={"step": 5})
    resumed = build(mode)
    assert dcp_checkpoint.load(tmp_path / "ckpt", resumed[2], resumed[0], resumed[1]) == {"step": 5}
    train(*resumed, 5, 10)
    assert resumed[2].global_hash() == straight[2].global_hash()
    for a, b in zip(resumed[0].parameters(), straight[0].parameters()):
        assert torch.equal(a, b)
    meta = json.loads((tmp_path / "ckpt" / "engine.json").read_text())
    assert meta["mode"] == mode and meta["inner_step"] == 5 and not meta["sharded"]


def test_a_checkpoint_of_another_mode_or_unfinished_is_refused(tmp_path):
    model, inner, engine = build("delayed")
    train(model, inner, engine, 0, 4)
    dcp_checkpoint.save(tmp_path / "ckpt", engine)
    with pytest.raises(DcpStateError, match="mode 'delayed', this one runs 'blocking'"):
        dcp_checkpoint.load(tmp_path / "ckpt", build("blocking")[2])
    with pytest.raises(CheckpointRefused, match=r"holds \['engine'\], not \['model'\]"):
        dcp_checkpoint.load(tmp_path / "ckpt", build("delayed")[2], build("delayed")[0])
    (tmp_path / "ckpt" / "engine.json").unlink()  # what a crash before the end of save leaves
    with pytest.raises(CheckpointRefused, match="not a finished diloco DCP checkpoint"):
        dcp_checkpoint.load(tmp_path / "ckpt", build("delayed")[2])


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_metadata_that_names_other_code_is_refused_before_it_runs(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(CheckpointRefused, match="names posix.system"):
        SafeReader(str(tmp_path)).read_metadata()
