"""GPU placement of ranks on one host (diloco.runtime.rank.device_placement) and its wiring into `diloco run` and
the worker. Every GPU count here is made up: torch.cuda is faked, nothing touches CUDA."""

from collections import Counter

import pytest
import torch

from diloco import cli
from diloco.job.config import Config
from diloco.runtime.launch import launcher, summary
from diloco.runtime.rank import worker
from diloco.runtime.rank.device_placement import (
    DEVICE_MAP_ENV,
    GPU_OFFSET_ENV,
    PlacementError,
    parse_device_map,
    place_ranks,
    rank_cuda_index,
)

LAYOUTS = [[1], [2], [2, 2], [1, 1, 1], [4, 4, 4, 4], [2, 1, 3], [3, 1], [1, 2, 3, 4], [8, 8]]


def _check_invariants(plan, gpus: int, sizes: list[int]) -> None:
    assert plan.sizes == [min(n, gpus) for n in sizes]
    used = [i for d in plan.devices for i in d]
    assert all(0 <= i < gpus for i in used)
    for g, d in enumerate(plan.devices):
        assert len(set(d)) == len(d), f"two ranks of group {g} share a GPU: {d}"
        assert plan.device_map(g) is not None and parse_device_map(plan.device_map(g)) == list(d)
    if len(used) <= gpus:
        assert len(set(used)) == len(used), f"a GPU is used twice while others are free: {plan.devices}"
    load = Counter(used)
    per_gpu = [load.get(i, 0) for i in range(gpus)]
    assert max(per_gpu) - min(per_gpu) <= 1, f"uneven load {per_gpu} for {plan.devices}"


@pytest.mark.parametrize("gpus", [1, 2, 3, 8])
@pytest.mark.parametrize("sizes", LAYOUTS)
def test_placement_invariants_for_every_gpu_count(gpus, sizes):
    """fit=True: every layout is placed (cut to the GPU count where it must be)."""
    plan = place_ranks(gpus, sizes, backend="nccl", fit=True)
    _check_invariants(plan, gpus, sizes)
    assert plan.reduced == any(n > gpus for n in sizes)
    assert plan.requested == tuple(sizes)


@pytest.mark.parametrize("gpus", [1, 2, 3, 8])
@pytest.mark.parametrize("sizes", LAYOUTS)
def test_explicit_ranks_are_placed_as_asked_or_refused(gpus, sizes):
    """fit=False: a layout that fits is placed unchanged; one that does not is an error naming the numbers."""
    if max(sizes) <= gpus:
        plan = place_ranks(gpus, sizes, backend="nccl")
        _check_invariants(plan, gpus, sizes)
        assert not plan.reduced
        return
    with pytest.raises(PlacementError) as e:
        place_ranks(gpus, sizes, backend="nccl")
    g = next(g for g, n in enumerate(sizes) if n > gpus)
    message = str(e.value)
    assert f"group {g} has {sizes[g]} ranks" in message
    assert f"{gpus} GPU" in message and "--backend gloo" in message


def test_groups_are_spread_before_any_gpu_is_shared():
    assert place_ranks(2, [1, 1]).devices == ((0,), (1,))  # not both on cuda:0
    assert place_ranks(8, [2, 2, 2, 2]).devices == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert place_ranks(8, [2, 1, 3]).devices == ((0, 1), (2,), (3, 4, 5))
    assert place_ranks(3, [2, 2]).devices == ((0, 1), (2, 0))  # group 1 wraps, its ranks still distinct
    assert place_ranks(2, [2, 2, 2]).devices == ((0, 1), (0, 1), (0, 1))  # groups share GPUs: allowed


def test_one_gpu_default_topology_is_cut_and_said_so():
    """The issue's host: one GPU, the default 2 groups x 2 ranks."""
    plan = place_ranks(1, [2, 2], backend="nccl", fit=True)
    assert plan.devices == ((0,), (0,))
    assert plan.device_map(0) == plan.device_map(1) == "0"
    text = plan.describe()
    assert text.startswith("2 groups × 1 rank on 1 GPU")
    assert "reduced from 2" in text and "the host has 1 GPU" in text


def test_describe_lists_each_groups_gpus():
    text = place_ranks(4, [2, 2]).describe()
    assert text == "2 groups × 2 ranks on 4 GPUs: group 0 → cuda 0,1; group 1 → cuda 2,3"
    assert "up to 2 ranks" in place_ranks(2, [2, 2]).describe()
    assert "reduced" not in text


@pytest.mark.parametrize("gpus", [0, 1, 8])
def test_gloo_places_every_rank_on_the_cpu(gpus):
    plan = place_ranks(gpus, [2, 3], backend="gloo")
    assert plan.devices == ((None, None), (None, None, None))
    assert not plan.on_gpu and plan.device_map(0) is None and not plan.reduced
    assert "on CPU" in plan.describe()


@pytest.mark.parametrize("fit", [False, True])
def test_nccl_without_a_gpu_is_an_error(fit):
    with pytest.raises(PlacementError, match="0 GPUs.*--backend gloo"):
        place_ranks(0, [1, 1], backend="nccl", fit=fit)


@pytest.mark.parametrize("sizes, backend", [([], "nccl"), ([2, 0], "nccl"), ([1], "auto")])
def test_nonsense_input_is_refused(sizes, backend):
    with pytest.raises(PlacementError):
        place_ranks(2, sizes, backend=backend)


# --- the worker's rule: DILOCO_DEVICE_MAP, else LOCAL_RANK + DILOCO_GPU_OFFSET ---------------------

def test_rank_index_from_local_rank_offset_and_map():
    assert rank_cuda_index(1, 2, {}, group=0, rank=1) == 1
    assert rank_cuda_index(1, 8, {GPU_OFFSET_ENV: "4"}, group=1, rank=1) == 5
    assert rank_cuda_index(1, 8, {DEVICE_MAP_ENV: "6,3", GPU_OFFSET_ENV: "4"}, group=2, rank=1) == 3


@pytest.mark.parametrize("local_rank, gpus, env, expected", [
    (1, 1, {}, ["group 3 rank 1", "cuda:1", "1 GPU", "LOCAL_RANK 1"]),
    (0, 4, {GPU_OFFSET_ENV: "4"}, ["cuda:4", "4 GPUs", f"{GPU_OFFSET_ENV} 4"]),
    (0, 2, {DEVICE_MAP_ENV: "2,3"}, ["cuda:2", "2 GPUs", DEVICE_MAP_ENV]),
    (2, 8, {DEVICE_MAP_ENV: "0,1"}, ["lists only 2 GPUs"]),
    (0, 8, {DEVICE_MAP_ENV: "0,0"}, ["distinct"]),
    (0, 8, {DEVICE_MAP_ENV: "a"}, ["comma-separated"]),
    (0, 8, {GPU_OFFSET_ENV: "-1"}, [">= 0"]),
    (0, 0, {}, ["no GPU"]),
])
def test_rank_index_errors_name_the_numbers(local_rank, gpus, env, expected):
    with pytest.raises(PlacementError) as e:
        rank_cuda_index(local_rank, gpus, env, group=3, rank=1)
    for part in expected:
        assert part in str(e.value)


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda with a made-up GPU count; set_device records instead of touching CUDA."""
    current = []

    def use(gpus: int) -> list:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(torch.cuda, "set_device", current.append)
        return current

    monkeypatch.delenv(DEVICE_MAP_ENV, raising=False)
    monkeypatch.delenv(GPU_OFFSET_ENV, raising=False)
    return use


def test_worker_device_is_a_clear_error_past_the_hosts_gpus(fake_cuda):
    chosen = fake_cuda(1)
    with pytest.raises(PlacementError, match=r"group 0 rank 1 \(LOCAL_RANK 1\) would use GPU cuda:1 .* 1 GPU"):
        worker._device("nccl", 1, group=0, rank=1)
    assert chosen == [], "set_device was called for a GPU the host does not have"


def test_worker_device_follows_the_map_and_the_offset(fake_cuda, monkeypatch):
    chosen = fake_cuda(4)
    monkeypatch.setenv(GPU_OFFSET_ENV, "2")
    assert worker._device("nccl", 1, group=1, rank=1) == torch.device("cuda", 3)
    monkeypatch.setenv(DEVICE_MAP_ENV, "1,0")
    assert worker._device("nccl", 1, group=1, rank=1) == torch.device("cuda", 0)
    assert chosen == [torch.device("cuda", 3), torch.device("cuda", 0)]
    assert worker._device("gloo", 3, group=1, rank=3) == torch.device("cpu")


# --- diloco run -----------------------------------------------------------------------------------

def test_run_cuts_the_default_ranks_to_one_gpu(fake_cuda):
    fake_cuda(1)
    cfg = Config()
    fitted, plan = launcher.place_devices(cfg, fit_ranks=True)
    assert fitted.topology.sizes() == [1, 1] and cfg.topology.sizes() == [2, 2]  # the caller's config unchanged
    assert plan.device_map(0) == plan.device_map(1) == "0"
    with pytest.raises(PlacementError, match="group 0 has 2 ranks"):
        launcher.place_devices(cfg, fit_ranks=False)
    cfg.topology.backend = "gloo"
    same, plan = launcher.place_devices(cfg, fit_ranks=False)
    assert same is cfg and not plan.on_gpu


def test_run_with_nccl_and_no_gpu_stops_before_any_process(fake_cuda, monkeypatch, capsys):
    fake_cuda(0)
    monkeypatch.setattr(launcher, "_spawn_group", lambda *a, **k: pytest.fail("a process was started"))
    assert cli.main(["run", "--no-progress", "--backend", "nccl", "--groups", "2", "--ranks-per-group", "1"]) == 2
    assert "0 GPUs" in capsys.readouterr().err


def test_run_explicit_ranks_beyond_the_gpus_stop_before_any_process(fake_cuda, monkeypatch, capsys):
    fake_cuda(1)
    monkeypatch.setattr(launcher, "_spawn_group", lambda *a, **k: pytest.fail("a process was started"))
    assert cli.main(["run", "--no-progress", "--ranks-per-group", "2"]) == 2
    err = capsys.readouterr().err
    assert "this host has 1 GPU but group 0 has 2 ranks" in err and "--backend gloo" in err


def test_run_gives_each_group_its_gpus_and_says_so(fake_cuda, monkeypatch, tmp_path):
    """The default 2 ranks: placed as asked on a made-up 3-GPU host, cut to one on a 1-GPU host; the
    group's torchrun gets its GPUs in DILOCO_DEVICE_MAP and the config with the ranks it runs."""
    fake_cuda(3)
    spawned = {}

    def spawn(cfg_path, cfg, group, coordinator, env, run_dir, placement, **kw):
        spawned[group] = (cfg.topology.sizes()[group], env.get(DEVICE_MAP_ENV))
        raise launcher.LaunchError("stop here: nothing is started in this test")

    monkeypatch.setattr(launcher, "_spawn_group", spawn)
    assert cli.main(["run", "--no-progress", "--groups", "1", "--run-dir", str(tmp_path)]) == 1
    assert spawned == {0: (2, "0,1")}
    spawned.clear()
    fake_cuda(1)
    assert cli.main(["run", "--no-progress", "--groups", "1", "--run-dir", str(tmp_path)]) == 1
    assert spawned == {0: (1, "0")}, "the default 2 ranks were not cut to the host's one GPU"


def test_summary_shows_the_placement_line():
    s = {"eval_loss": 2.0, "initial_eval_loss": 5.0, "mode": "blocking", "fragments": 1, "outer_rounds": 1,
         "periods": [10], "inner_steps": 10, "groups": 2, "ranks_per_group": [1, 1], "num_parameters": 10,
         "bytes_sent": 1, "dp_bytes": 2, "reduction_vs_dp": 2.0, "params_identical": True,
         "param_hash_per_group": {"0": "a", "1": "a"}, "utilization": 1.0, "seconds": 1.0, "run_dir": "/x",
         "placement": place_ranks(1, [2, 2], fit=True).describe()}
    lines = summary.format_summary(s).splitlines()
    assert "  placement                : 2 groups × 1 rank on 1 GPU" in "\n".join(lines)
    assert lines.index(next(x for x in lines if "placement" in x)) == 1 + lines.index(
        next(x for x in lines if "groups (ranks each)" in x))

