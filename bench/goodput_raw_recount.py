#!/usr/bin/env python3
"""Independent recount of ``bench/goodput.py``'s fault case from the raw worker logs, written by a
reviewer to check the bench's own count (stdlib only; imports nothing of the project).

Usage: python3 bench/goodput_raw_recount.py KEEPDIR [KEEPDIR...] [--json OUT]
(each KEEPDIR is one repeat's folder under ``--keep``, with every-30s/ and twin-30s/). It prints, per
repeat, each group's ranges (each (group, range, round) once, at its first line) and whether they tile
[0, end), the common window, the tokens in and out of it, the goodput under four window conventions,
and the coordinator's stall and failure events; compare them with the bench's JSON."""
import sys, os, re, json
from datetime import datetime, timezone

LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z \S+ (\S+) \[worker group (\d+) rank (\d+)\] "
                  r"group (\d+) committed data samples \[(\d+), (\d+)\) at (\S+)(.*)$")
TOK_PER_SAMPLE = 32  # block_size 32: one sample = one sequence of 32 tokens (checked against config below)

def ts(s):
    return datetime.strptime(s + "Z", "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()

def log_order(name):
    m = re.match(r"group-(\d+)(?:\.restart-(\d+))?\.log$", name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None

def read_job(jobdir):
    run = os.path.join(jobdir, "run")
    files = sorted((f for f in os.listdir(run) if log_order(f)), key=log_order)
    first = {}   # (group, a, b, tag) -> (time, file, lineno, suffix)
    dup_lines = 0; other_lines = 0; earlier_later = 0
    for f in files:
        fg = log_order(f)[0]
        for n, line in enumerate(open(os.path.join(run, f), errors="replace")):
            if "committed data samples" not in line:
                continue
            m = LINE.match(line.rstrip("\n"))
            if not m:
                other_lines += 1; print("  UNPARSED", f, n, line[:160]); continue
            t = ts(m.group(1)); g = int(m.group(5)); rank = int(m.group(4))
            assert int(m.group(3)) == g == fg, (f, line)
            if rank != 0:
                other_lines += 1; continue
            key = (g, int(m.group(6)), int(m.group(7)), m.group(8))
            if key in first:
                dup_lines += 1
                if t < first[key][0]:
                    earlier_later += 1   # a re-log earlier than the first-read line
                    first[key] = (t, f, n, m.group(9))
            else:
                first[key] = (t, f, n, m.group(9))
    commits = sorted((v[0], k[0], k[1], k[2], k[3], v[3]) for k, v in first.items())
    return commits, dict(files=len(files), lines=len(first) + dup_lines, unique=len(first),
                         relogged=dup_lines, relog_earlier=earlier_later, other=other_lines)

def tiling(commits):
    per = {}
    for t, g, a, b, tag, suf in commits:
        per.setdefault(g, []).append((a, b, tag))
    out = {}
    for g, rs in sorted(per.items()):
        rs.sort()
        end = max(b for a, b, _ in rs)
        cover = [0] * end
        for a, b, _ in rs:
            for i in range(a, b): cover[i] += 1
        twice = sum(c - 1 for c in cover if c > 1); left = sum(1 for c in cover if c == 0)
        same_range_two_rounds = {}
        for a, b, tag in rs: same_range_two_rounds.setdefault((a, b), []).append(tag)
        multi = {k: v for k, v in same_range_two_rounds.items() if len(v) > 1}
        sizes = sorted(set(b - a for a, b, _ in rs))
        rounds = [int(re.search(r"/r(\d+)", tag).group(1)) for _, _, tag in rs]
        out[g] = dict(ranges=len(rs), end=end, committed=sum(b - a for a, b, _ in rs), twice=twice,
                      left_out=left, multi_round=multi, sizes=sizes, rounds=(min(rounds), max(rounds), len(set(rounds))))
    return out

def between(commits, t0, t1, lo_open=True, hi_closed=True):
    s = 0
    for c in commits:
        t = c[0]
        if (t > t0 if lo_open else t >= t0) and (t <= t1 if hi_closed else t < t1):
            s += c[3] - c[2]
    return s

def stalls(jobdir):
    p = os.path.join(jobdir, "summary.json")
    d = json.load(open(p)); f = d.get("fault") or {}
    ev = f.get("events", [])
    st = [e for e in ev if e.get("kind") == "stall"]
    fails = [e for e in ev if e.get("kind") == "failure"]
    return d, f, ev, st, fails

def main(dirs):
    res = {}
    for kd in dirs:
        print("=" * 100); print(kd)
        jobs = {}
        for case in ("every-30s", "twin-30s"):
            jd = os.path.join(kd, case)
            cfg = json.load(open(os.path.join(jd, "summary.json")))["config"]
            assert cfg["model"]["block_size"] == TOK_PER_SAMPLE, cfg["model"]
            commits, stats = read_job(jd)
            til = tiling(commits)
            jobs[case] = (commits, stats, til)
            print(f" {case}: {stats}")
            for g, v in til.items():
                print(f"   group {g}: ranges {v['ranges']} end {v['end']} committed {v['committed']} twice {v['twice']} "
                      f"left_out {v['left_out']} sizes {v['sizes']} rounds(min,max,distinct) {v['rounds']} "
                      f"same-range-several-rounds {v['multi_round'] or '-'}")
            tot = sum(v["committed"] for v in til.values())
            print(f"   all committed: {tot} samples = {tot*TOK_PER_SAMPLE} tokens; twice {sum(v['twice'] for v in til.values())}"
                  f" left_out {sum(v['left_out'] for v in til.values())}; first commit {commits[0][0]:.3f} last {commits[-1][0]:.3f}")
        cf, cr = jobs["every-30s"][0], jobs["twin-30s"][0]
        t0 = max(cf[0][0], cr[0][0]); t1 = min(cf[-1][0], cr[-1][0])
        print(f" window (later first commit, earlier last commit] = ({t0:.3f}, {t1:.3f}]  -> {t1 - t0!r} s")
        out = {"window_s": t1 - t0}
        for name, c in (("faulty", cf), ("twin", cr)):
            out[name + "_in"] = between(c, t0, t1) * TOK_PER_SAMPLE
            out[name + "_all"] = sum(x[3] - x[2] for x in c) * TOK_PER_SAMPLE
        out["goodput"] = out["faulty_in"] / out["twin_in"]
        print(f" tokens in window: faulty {out['faulty_in']} twin {out['twin_in']}; all: faulty {out['faulty_all']} twin {out['twin_all']}")
        print(f" goodput = {out['goodput']!r}")
        # conventions
        for lo, hi, lab in ((True, True, "(t0,t1]"), (False, True, "[t0,t1]"), (True, False, "(t0,t1)"), (False, False, "[t0,t1)")):
            g = between(cf, t0, t1, lo, hi) / between(cr, t0, t1, lo, hi)
            print(f"   convention {lab}: goodput {g!r}  (diff {g - out['goodput']:+.6f})")
        # separate windows per job (not 'together')
        wf = (cf[0][0], cf[-1][0]); wr = (cr[0][0], cr[-1][0])
        rf = between(cf, *wf) / (wf[1] - wf[0]); rr = between(cr, *wr) / (wr[1] - wr[0])
        print(f"   separate windows: faulty {wf[1]-wf[0]:.3f}s twin {wr[1]-wr[0]:.3f}s -> rate ratio {rf/rr!r}")
        print(f"   all committed ratio (no window): {out['faulty_all']/out['twin_all']!r}")
        # by last-line time instead of first line (any re-log later?)
        # stalls from coordinator events
        d, f, ev, st, fails = stalls(os.path.join(kd, "every-30s"))
        ssum = sum(e["seconds"] for e in st)
        out["stall_sum"] = ssum; out["stall_n"] = len(st)
        print(f" stall events: {len(st)}, sum {ssum!r}; summary stall_seconds list sum {sum(f.get('stall_seconds', []))!r} n {len(f.get('stall_seconds', []))}")
        kinds = {}
        for e in ev: kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
        print(f" event kinds: {kinds}")
        reasons = {}
        for e in fails:
            r = re.sub(r"\d+(\.\d+)?", "N", e.get("reason", ""))[:110]
            reasons[r] = reasons.get(r, 0) + 1
        for r, n in reasons.items(): print(f"   failure x{n}: {r}")
        # stalls in window (coordinator at_s is relative to job start; kept for info)
        # per-failure: nearest stall at the same at_s
        for e in fails:
            near = [s for s in st if abs(s["at_s"] - e["at_s"]) < 0.05]
            print(f"   failure g{e['group']} at {e['at_s']}: stall {[s['seconds'] for s in near]} exch {[s['exchange'] for s in near]} | {e['reason'][:90]}")
        rb = [e for e in ev if e["kind"] == "rolled_back"]
        for e in rb: print(f"   rolled_back exch {e['exchange']} at {e['at_s']}: {e['reason'][:140]}")
        res[kd] = out
    return res

if __name__ == "__main__":
    args = sys.argv[1:]
    out_json = None
    if "--json" in args:
        i = args.index("--json")
        out_json = args[i + 1]
        del args[i:i + 2]
    if not args:
        sys.exit(__doc__)
    r = main(args)
    if out_json:
        with open(out_json, "w") as f:
            json.dump(r, f, indent=1)
