"""torchtitan training jobs as DiLoCo groups (``diloco.integrations.titan``): the example runs as written
(2 groups x 2 ranks, FSDP2 inside each, torchtitan's debug Llama), the groups agree bit for bit every
round, the loss falls, torchtitan's DCP checkpoint holds the engine's state and a resumed group ends
where an uninterrupted one does; bad configs and corpora fail with messages that say what to change.

torchtitan comes with the ``titan`` extra; without it the tests that need it are skipped with the
reason below, which names the extra. The message a missing torchtitan gives is checked either way.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "titan_llama.py"
REASON = 'the titan extra is not installed: pip install -e ".[titan]"'
SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--diloco.eval_batches", "2",
         "--diloco.probe_bytes", "0", "--metrics.log_freq", "4", "--lr_scheduler.warmup_steps", "2"]


@pytest.fixture(scope="module")
def titan():
    pytest.importorskip("torchtitan", reason=REASON)
    from diloco.integrations import titan

    return titan


def torchrun(args: list[str], env: dict[str, str], ranks: int = 2) -> subprocess.Popen:
    """The example under torchrun (``--standalone``: its own rendezvous port), as its docstring runs it."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(ranks), str(EXAMPLE), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def run_env() -> dict[str, str]:
    return {**os.environ, "DILOCO_SECRET": secrets.token_hex(32), "DILOCO_TOKEN": "t0ken", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def run_groups(tmp_path: Path, args: list[str], groups: int = 2, timeout_s: float = 240.0) -> list[dict]:
    """One torchrun of the example per group against a coordinator of this process; each group's
    summary, with the last progress report the coordinator holds of the group (``progress``)."""
    from diloco.coordinator import CoordinatorServer

    env = run_env()
    with CoordinatorServer(expected_groups=groups, token="t0ken") as server:
        procs = [torchrun(["--diloco.coordinator", server.address, "--diloco.group", str(g), "--diloco.groups",
                           str(groups), "--diloco.summary_json", str(tmp_path / f"g{g}.json"),
                           "--dump_folder", str(tmp_path / f"dump{g}"), *SMALL, *args], env) for g in range(groups)]
        try:
            outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
        progress = server.snapshot()["progress"]
    assert [p.returncode for p in procs] == [0] * groups, [o[-3000:] for o in outs]
    return [{**json.loads((tmp_path / f"g{g}.json").read_text()), "progress": progress.get(g)} for g in range(groups)]


def run_one_group(dump: Path, args: list[str], timeout_s: float = 180.0) -> dict:
    """The example as one group (no coordinator: ``--diloco.groups 1``); its summary."""
    summary = dump / "summary.json"
    p = torchrun(["--diloco.groups", "1", "--dump_folder", str(dump), "--diloco.summary_json", str(summary),
                  *SMALL, *args], run_env())
    try:
        out = p.communicate(timeout=timeout_s)[0]
    finally:
        p.kill()
    assert p.returncode == 0, out[-3000:]
    return json.loads(summary.read_text())


def test_without_torchtitan_the_error_names_the_extra():
    code = ("import sys; sys.modules['torchtitan'] = None\n"
            "from diloco.integrations import titan\n"
            "try:\n    titan.llama3_debugmodel_diloco()\n"
            "except ModuleNotFoundError as e:\n    print('MNF', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("MNF") and 'pip install -e ".[titan]"' in out.stdout


@pytest.mark.slow
def test_two_groups_of_two_fsdp_ranks_train_bit_identically_and_checkpoint_with_dcp(tmp_path, titan):
    summaries = run_groups(tmp_path, ["--training.steps", "8", "--diloco.sync_every", "4", "--checkpoint.enable",
                                      "--checkpoint.interval", "4"])
    a, b = summaries
    assert a["outer_rounds"] == b["outer_rounds"] == 2
    assert a["round_hashes"] == b["round_hashes"] and len(a["round_hashes"]) == 2  # every round, both groups
    assert a["param_hash"] == b["param_hash"] == a["round_hashes"][-1]
    assert a["eval_loss"] == b["eval_loss"] < a["initial_eval_loss"] - 1.0  # the global model learned
    assert a["num_parameters"] == 6_163_712  # torchtitan's debug Llama (2,048-token vocabulary)
    assert a["bytes_sent"] > 0 and b["bytes_sent"] > 0
    assert a["data_samples"]["samples"] == b["data_samples"]["samples"] == 8 * 2 * 2  # steps x ranks x batch
    assert a["tokens"] == b["tokens"] == 8 * 2 * 2 * 32  # the group's tokens: steps x ranks x batch x seq_len
    for s in summaries:  # the coordinator heard each group's progress, to its last step
        p = s["progress"]
        assert p["step"] == p["steps"] == 8 and p["round"] >= 1 and p["bytes_sent"] > 0, p
        assert 0 < p["loss"] < 10 and p["lr"] > 0, p  # the last step's lr (the schedule reaches 0 after it)
        assert p["tokens_per_s"] > 0, p
    from torch.distributed.checkpoint import FileSystemReader

    for g in range(2):  # torchtitan's DCP checkpoints, with the engine's state in them
        steps = sorted(p.name for p in (tmp_path / f"dump{g}" / "checkpoint").iterdir())
        assert steps == ["step-4", "step-8"]
        keys = FileSystemReader(str(tmp_path / f"dump{g}" / "checkpoint" / "step-8")).read_metadata().state_dict_metadata
        assert "train_state.diloco_meta" in keys and "dataloader.samples" in keys
        assert any(k.startswith("train_state.diloco.engine/f0/outer/") for k in keys)  # outer momentum
        assert any(k.startswith("model.") or k.startswith("layers.") or "tok_embeddings" in k for k in keys)


def test_a_seed_starts_both_groups_from_the_same_other_weights(tmp_path, titan):
    """``--debug.seed`` (torchtitan's: what ``bench/titan.py --seed`` sets with ``--dataloader.seed``): both
    groups start from one set of weights, not seed 0's."""
    args = ["--training.steps", "2", "--diloco.sync_every", "2"]
    a, b = run_groups(tmp_path / "seed7", [*args, "--debug.seed", "7", "--dataloader.seed", "7"])
    default = run_one_group(tmp_path / "seed0", args)
    assert a["initial_eval_loss"] == b["initial_eval_loss"] != default["initial_eval_loss"]
    assert a["round_hashes"] == b["round_hashes"] and a["param_hash"] != default["param_hash"]


@pytest.mark.slow
def test_a_group_resumed_from_torchtitans_checkpoint_ends_bit_identically(tmp_path, titan):
    args = ["--training.steps", "4", "--diloco.sync_every", "2", "--checkpoint.enable", "--checkpoint.interval", "2"]
    whole = run_one_group(tmp_path / "run", args)
    ckpt = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4"]
    for f in (ckpt / "step-4").iterdir():  # as if the job had stopped after step 2
        f.unlink()
    (ckpt / "step-4").rmdir()
    resumed = run_one_group(tmp_path / "run", args)
    assert resumed["param_hash"] == whole["param_hash"] and resumed["eval_loss"] == whole["eval_loss"]
    assert resumed["outer_rounds"] == whole["outer_rounds"] == 2 and resumed["steps"] == 4


def test_bad_configs_fail_before_training_with_the_field_named(titan):
    from diloco.integrations.titan_trainer import TitanConfigError

    def built(*args: str):
        return titan.parse_config(list(args)).build()

    with pytest.raises(TitanConfigError, match=r"diloco.group=2 must be in 0..diloco.groups-1"):
        built("--diloco.group", "2", "--diloco.groups", "2")
    with pytest.raises(TitanConfigError, match="diloco.sync_every=0"):
        built("--diloco.groups", "1", "--diloco.sync_every", "0")
    with pytest.raises(TitanConfigError, match="needs an averager"):
        built("--diloco.groups", "2")
    with pytest.raises(TitanConfigError, match="checkpoint.interval=30 is not a multiple of diloco.sync_every=20"):
        built("--diloco.groups", "1", "--checkpoint.enable", "--checkpoint.interval", "30")
    with pytest.raises(SystemExit):  # torchtitan's own parser: an unknown field
        titan.parse_config(["--diloco.no_such_field", "1"])


def test_the_configs_are_torchtitans_debug_llama_with_the_projects_pieces(titan):
    from torchtitan.trainer import Trainer

    from diloco.integrations.titan_data import ByteTokenizer, CorpusDataLoader
    from diloco.integrations.titan_trainer import DiLoCoTrainer

    c = titan.parse_config(["--diloco.sync_every", "5"])
    assert isinstance(c, DiLoCoTrainer.Config) and c.diloco.sync_every == 5
    assert (c.model_spec.name, c.model_spec.flavor) == ("llama3", "debugmodel")
    assert isinstance(c.tokenizer, ByteTokenizer.Config) and isinstance(c.dataloader, CorpusDataLoader.Config)
    assert "ScaledDotProductAttention" in repr(c.model_spec.model) and "FlexAttention" not in repr(c.model_spec.model)
    dp = titan.parse_config(["--config", "llama3_debugmodel_dp"])
    assert type(dp) is Trainer.Config and dp.training.seq_len == c.training.seq_len


def test_the_dataloader_gives_each_group_and_rank_their_own_windows(titan, tmp_path):
    from diloco.integrations.titan_data import ByteTokenizer, CorpusDataLoader, TitanDataError

    def loader(shard: int, rank: int, **kw):
        cfg = CorpusDataLoader.Config(shard=shard, num_shards=2, **kw)
        return cfg.build(dp_world_size=2, dp_rank=rank, tokenizer=ByteTokenizer(), seq_len=16, local_batch_size=3)

    rows = {}
    for shard in range(2):
        for rank in range(2):
            (x, y) = next(iter(loader(shard, rank)))
            assert x["input"].shape == y.shape == (3, 16) and int(y.max()) < 256
            assert (x["input"][:, 1:] == y[:, :-1]).all()
            rows[shard, rank] = {tuple(r.tolist()) for r in x["input"]}
    assert all(rows[k].isdisjoint(rows[j]) for k in rows for j in rows if k < j)
    first = loader(0, 0)
    it = iter(first)
    next(it)
    state = first.state_dict()
    assert state["samples"] == 6  # the group's counter: 2 ranks x 3
    again = loader(0, 0)
    again.load_state_dict(state)
    assert (next(iter(again))[0]["input"] == next(it)[0]["input"]).all()  # continues with the next windows
    with pytest.raises(TitanDataError, match="does not fit this dataloader"):
        loader(0, 0).load_state_dict({**state, "seed": 99})
    with pytest.raises(TitanDataError, match="corpus path does not exist"):
        loader(0, 0, dataset_path=str(tmp_path / "missing"))
    other = next(iter(loader(0, 0, seed=7)))[0]["input"]  # another window order (bench/titan.py --seed)
    assert {tuple(r.tolist()) for r in other} != rows[0, 0]
    held = first.held_out(2)
    assert len(held) == 2 and all((a[0]["input"] == b[0]["input"]).all() for a, b in zip(held, loader(1, 1).held_out(2)))
