"""Reading ``bench/sync_stall.py``'s records: the sync after the last group's arrival, a case's
summary (medians, page faults, bytes and wire floor), and the tables of bench/pages/sync_stall.md
(``--report``, ``--ab-report``). Also what the records are measured on: the GPT's shape and the links."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

MODEL = {"vocab_size": 256, "block_size": 256, "n_layer": 6, "n_head": 8, "n_embd": 512}  # 19.3M parameters
LINKS = {"loopback": None, "veth": "unshaped", "1gbit": 1000.0, "100mbit": 100.0}


def _param_shapes():
    import torch

    from diloco.demo.model import GPT, GPTConfig

    with torch.device("meta"):
        return list(GPT(GPTConfig(**MODEL)).parameters())


def sync_after_last(case: dict, warmup: int) -> list[float]:
    """Per counted round and member: seconds from the last group's arrival at the sync (the latest
    ``start``: the groups' skew, which only waits for the slowest, left out) to this member's end."""
    members = case["members"]
    out = []
    for r in range(warmup, len(members[0]["rounds"])):
        last = max(m["rounds"][r]["start"] for m in members)
        out.extend(m["rounds"][r]["end"] - last for m in members)
    return out


def summarize(case: dict, warmup: int) -> dict:
    """Median stall per round over every member's counted rounds (the skew between groups in it),
    the sync from the last group's arrival (``sync_after_last``), and the spans' medians."""
    counted = [r for m in case["members"] for r in m["rounds"][warmup:]]
    stalls = [r["stall_s"] for r in counted]
    after = sync_after_last(case, warmup)
    row = {"stall_median_s": statistics.median(stalls), "stall_min_s": min(stalls), "stall_max_s": max(stalls),
           "after_last_median_s": statistics.median(after), "after_last_min_s": min(after),
           "after_last_max_s": max(after),
           "cpu_per_wall": statistics.median(r["cpu_s"] / r["stall_s"] for r in counted), "samples": len(stalls)}
    if all("page_faults" in r for r in counted):
        row["page_faults_median"] = statistics.median(r["page_faults"] for r in counted)
    n = sum(v.numel() for v in _param_shapes())
    g = case["groups"]
    row["fp32_ring_bytes"] = 2 * (g - 1) / g * 4 * n  # what each member of an fp32 ring sends per round
    sent = [b - a for m in case["members"] for a, b in zip([r.get("bytes_sent") for r in m["rounds"][warmup - 1:]],
                                                         [r.get("bytes_sent") for r in m["rounds"][warmup:]])
            if a is not None and b is not None]
    if sent:
        row["bytes_sent_per_round"] = statistics.median(sent)
    rate = LINKS[case["link"]]
    if isinstance(rate, float):
        row["wire_floor_s"] = row.get("bytes_sent_per_round", row["fp32_ring_bytes"]) * 8 / (rate * 1e6)
    keys = sorted({k for r in counted for k in r.get("spans", {})})
    row["spans_median_s"] = {k: statistics.median(r["spans"].get(k, 0.0) for r in counted) for k in keys}
    return row


PHASES = ["delta", "hash", "norm", "quorum", "rings", "vote", "land", "outer", "merge"]


def report(paths: list[str]) -> str:
    """Markdown tables from records of this bench: per link and group count, the sync from the last
    group's arrival (median over members, rounds and repeats; the repeats' medians beside it) for
    Gloo and each project codec, the ratio to Gloo's, and the project's phases (medians)."""
    cases = [c for path in paths for c in json.loads(Path(path).read_text())["cases"]]
    keys = sorted({(c["link"], c["groups"]) for c in cases}, key=lambda k: (list(LINKS).index(k[0]), k[1]))
    lines = ["| link | G | sync | after last arrival, s (median [min, max]) | per repeat | / Gloo | wire floor, s |"
             " " + " | ".join(PHASES) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(PHASES)]
    for link, g in keys:
        here = [c for c in cases if (c["link"], c["groups"]) == (link, g)]
        gloo = [c for c in here if c["backend"] == "gloo"]
        gloo_all = [x for c in gloo for x in sync_after_last(c, WARMUP)]
        base = statistics.median(gloo_all) if gloo_all else None
        for name in dict.fromkeys(("gloo", *(c["codec"] for c in here if c["backend"] == "diloco"))):
            mine = gloo if name == "gloo" else [c for c in here if c["backend"] == "diloco" and c["codec"] == name]
            if not mine:
                continue
            xs = [x for c in mine for x in sync_after_last(c, WARMUP)]
            per = ", ".join(f"{statistics.median(sync_after_last(c, WARMUP)):.3f}" for c in mine)
            med = statistics.median(xs)
            ratio = "" if base is None else f"{med / base:.2f}"
            floor = summarize(mine[0], WARMUP).get("wire_floor_s")
            spans = [] if name == "gloo" else [statistics.median(r["spans"].get(k, 0.0) for c in mine
                                                                 for m in c["members"] for r in m["rounds"][WARMUP:])
                                               for k in PHASES]
            label = "Gloo DiLoCo" if name == "gloo" else f"diloco {name}"
            lines.append(f"| {link} | {g} | {label} | {med:.3f} [{min(xs):.3f}, {max(xs):.3f}] | {per} | {ratio} | "
                         f"{'' if floor is None else f'{floor:.3f}'} | "
                         + " | ".join(f"{v:.3f}" for v in spans) + (" |" if spans else " |" * len(PHASES)))
    return "\n".join(lines)


WARMUP = 1  # rounds every record of this bench leaves out (--warmup's default)


def ab_report(path: str) -> str:
    """The before/after table of a record of interleaved runs on two trees (sync_stall_ab.json):
    per link and group count, each run's Gloo and project sync after the last arrival (medians)
    and their ratio, and the ratios' mean per tree; with page faults recorded, the project's
    median per stall in each tree's runs."""
    record = json.loads(Path(path).read_text())
    trees = list(dict.fromkeys(run["tree"] for run in record["runs"]))
    rows: dict[tuple[str, int], dict[str, list[tuple[float, float]]]] = {}
    faults: dict[tuple[str, int], dict[str, list[float]]] = {}
    for run in record["runs"]:
        for c in run["cases"]:
            if c["backend"] == "gloo":
                mine = [d for d in run["cases"] if d["backend"] == "diloco" and d["codec"] == "fp32"
                        and (d["link"], d["groups"]) == (c["link"], c["groups"])]
                if mine:
                    pair = (statistics.median(sync_after_last(c, WARMUP)), statistics.median(sync_after_last(mine[0], WARMUP)))
                    rows.setdefault((c["link"], c["groups"]), {}).setdefault(run["tree"], []).append(pair)
                    counted = [r["page_faults"] for m in mine[0]["members"] for r in m["rounds"][WARMUP:]
                               if "page_faults" in r]
                    if counted:
                        faults.setdefault((c["link"], c["groups"]), {}).setdefault(run["tree"], []).append(
                            statistics.median(counted))
    head = " | ".join(f"{t}: Gloo / diloco fp32, s (ratio), per run" for t in trees)
    pf_head = " | diloco page faults per stall (median), per run" if faults else ""
    lines = [f"| link | G | {head} | ratio, mean of runs{pf_head} |",
             "|---|---|" + "---|" * len(trees) + "---|" + ("---|" if faults else "")]
    for (link, g), by_tree in rows.items():
        cells = [", ".join(f"{a:.3f} / {b:.3f} ({b / a:.2f})" for a, b in by_tree.get(t, [])) for t in trees]
        means = " -> ".join(f"{statistics.mean(b / a for a, b in by_tree[t]):.2f}" for t in trees if t in by_tree)
        pf = faults.get((link, g), {})
        pf_cell = (" | " + " -> ".join(", ".join(f"{v:,.0f}" for v in pf[t]) for t in trees if t in pf)) if faults else ""
        lines.append(f"| {link} | {g} | " + " | ".join(cells) + f" | {means}{pf_cell} |")
    return "\n".join(lines)
