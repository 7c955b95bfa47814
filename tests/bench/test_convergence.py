"""bench/convergence.py: record schema, row selection, the bits-per-parameter formula, equal tokens,
the sweep's winners, and one tiny end-to-end row per family (a few steps of a 1-layer GPT)."""

import importlib
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
conv = importlib.import_module("bench.convergence")  # a module of the package bench, as ENTRY (bench.convergence_run) is
catalogue = importlib.import_module("bench.convergence_rows")

TINY = conv.Size("tiny", n_layer=2, n_embd=32, steps=12, block=32, batch=8, seeds=1)
FIELDS = {"mode", "codec", "groups", "h", "fragments", "seed", "tokens", "eval_loss", "bytes_sent", "syncs",
          "curve", "bits_per_param_per_step", "row", "stage", "size", "num_parameters", "steps", "inner_lr",
          "overlap_steps", "path"}


def tiny_record(row: conv.Row) -> dict:
    cfg = conv.make_config(TINY, row, seed=3, lrs=conv.Settings(), eval_batches=2)
    return conv.make_record(TINY, row, 3, cfg, conv.run_in_process(cfg))


@pytest.fixture(scope="module")
def records() -> dict:
    rows = [conv.Row("dp", mode="dp", groups=2, h=1), conv.Row("m2-h4", groups=2, h=4),
            conv.Row("overlap-fp4", mode="overlap", groups=2, h=4, fragments=2, tau=1, codec=catalogue.spec("fp4-e2m1"))]
    return {r.name: tiny_record(r) for r in rows}


def test_tiny_rows_train_and_carry_every_field(records):
    for name, rec in records.items():
        assert FIELDS <= set(rec), (name, FIELDS - set(rec))
        assert math.isfinite(rec["eval_loss"]) and rec["eval_loss"] < rec["initial_eval_loss"], name
        assert rec["bytes_sent"] > 0 and rec["params_identical"], name
        assert rec["tokens"] == TINY.steps * TINY.batch * TINY.block, name  # equal tokens
        curve = rec["curve"]
        assert curve[0]["step"] == 0 and curve[-1]["step"] == TINY.steps and len(curve) >= 3
        assert curve[-1]["eval_loss"] == rec["eval_loss"] and curve[-1]["bytes"] == rec["bytes_sent"]
        assert [p["bytes"] for p in curve] == sorted(p["bytes"] for p in curve)
        json.dumps(rec)  # JSON-serializable
    dp, m2 = records["dp"], records["m2-h4"]
    assert dp["mode"] == "dp" and dp["h"] == 1 and dp["syncs"] == TINY.steps
    assert m2["mode"] == "blocking" and m2["syncs"] == TINY.steps // 4 and m2["periods"] == [4, 4]
    assert records["overlap-fp4"]["fragments"] == 2 and records["overlap-fp4"]["overlap_steps"] == 1
    # measured bytes: data parallel's fp32 ring is 64 bits/param/step with 2 groups, plus framing
    assert 64 <= dp["bits_per_param_per_step"] < 64 * 1.01
    assert m2["bits_per_param_per_step"] < dp["bits_per_param_per_step"] / 3
    assert records["overlap-fp4"]["bytes_sent"] < m2["bytes_sent"] / 4  # 4-bit codes against fp32


def test_bits_per_param_per_step_on_a_hand_case():
    n, steps, groups = 1000, 10, 2
    ring_fp32 = 2 * (groups - 1) * 4 * n * steps  # what a fp32 ring all-reduce moves, all groups together
    result = {"tokens": 0, "num_parameters": n, "eval_loss": 1.0, "initial_eval_loss": 2.0, "bytes_sent": ring_fp32,
              "syncs": steps, "periods": [], "params_identical": True, "seconds": 0.0, "path": "in-process",
              "curve": []}
    size = replace(TINY, steps=steps)
    row = conv.Row("dp", mode="dp", groups=2, h=1)
    cfg = conv.make_config(size, row, 1, conv.Settings())
    assert conv.make_record(size, row, 1, cfg, result)["bits_per_param_per_step"] == 64
    result["bytes_sent"] = 125  # 1000 bits over 1000 parameters x 10 steps
    assert conv.make_record(size, row, 1, cfg, result)["bits_per_param_per_step"] == 0.1


def test_quick_selects_its_rows_one_seed_no_sweep():
    [(size, sweeps, rows)] = conv.plan(conv.parse_args(["--quick"]))
    assert [r.name for r in rows] == list(conv.QUICK_ROWS)
    assert sweeps == [] and size.name == "small" and size.seeds == 1 and size.steps == conv.QUICK_SIZE.steps
    assert {r.mode for r in rows} >= {"dp", "blocking", "overlap", "eager"}
    assert {r.codec.codec for r in rows} >= {"fp32", "int4"}
    assert all(conv.seeds_for(size, r, 1) == [1] for r in rows)
    [(_, _, only)] = conv.plan(conv.parse_args(["--quick", "--only", "dp,m2-*"]))
    assert [r.name for r in only] == ["dp", "m2-h30", "m2-h30-int4"]


def test_full_plan_covers_the_issue_rows_at_equal_tokens():
    plans = {size.name: (size, sweeps, rows) for size, sweeps, rows in conv.plan(conv.parse_args([]))}
    assert set(plans) == {"small", "medium"}
    _, sweeps, rows = plans["small"]
    names = {r.name for r in rows}
    assert {f"m{m}-h{h}" for m in (1, 2, 4) for h in (10, 30, 100)} <= names
    assert {r.codec.codec for r in rows} == set(catalogue.CODECS) | {"int2", "sign1", "topk"}
    assert {"dp", "streaming-p2", "overlap-p2-tau5", "eager", "co2", "qsr"} <= names
    assert {r.name for r in sweeps if r.family == "dp"} and any(r.outer for r in sweeps)
    medium_size, medium_sweeps, medium_rows = plans["medium"]
    assert {r.name for r in medium_rows} == set(medium_size.rows) and any(r.outer for r in medium_sweeps)
    for size, _, rows in plans.values():
        tokens = {conv.make_config(size, r, 1, conv.Settings()).data.batch_size * r.groups for r in rows}
        assert tokens == {size.batch}, size.name  # every row: the same sequences per step, all groups together


def test_large_size_sweeps_its_own_and_its_long_rows_use_them():
    [(large, sweeps, rows)] = conv.plan(conv.parse_args(["--sizes", "large"]))
    assert rows == [] and {r.name for r in sweeps} == {
        *(f"sweep-{f}-lr{lr:g}" for f in ("dp", "diloco") for lr in large.inner_lrs),
        *(f"sweep-outer-lr{o[0]:g}-mom{o[1]:g}" for o in large.outer_sweep)}
    [(long, long_sweeps, long_rows)] = conv.plan(conv.parse_args(["--sizes", "large-long"]))
    assert long.tuned_on == "large" and long_sweeps == [] and {r.name for r in long_rows} == set(long.rows)
    assert (long.n_layer, long.n_embd) == (large.n_layer, large.n_embd)
    cfg = conv.make_config(long, long_rows[0], 1, conv.Settings())
    from diloco.demo.model import GPT, GPTConfig
    model = GPT(GPTConfig(256, cfg.model.block_size, cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd))
    assert sum(p.numel() for p in model.parameters()) >= 5_000_000  # issue 51: a 5M+ model
    recs = [fake("large", "sweep-diloco-lr0.002", 2.1, lr=2e-3), fake("large", "sweep-diloco-lr0.001", 2.2),
            fake("large", "sweep-outer-lr0.7-mom0.5", 2.0)]
    s = conv.settings_from(recs, "large-long", conv.parse_args([]))
    assert (s.diloco_lr, s.outer, s.source["outer"]) == (2e-3, (0.7, 0.5), "sweep of large, eval 2.0000")


def fake(size, row, loss, seed=1, lr=1e-3, **kw):
    return {"size": size, "row": row, "seed": seed, "eval_loss": loss, "inner_lr": lr, "stage": "sweep", **kw}


def test_sweep_winners_feed_the_study_rows():
    recs = [fake("small", "sweep-dp-lr0.001", 2.0), fake("small", "sweep-dp-lr0.002", 1.9, lr=2e-3),
            fake("small", "sweep-diloco-lr0.001", 2.1), fake("small", "sweep-diloco-lr0.004", 2.2, lr=4e-3),
            fake("small", "sweep-outer-lr0.4-mom0.9", 2.05), fake("small", "sweep-outer-lr1-mom0.9", 2.3),
            fake("medium", "sweep-diloco-lr0.004", 1.5, lr=4e-3)]
    none = conv.parse_args([])
    s = conv.settings_from(recs, "small", none)
    assert (s.dp_lr, s.diloco_lr, s.outer) == (2e-3, 1e-3, (0.4, 0.9))
    m = conv.settings_from(recs, "medium", none)  # its own sweeps only: no outer sweep of its own yet, the default
    assert (m.dp_lr, m.diloco_lr, m.outer) == (1e-3, 4e-3, conv.DEFAULT_OUTER)
    recs += [fake("medium", "sweep-outer-lr1-mom0.8", 1.45), fake("medium", "sweep-outer-lr0.7-mom0.5", 1.48)]
    m = conv.settings_from(recs, "medium", none)  # its own outer winner, not the small model's
    assert (m.outer, m.source["outer"]) == ((1.0, 0.8), "sweep, eval 1.4500")
    long = conv.settings_from(recs, "medium-xlong", none)  # tuned_on medium: medium's winners
    assert (long.diloco_lr, long.outer, long.source["outer"]) == (4e-3, (1.0, 0.8), "sweep of medium, eval 1.4500")
    recs.append(fake("small", "sweep-outer-lr0.4-mom0.9", 2.5, seed=2))  # mean 2.275: the default wins
    assert conv.settings_from(recs, "small", none).outer == conv.DEFAULT_OUTER
    flags = conv.settings_from(recs, "small", conv.parse_args(["--diloco-lr", "3e-3", "--outer-lr", "0.5"]))
    assert (flags.diloco_lr, flags.outer) == (3e-3, (0.5, 0.9))


def test_table_and_qsr_report_from_records():
    base = dict(stage="study", mode="blocking", groups=2, fragments=1, overlap_steps=0, codec="fp32", inner_lr=1e-3,
                outer_lr=0.7, outer_momentum=0.9, bytes_sent=10, bits_per_param_per_step=1.0, schedule="fixed")
    recs = [dict(base, size="small", row="dp", seed=1, eval_loss=2.0, mode="dp", h=1, syncs=100, outer_lr=None),
            dict(base, size="small", row="m2-h10", seed=1, eval_loss=2.04, h=10, syncs=10),
            dict(base, size="small", row="m2-h30", seed=1, eval_loss=2.01, h=30, syncs=3),
            dict(base, size="small", row="m2-h30", seed=2, eval_loss=2.03, h=30, syncs=3),
            dict(base, size="small", row="qsr", seed=1, eval_loss=2.03, h=10, syncs=4, schedule="qsr")]
    text = conv.table(recs)
    assert "| small | m2-h30 | blocking | 2 | 30 |" in text and "2.0200 ± 0.0141 | +1.00%" in text
    assert "qsr 10" in text
    assert "bits/param/step per group |" in text.splitlines()[0]
    assert text.splitlines()[3].endswith("| 0.5 |")  # the records' 1.0 bits for both groups: 0.5 a group
    # QSR (2.03) is at least as good as H=10 only (H=30 is better): it matches H=10 with 6 fewer syncs
    [line] = conv.qsr_report(recs)
    assert "fixed H=10 reaches 2.0400 with 10 syncs: 6 syncs saved (60%)" in line, line
    assert "H=30: 2.0200 (+0.50% for QSR) with 3 syncs" in line, line


def test_a_run_prints_the_tables_of_its_sizes_only(tmp_path, monkeypatch, capsys):
    def rec(size, row, loss):
        return dict(stage="study", size=size, row=row, seed=1, mode="blocking", groups=2, h=30, fragments=1,
                    overlap_steps=0, codec="fp32", inner_lr=1e-3, outer_lr=0.7, outer_momentum=0.7, eval_loss=loss,
                    bytes_sent=10, syncs=3, bits_per_param_per_step=1.0, schedule="fixed")
    recs = [rec("small", "m2-h30-outer", 2.0), rec("large-long", "m2-h30-outer", 1.4)]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(recs))
    monkeypatch.setattr(conv, "run_study", lambda a: recs)  # the run itself is tested above
    monkeypatch.setattr(conv, "plot", lambda records, png: False)
    assert conv.main(["--sizes", "large-long", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| large-long | m2-h30-outer |" in out and "| small |" not in out
    assert conv.main(["--table", "--json", str(path)]) == 0  # --table: the whole file
    out = capsys.readouterr().out
    assert "| large-long | m2-h30-outer |" in out and "| small | m2-h30-outer |" in out
