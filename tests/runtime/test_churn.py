"""A short churn drill in the suite: real `diloco run` processes SIGKILLed and restarted
(bench/churn.py runs the long one). Every target of the benchmark must hold."""

import argparse
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
CHURN = Path(__file__).resolve().parents[2] / "bench" / "churn.py"


def load_churn():
    spec = importlib.util.spec_from_file_location("bench_churn", CHURN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_three_kills_no_divergence_no_hang_no_leak_and_the_loss_goes_down():
    churn = load_churn()
    # 4,000 steps (about 40 s here): the monkey kills a group only once the last one healed back (a process
    # restart of seconds), so at 2,000 the job once ended before the third kill under the suite's two workers
    a = argparse.Namespace(kills=3, groups=3, steps=4000, h=10, heartbeat_timeout=2.0, collective_timeout=5.0,
                           gap_min=1.0, gap_max=2.0, pause_min=0.2, pause_max=1.0, seed=11, netns=False,
                           limit=240.0)
    r = churn.run(a)
    # rounds here last ~0.2 s (H=10 of a tiny model), so a healer's start that a loaded CI host delays by a
    # fraction of a second is one more committed round (seen once: 3, on a 2-core host under the whole suite);
    # bench/churn.py keeps the target of 2, measured on a quiet host
    assert churn.check(r, a, heal_rounds_target=churn.HEAL_ROUNDS_TARGET + 1) == [], r
    assert r["kills"] == 3 and r["heals"] >= 1 and r["committed_rounds"] >= 100


def test_corrupted_links_roll_exchanges_back_and_the_job_ends_identical(tmp_path):
    """``diloco run --chaos N --chaos-kinds corrupt``: each fault flips a bit of what one group
    receives (a relay in front of its data plane); the frame fails its checksum, the exchange rolls
    back and runs again; nothing restarts, nothing is counted twice, the groups end identical."""
    import json

    from diloco import cli

    out = tmp_path / "summary.json"
    code = cli.main(["run", "--n-layer", "1", "--n-embd", "32", "--block-size", "32", "--batch-size", "8",
                     "--eval-batches", "2", "--groups", "3", "--ranks-per-group", "1", "--steps", "900", "--h", "10",
                     "--chaos", "2", "--chaos-kinds", "corrupt", "--heartbeat-timeout", "1", "--timeout", "5",
                     "--probe-bytes", "0", "--no-progress", "--json", str(out), "--run-dir", str(tmp_path / "run")])
    assert code == 0
    s = json.loads(out.read_text())
    f = s["fault"]
    # the drill spaces its faults 1-3 s apart and stops at 80 % of the steps: on a fast machine the second
    # may not fit in this 10-second job (CI on a quiet machine: 1 of 2); each that fired rolled one back
    assert 1 <= f["corrupted"] <= 2 and f["rolled_back"] >= f["corrupted"], f
    assert f["kills"] == f["restarts"] == f["failures"] == 0, f
    bad = [e["reason"] for e in f["events"] if e["kind"] == "rolled_back"]
    assert bad and all("frame corrupted" in r or "checksum" in r or "authentic" in r for r in bad), bad
    assert s["params_identical"]
    assert all(d["twice"] == 0 and d["left_out"] == 0 for d in s["data_per_group"].values())


def test_corrupt_faults_need_groups_of_one_rank():
    from diloco import cli

    assert cli.main(["run", "--groups", "2", "--ranks-per-group", "2", "--chaos", "1", "--chaos-kinds", "corrupt",
                     "--steps", "10", "--no-progress"]) == 2


def test_a_frozen_group_of_one_rank_heals_in_place_without_a_restart(tmp_path):
    """``--chaos-kinds stall``: a group frozen (SIGSTOP) for 2-3 heartbeat timeouts is declared
    failed; when it wakes, its process joins the job again and heals from a live group, with no
    exit and no restart; the groups end identical and every sample is trained once."""
    import json

    from diloco import cli

    out, run = tmp_path / "summary.json", tmp_path / "run"
    code = cli.main(["run", "--n-layer", "1", "--n-embd", "32", "--block-size", "32", "--batch-size", "8",
                     "--eval-batches", "2", "--groups", "3", "--ranks-per-group", "1", "--steps", "1200", "--h", "10",
                     "--chaos", "1", "--chaos-kinds", "stall", "--heartbeat-timeout", "1", "--quorum-grace", "0.5",
                     "--timeout", "5", "--probe-bytes", "0", "--no-progress", "--json", str(out), "--run-dir", str(run)])
    assert code == 0
    s = json.loads(out.read_text())
    f = s["fault"]
    assert f["frozen"] == 1 and f["failures"] >= 1 and f["heals"] >= 1, f
    assert f["restarts"] == f["kills"] == 0, f  # the same process healed: no exit, no restart
    logs = "".join(p.read_text() for p in run.glob("group-*.log"))
    assert "healing in place" in logs and "left the job" not in logs
    assert not list(run.glob("group-*.restart-*.log"))
    assert s["params_identical"]
    assert all(d["twice"] == 0 and d["left_out"] == 0 for d in s["data_per_group"].values())
