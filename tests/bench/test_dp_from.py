"""``--dp-from`` of bench/hf.py and bench/titan.py (bench/benchutil.py: dp_result_from): the reused
data-parallel result is the last record that matches, and a file that cannot serve stops the bench
with its reason before any run."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
benchutil = importlib.import_module("bench.benchutil")

SAME = ("steps", "seed")


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "records.json"
    path.write_text(text)
    return str(path)


def test_the_last_matching_record_is_reused_with_where_it_came_from(tmp_path):
    records = [{"steps": 100, "seed": 1, "command": "first", "dp": {"eval_loss": 2.0}},
               {"steps": 100, "seed": 2, "command": "other seed", "dp": {"eval_loss": 9.0}},
               {"steps": 100, "seed": 1, "command": "second", "dp": {"eval_loss": 1.5}},
               {"steps": 100, "seed": 1, "command": "third", "dp": {"eval_loss": 1.4, "from": "an older run"}}]
    path = _write(tmp_path, json.dumps(records))
    got = benchutil.dp_result_from(path, {"steps": 100, "seed": 1}, SAME, lambda r: r["dp"]["eval_loss"] > 1.45)
    assert got == {"eval_loss": 1.5, "from": f"{path}: second"}
    assert benchutil.dp_result_from(path, {"steps": 100, "seed": 1}, SAME) == {"eval_loss": 1.4, "from": "an older run"}


@pytest.mark.parametrize("text, why", [
    (None, "cannot read a JSON list of records"),
    ("[{\"steps\": 1", "cannot read a JSON list of records"),
    ("\udcff", "cannot read a JSON list of records"),
    ("[" * 100_000 + "]" * 100_000, "cannot read a JSON list of records"),
    ("{\"steps\": 100}", "not a JSON list of bench records"),
    ("[3, {\"steps\": 100, \"seed\": 1}, {\"steps\": 100, \"seed\": 1, \"dp\": null}]",
     "no record with a \"dp\" result and the same steps, seed"),
    ("[{\"steps\": 200, \"seed\": 1, \"dp\": {}}]", "no record with a \"dp\" result and the same steps, seed"),
])
def test_a_file_that_cannot_serve_says_why(tmp_path, text, why):
    if text is None:
        path = str(tmp_path / "missing.json")
    elif text == "\udcff":
        path = str(tmp_path / "binary.json")
        Path(path).write_bytes(b"\xff\xfe[")
    else:
        path = _write(tmp_path, text)
    with pytest.raises(SystemExit, match=f"--dp-from {path}: {why}"):
        benchutil.dp_result_from(path, {"steps": 100, "seed": 1}, SAME)


def test_hf_bench_stops_on_a_wrong_dp_from_before_it_trains(tmp_path):
    """bench/hf.py looks the record up before its DiLoCo run: it exits at once with the reason and
    has started no job (no run folder, nothing appended to --json)."""
    pytest.importorskip("transformers", reason="bench/hf.py needs the hf extra (pip install -e '.[hf]')")
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "hf.py"), "--quick", "--dp-from",
                           str(tmp_path / "missing.json"), "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"--dp-from {tmp_path / 'missing.json'}: cannot read a JSON list of records" in proc.stderr
    assert "diloco" not in proc.stdout and not out.exists()
