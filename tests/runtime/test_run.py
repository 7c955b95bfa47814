"""Multi-process integration: `diloco run` with real torchrun groups, gRPC coordinator, TCP ring."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from diloco_helpers import free_port

from diloco import cli
from diloco.job.config import Config
from diloco.runtime.launch import launcher

pytestmark = pytest.mark.slow

SMALL = ["--n-layer", "1", "--n-embd", "64", "--block-size", "32", "--batch-size", "8",
         "--eval-batches", "4", "--warmup-steps", "5", "--no-progress"]


def test_two_groups_of_two_ranks_stay_bit_identical_and_learn(tmp_path):
    out = tmp_path / "summary.json"
    ckpt = tmp_path / "global.pt"
    code = cli.main(["run", *SMALL, "--steps", "40", "--h", "10", "--groups", "2",
                     "--ranks-per-group", "2", "--backend", "gloo", "--json", str(out), "--run-dir", str(tmp_path / "run"),
                     "--save", str(ckpt), "--probe-bytes", "0"])
    assert code == 0
    s = json.loads(out.read_text())
    from diloco.engine.outer_state import params_hash
    from diloco.runtime.checkpoints import checkpoint

    state = checkpoint.load(ckpt)
    assert params_hash(list(state["global"].values())) == s["param_hash_per_group"]["0"]
    assert s["outer_rounds"] == 4 and s["periods"] == [10, 10, 10, 10]
    hashes = s["round_hashes_per_group"]
    assert len(hashes) == 2 and len(hashes["0"]) == 4
    assert hashes["0"] == hashes["1"], "groups disagree on the global parameters after some round"
    assert len(set(hashes["0"])) == 4, "the global parameters did not change between rounds"
    assert s["params_identical"] and not s["divergence"]
    assert s["eval_loss"] < s["initial_eval_loss"] - 0.5
    # fp32 ring, G=2: each group sends half the vector twice (reduce-scatter + all-gather) per round
    payload = 2 * 4 * s["num_parameters"] * s["outer_rounds"]
    assert payload <= s["bytes_sent"] <= payload * 1.05
    assert s["dp_bytes"] == 2 * 4 * s["num_parameters"] * 40
    # fp32 every 10 steps between 2 groups: 64 bits / 10 steps, plus framing; data parallel: 64
    assert s["dp_bits_per_param_per_step"] == 64
    assert 6.4 <= s["bits_per_param_per_step"] <= 6.4 * 1.05


def test_qsr_schedule_runs_and_grows_h(tmp_path):
    out = tmp_path / "s.json"
    code = cli.main(["run", *SMALL, "--steps", "60", "--schedule", "qsr", "--h", "5", "--qsr-alpha",
                     "0.003", "--inner-lr", "0.002", "--groups", "2", "--ranks-per-group", "1",
                     "--json", str(out), "--run-dir", str(tmp_path / "run")])
    assert code == 0
    s = json.loads(out.read_text())
    assert sum(s["periods"]) == 60
    assert s["periods"][0] == 5 and max(s["periods"]) > 5
    assert s["round_hashes_per_group"]["0"] == s["round_hashes_per_group"]["1"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--h", "0"], "--h must be >= 1"),
        (["--merge-alpha", "1.5"], "--merge-alpha must be in [0, 1]"),
        (["--qsr-alpha", "-0.1"], "--qsr-alpha must be in [0, 1] (or -1"),
        (["--codec", "int8", "--codec-fast", "true"], "--codec-fast applies to the 4-bit codecs"),
        (["--data", "/nonexistent/corpus"], "does not exist"),
        (["--n-embd", "30", "--n-head", "4"], "multiple of --n-head"),
    ],
)
def test_invalid_settings_fail_before_any_process(args, message, capsys, monkeypatch):
    monkeypatch.setattr(launcher, "_spawn_group", lambda *a, **k: pytest.fail("a process was started"))
    assert cli.main(["run", "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err


def test_unknown_optimizer_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--inner-optimizer", "lion"])
    assert e.value.code == 2
    assert "invalid choice: 'lion'" in capsys.readouterr().err


def test_more_groups_than_the_data_can_feed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launcher, "_spawn_group", lambda *a, **k: pytest.fail("a process was started"))
    (tmp_path / "tiny.txt").write_text("to be or not to be " * 40)
    assert cli.main(["run", "--no-progress", "--data", str(tmp_path), "--groups", "8"]) == 2
    assert "cannot feed 8 shard(s)" in capsys.readouterr().err


def test_config_file_and_flag_override(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[sync]\nschedule = "qsr"\nh = 12\n[topology]\ngroups = 3\n')
    args = cli.build_parser().parse_args(["run", "--config", str(path), "--h", "7"])
    from diloco.job.config_parse import from_args

    cfg = from_args(args)
    assert (cfg.sync.schedule, cfg.sync.h, cfg.topology.groups) == ("qsr", 7, 3)
    path.write_text("[sync]\nbogus = 1\n")
    with pytest.raises(ValueError, match="unknown setting sync.bogus"):
        from_args(cli.build_parser().parse_args(["run", "--config", str(path)]))


def test_worker_that_cannot_reach_the_coordinator_fails_within_its_deadline():
    env = dict(os.environ, DILOCO_SECRET="ab" * 32)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "diloco", "worker", "--coordinator", f"127.0.0.1:{free_port()}", "--group-id", "0",
           "--ranks-per-group", "1", "--timeout", "3", *SMALL[:-1]]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "cannot reach coordinator" in proc.stdout + proc.stderr
    assert time.monotonic() - start < 60


def _pids_with(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(d.name))
            except OSError:  # the process ended while we listed /proc
                pass
    return pids


def test_a_group_killed_with_no_restarts_left_stops_every_process(tmp_path):
    """With --max-restarts 0 a lost group ends the run (with restarts it heals: test_churn.py)."""
    cfg = Config()
    cfg.fault.max_restarts = 0
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.block_size = 1, 64, 32
    cfg.data.batch_size, cfg.data.eval_batches = 8, 4
    cfg.train.steps, cfg.sync.h, cfg.topology.ranks_per_group = 100000, 10, 1
    cfg.transport.timeout_s = 10.0
    run_dir = tmp_path / "run"
    result: dict = {}

    def target():
        try:
            launcher.run(cfg, run_dir=str(run_dir), progress=False, timeout_s=120)
        except Exception as e:  # the expected outcome
            result["error"] = e

    t = threading.Thread(target=target)
    t.start()
    deadline = time.monotonic() + 60
    victims: list[int] = []
    while time.monotonic() < deadline and not victims:
        log = run_dir / "group-1.log"
        if log.exists() and (run_dir / "group-0.log").exists():
            victims = [p for p in _pids_with(str(run_dir)) if p != os.getpid()]
            victims = [p for p in victims if "--group-id 1" in Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()]
        time.sleep(0.5)
    assert victims, "group 1 never started"
    while time.monotonic() < deadline + 60 and "committed data samples" not in log.read_text(errors="replace"):
        time.sleep(0.2)  # let training begin: group 1 committed an exchange
    assert "committed data samples" in log.read_text(errors="replace"), "group 1 never trained"
    for p in victims:
        try:
            os.kill(p, 9)
        except ProcessLookupError:  # already gone
            pass
    t.join(90)
    assert not t.is_alive()
    assert isinstance(result.get("error"), launcher.LaunchError)
    assert "group 1 exited" in str(result["error"])
    time.sleep(1)
    leftovers = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:300] for p in _pids_with(str(run_dir))}
    assert leftovers == {}


@pytest.mark.parametrize("mode", ["overlap", "eager"])
def test_streaming_modes_end_to_end(tmp_path, mode):
    out = tmp_path / "s.json"
    code = cli.main(["run", *SMALL, "--n-layer", "2", "--steps", "40", "--h", "10", "--mode", mode,
                     "--fragments", "2", "--groups", "2", "--ranks-per-group", "1",
                     "--json", str(out), "--run-dir", str(tmp_path / "run")])
    assert code == 0
    s = json.loads(out.read_text())
    # fragment 0 syncs at 5, 15, 25, 35 and, capped by the end, 40; fragment 1 at 10, 20, 30, 40
    assert s["outer_rounds"] == 9
    hashes = s["round_hashes_per_group"]
    assert hashes["0"] == hashes["1"] and s["params_identical"]
    if mode == "overlap":  # a hash after each of the 7 in-loop commits and after finish()
        assert len(hashes["0"]) == 8
    assert s["eval_loss"] < s["initial_eval_loss"] - 0.5
    assert 0 < s["utilization"] <= 1


def test_a_data_plane_process_trains_exactly_as_the_in_process_one(tmp_path):
    """--data-plane process (each rank's transport in a child process): the same global
    parameters after every round as the default, with stripes over 2 ranks, overlapped
    fragments and a quantized codec."""
    hashes = {}
    for plane in ("thread", "process"):
        out = tmp_path / f"{plane}.json"
        code = cli.main(["run", *SMALL, "--n-layer", "2", "--steps", "20", "--h", "10", "--mode", "overlap", "--fragments", "2",
                         "--codec", "int8", "--groups", "2", "--ranks-per-group", "2", "--backend", "gloo", "--data-plane", plane,
                         "--json", str(out), "--run-dir", str(tmp_path / plane)])
        assert code == 0
        s = json.loads(out.read_text())
        assert s["params_identical"]
        hashes[plane] = s["round_hashes_per_group"]["0"]
    assert hashes["process"] == hashes["thread"]
    config = json.loads((tmp_path / "process" / "config.json").read_text())
    assert config["transport"]["data_plane"] == "process"


def test_groups_of_different_sizes_stay_bit_identical(tmp_path):
    out = tmp_path / "s.json"
    code = cli.main(["run", *SMALL, "--steps", "20", "--h", "10", "--groups", "2", "--group-sizes", "2,1", "--backend", "gloo",
                     "--json", str(out), "--run-dir", str(tmp_path / "run")])
    assert code == 0
    s = json.loads(out.read_text())
    assert s["ranks_per_group"] == [2, 1]
    assert s["round_hashes_per_group"]["0"] == s["round_hashes_per_group"]["1"] and s["params_identical"]


def test_int4_over_grpc_with_mutual_tls(tmp_path):
    from transport.certs import write_pki

    tls = write_pki(tmp_path / "pki", ["peer"])["peer"]
    out = tmp_path / "s.json"
    args = ["run", *SMALL, "--steps", "20", "--h", "10", "--groups", "2", "--ranks-per-group", "1",
            "--probe-bytes", "0", "--link", "grpc", "--codec", "int4",
            "--tls-cert", tls.cert_file, "--tls-key", tls.key_file, "--tls-ca", tls.ca_file,
            "--json", str(out), "--run-dir", str(tmp_path / "run")]
    assert cli.main(args) == 0
    s = json.loads(out.read_text())
    assert s["params_identical"] and s["outer_rounds"] == 2
    fp32_payload = 2 * 4 * s["num_parameters"] * s["outer_rounds"]
    # int4 with its scales, not fp32; plus the initial-parameter check (64 fp32 values, framed)
    assert s["bytes_sent"] < fp32_payload * 4.4 / 32 + 4096
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["transport"]["link"] == "grpc" and config["transport"]["codec"] == "int4"


def test_failure_report_shows_the_workers_error_line_before_torchrun_noise(tmp_path):
    log = tmp_path / "group-1.log"
    log.write_text("starting\ndiloco worker (group 1, rank 0): CollectiveAborted: peer 10.0.0.2 gone\n"
                   + "torchrun traceback line\n" * 40)
    assert launcher.GroupProcess(1, None, log).tail() == "diloco worker (group 1, rank 0): CollectiveAborted: peer 10.0.0.2 gone"
    plain = tmp_path / "group-0.log"
    plain.write_text("\n".join(f"line {i}" for i in range(30)))
    assert launcher.GroupProcess(0, None, plain).tail(3) == "line 27\nline 28\nline 29"


def test_summary_states_bits_per_parameter_per_step_beside_data_parallel() -> None:
    from diloco.runtime.launch.summary import bits_per_param_per_step, dp_bytes

    assert bits_per_param_per_step(dp_bytes(1000, 2, 7), 1000, 7) == 64  # DP, two groups
    assert bits_per_param_per_step(dp_bytes(1000, 4, 7), 1000, 7) == 192  # 64 (G-1)
    assert bits_per_param_per_step(125, 1000, 20) == 0.05  # 1000 bits over 1000 params x 20 steps
    assert bits_per_param_per_step(10, 1000, 0) == 0.0
