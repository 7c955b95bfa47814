"""The row catalogue of the convergence study (``bench/convergence.py``): the model sizes and
their budgets, the rows (one configuration each), the lr sweeps' rows and the ``--quick`` subset."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from compress.codec_spec import CodecSpec

CODECS = ("fp32", "bf16", "int8", "int4", "fp4-e2m1", "fp4-e3m0", "lloyd4")
INNER_LRS = (5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)
DEFAULT_OUTER = (0.7, 0.9)  # DiLoCo's outer Nesterov lr / momentum
# the outer sweep besides the default (whose run is the DiLoCo inner sweep's best)
OUTER_SWEEP = ((0.4, 0.9), (1.0, 0.9), (0.7, 0.8), (0.7, 0.95), (0.7, 0.7), (1.0, 0.8), (0.7, 0.5), (1.0, 0.7))


#: SparseLoCo (issue 31): its H and densities (k of every 4096: 41, 64, 123)
SPARSE_HS = (30, 50, 100)
SPARSE_DENSITIES = (0.01, 64 / 4096, 0.03)
INT2_HS = (30, 100, 200, 300)  # int2 with error feedback: 2.125 bits per value per sync
SPARSE_OUTER_SWEEP = ((0.5, 0.95), (0.65, 0.95), (1.5, 0.95), (2.0, 0.95), (1.0, 0.9), (1.0, 0.99), (1.0, 1.0))
#: sign1 (1.125 bits/value) with error feedback at H=120: 0.0096 bits/param/step per group (measured), where
#: fp32 itself is no worse than at H=30 (H=100: -0.9 %)
SIGN1_HS = (120,)
#: int2 under QSR with a long base: H starts at H_base and grows as the inner lr decays (at 8,000
#: steps: 37 syncs for H_base 100, 34 for 110: 0.0100 / 0.0092 bits/param/step per group, measured)
QSR_INT2_BASES = (100, 110)
#: int2 at H=300 (0.0073 bits/param/step per group) under outer steps other than H=30's tuned 0.7/0.7:
#: 26 outer steps in 8,000 inner ones may want another outer stride (DiLoCo used 0.7/0.9 at H=500)
INT2_H300_OUTERS = ((0.7, 0.9), (1.0, 0.7), (0.7, 0.5), (0.5, 0.7))
#: int2 without error feedback, zstd on its frames: H=230 (as without zstd) and the shorter H its bytes allow
INT2_ZSTD_HS = (230, 200)
#: an outer step without momentum (FedAvg: lr 1) for the long-H rows (H=230)
OUTER_NO_MOMENTUM = ((1.0, 0.0),)


def _int2_h300(outer: tuple[float, float]) -> str:
    return f"m2-h300-int2-lr{outer[0]:g}-mom{outer[1]:g}"


def _outer_row(h: int, outer: tuple[float, float]) -> str:
    return f"m2-h{h}-lr{outer[0]:g}-mom{outer[1]:g}"


def _slo(h: int, density: float) -> str:
    return f"slo-h{h}-d{100 * density:.3g}"


PACED_OVERLAP = "m2-paced200-int2b1024-int4final-decay0-zstd-p2-tau15-outer"
#: four groups at the paced int2 setting, at its H and at the H that keeps it under 0.01 bits per group
G4_BUDGET_ROWS = ("m4-paced200-int2b1024-int4final-decay0-zstd-outer", "m4-paced600-int2b1024-int4final-decay0-zstd-outer")
#: the paced int2 overlap row at other merge alphas (overlap's default is 0.5), by alpha
PACED_OVERLAP_ALPHAS = {a: f"{PACED_OVERLAP.removesuffix('-outer')}-a{a:g}-outer" for a in (0.0, 0.25)}
#: SparseLoCo averaged as its authors' code does (issue 51): each index over the groups that sent it
#: (``--topk-mean senders``), with and without the median-norm clip (``--topk-clip-median``), by row suffix
SPARSE_MEANS = {"senders": dict(topk_mean="senders"),
                "senders-clip": dict(topk_mean="senders", topk_clip_median=True)}
SPARSE_MEAN_ROWS = tuple(f"{base}-{suffix}" for base in ("slo-h30-d1.56", "slo-m4-h30") for suffix in SPARSE_MEANS)
#: SparseLoCo as its authors run it with a denser top-k under 0.01 bits per group at H=30 (issue 51): 2.2 %
#: (k = 90 of 4096), picked as 1.56 %'s 0.0068 bits/param/step per group scaled by density (0.0095); it sends
#: 0.0087 (the indices' share is not proportional), so up to ~2.6 % (k = 106) would stay under the budget
SPARSE_DENSE_DENSITY = 0.022
SPARSE_DENSE_ROW = f"{_slo(30, SPARSE_DENSE_DENSITY)}-senders-clip"
SPARSELOCO_ROWS = (*(_slo(h, d) for h in SPARSE_HS for d in SPARSE_DENSITIES), "slo-sign1-h30", "slo-overlap-p2-tau5",
                   "slo-m4-h30", *SPARSE_MEAN_ROWS, *(f"m2-h{h}-int2-outer" for h in INT2_HS),
                   "slo-int2-h30", "slo-int2-h100", "m2-h200-outer", "m2-h300-outer",
                   *(_int2_h300(o) for o in INT2_H300_OUTERS), *(f"m2-h{h}-sign1-outer" for h in SIGN1_HS),
                   *(f"m2-qsr{h}-int2-outer" for h in QSR_INT2_BASES), "m2-qsr100-outer",
                   "m2-h300-int2-int8final-outer", "m2-qsr120-int2-int8final-outer",
                   "m2-h230-int2b1024-int4final-outer", "m2-h230-outer", "m2-h110-sign1b1024-int4final-outer",
                   "m2-h230-int2b1024-int4final-decay0-outer", "m2-h115-sign1b1024-int4final-decay0-outer",
                   "m2-qsr110-int2b1024-int4final-decay0-outer",
                   *(f"m2-h{h}-int2b1024-int4final-decay0-zstd-outer" for h in INT2_ZSTD_HS),
                   "m2-qsr150-g0.5-int2b1024-int4final-decay0-zstd-outer", "m2-paced200-outer",
                   "m2-paced200-int2b1024-int4final-decay0-zstd-outer", PACED_OVERLAP,
                   "m2-paced300-int2b1024-int4final-decay0-zstd-outer",
                   *PACED_OVERLAP_ALPHAS.values(),
                   *(f"m2-h230-{c}lr{o[0]:g}-mom{o[1]:g}" for c in ("", "int2b1024-int4final-")
                     for o in OUTER_NO_MOMENTUM))


#: The study's own gap to data parallel at the H and number of rounds of the ecosystem benchmarks
#: (issue 52): the Hugging Face Llama at H=25 for 500 steps (20 rounds, bench/hf.py) and torchtitan's
#: debug Llama at H=20 for 1,000 steps (50 rounds, bench/titan.py); by size: the tuned outer step (0.7 / 0.7)
#: first, then the lower momenta torchtitan's outer sweep preferred (0.7 / 0.3 its best, bench/pages/titan.md)
ECOSYSTEM_HS = {"medium": 25, "medium-long": 20}
ECOSYSTEM_OUTERS = ((0.7, 0.5), (0.7, 0.3))
ECOSYSTEM_ROWS = {size: (f"m2-h{h}-outer", *(_outer_row(h, o) for o in ECOSYSTEM_OUTERS))
                  for size, h in ECOSYSTEM_HS.items()}


@dataclass(frozen=True)
class Size:
    """A demo GPT and the budget of its rows: ``steps`` inner steps of ``batch`` sequences (all
    groups together) of ``block`` tokens."""

    name: str
    n_layer: int
    n_embd: int
    steps: int
    n_head: int = 4
    block: int = 64
    batch: int = 32
    warmup: int = 0  # 0: steps // 20
    seeds: int = 3  # seeds of the rows marked ``seeded`` (the others: one)
    inner_lrs: tuple[float, ...] = INNER_LRS  # the inner-lr sweep
    outer_sweep: tuple[tuple[float, float], ...] = OUTER_SWEEP  # the outer (lr, momentum) sweep
    tuned_on: str = ""  # a size whose sweep winners this one uses (and no sweep of its own)
    rows: tuple[str, ...] | None = None  # study rows run at this size (None: all)


#: The medium model runs a subset of the rows, two seeds, a 4-point inner-lr sweep and its own outer
#: sweep (issue 51: swept at its size, not borrowed; it picks the small model's 0.7 / 0.7 again, as
#: Charles et al. 2025 find the best outer lr independent of model size). Both sizes together: about
#: 1.5 hours on 2 idle cores (estimated from single rows: small M=2 1,000 steps ~40 s, medium M=2 500
#: steps ~60 s; more when the machine is shared).
SIZES = {
    "small": Size("small", n_layer=2, n_embd=64, steps=1000),
    "medium": Size("medium", n_layer=4, n_embd=128, steps=500, seeds=2, inner_lrs=(1e-3, 2e-3, 4e-3, 8e-3),
                   rows=("dp", "m1-h30", "m2-h30", "m4-h30", "m1-h30-outer", "m2-h30-outer", "m4-h30-outer",
                         "m2-h100-outer", "m2-h30-int4-outer", "m2-h30-fp4-e2m1-outer", "overlap-p2-tau5-fp4",
                         "eager", "co2", "qsr-outer", *ECOSYSTEM_ROWS["medium"])),
    # the small model trained twice as long, at the small sweep's winners: does the gap to data
    # parallel shrink when the same model takes more outer steps?
    "small-long": Size("small-long", n_layer=2, n_embd=64, steps=2000, seeds=1, tuned_on="small",
                       rows=("dp", "dp-lr0.004", "m1-h30-outer", "m2-h30", "m2-h30-outer", "m4-h30-outer", "eager")),
    # four times longer again (about 140 tokens per parameter): does M=4 keep closing on data parallel?
    "small-xlong": Size("small-xlong", n_layer=2, n_embd=64, steps=8000, seeds=1, tuned_on="small",
                        rows=("dp", "dp-lr0.004", "m2-h30", "m2-h30-outer", "m4-h30-outer", "eager", "qsr-outer",
                              "m2-h100-outer", "m2-h200-int4-outer", "delayed", "co2", "m2-h50-outer", *G4_BUDGET_ROWS,
                              *SPARSELOCO_ROWS)),
    # the medium model as long as the small one: the trend with model size at equal steps
    "medium-long": Size("medium-long", n_layer=4, n_embd=128, steps=1000, seeds=1, tuned_on="medium",
                        rows=("dp", "m2-h30-outer", "m4-h30-outer", *ECOSYSTEM_ROWS["medium-long"])),
    # the medium model (7x the parameters) at the long size's 8,000 steps (about 20 tokens per parameter
    # where small-xlong has 136): does the cost of a long H, fp32's and 2-bit's, shrink with model size?
    "medium-xlong": Size("medium-xlong", n_layer=4, n_embd=128, steps=8000, seeds=1, tuned_on="medium",
                         rows=("dp", "m2-h30-outer", "m2-h230-outer", "m2-h230-int2b1024-int4final-outer",
                               "m2-h230-int2b1024-int4final-decay0-outer", "m2-h100-outer", "m2-paced200-outer",
                               "m2-paced200-int2b1024-int4final-decay0-zstd-outer", "m2-h200-int4-outer",
                               "slo-h30-d1.56", "slo-h30-d1.56-senders", "slo-h30-d1.56-senders-clip",
                               SPARSE_DENSE_ROW)),
    # the large model (5.6M parameters, 6.7x medium's): its own sweep at 500 steps (4 inner lrs, and the
    # medium sweep's 1st, 2nd and 4th outer steps: 0.7/0.7, 0.7/0.5, 1.0/0.7, and the default), about 4.5 min
    # a run on 2 idle cores; no study rows at this length
    "large": Size("large", n_layer=7, n_embd=256, steps=500, seeds=1, inner_lrs=(5e-4, 1e-3, 2e-3, 4e-3),
                  outer_sweep=((0.7, 0.7), (0.7, 0.5), (1.0, 0.7)), rows=()),
    # the large model at 4,000 steps (8.2M tokens, 1.5 per parameter): the frontier at a 5M+ model
    # (issue 51), about 33 min a row on 2 idle cores (0.47 s a step)
    "large-long": Size("large-long", n_layer=7, n_embd=256, steps=4000, seeds=1, tuned_on="large",
                       rows=("dp", "m2-h30-outer", "m2-h100-outer", "m2-paced200-outer",
                             "m2-paced200-int2b1024-int4final-decay0-zstd-outer", "m2-h200-int4-outer",
                             "slo-h30-d1.56-senders-clip", SPARSE_DENSE_ROW, _slo(30, SPARSE_DENSE_DENSITY))),
}
QUICK_SIZE = replace(SIZES["small"], steps=400, seeds=1)


def spec(codec: str, **options) -> CodecSpec:
    """A row's codec: ``codec`` with ``options`` (``compress.codec_spec.CodecOptions``' fields: the
    job's ``[transport]`` keys), the others at their defaults."""
    return CodecSpec(codec=codec, **options)


@dataclass(frozen=True)
class Row:
    """One configuration of the study (the model size and seed come from the run)."""

    name: str
    mode: str = "blocking"  # dp, blocking, overlap, eager, co2
    groups: int = 2
    h: int = 30
    codec: CodecSpec = field(default_factory=CodecSpec)  # the codec and its options (``spec(...)``)
    fragments: int = 1
    tau: int = 0
    schedule: str = "fixed"
    qsr_gamma: float = 2.0  # schedule qsr: H = H_base x (peak lr / lr)^gamma (--qsr-gamma)
    paced_gamma: float = 0.5  # schedule paced: ceil(steps / H) syncs, H ~ (peak lr / lr)^gamma (--paced-gamma)
    stage: str = "study"  # sweep or study
    inner_lr: float | None = None  # None: the family's (sweep winner or flag)
    outer: tuple[float, float] | None = None  # outer (lr, momentum); None: the default (0.7, 0.9)
    outer_tuned: bool = False  # True: the sweep's best outer (lr, momentum) instead of the default
    co2: tuple[float, float] | None = None  # CO2's outer (lr, momentum); None: CO2_DEFAULTS
    rule: str = ""  # "sparseloco": SparseLoCo's outer rule (its lr 1, beta 0.95, 64x64 tiles) instead of Nesterov
    beta: float = 0.95  # sparseloco: the residual's decay
    residual_decay: float = 1.0  # --residual-decay: error feedback's decay (0: none, the codec runs biased)
    merge_alpha: float = -1.0  # --merge-alpha: overlap's merge, local = a*local + (1-a)*global (-1: the mode's, 0.5)
    seeded: bool = False  # run with every seed of the size (else the first only)
    note: str = ""

    @property
    def family(self) -> str:
        return "dp" if self.mode == "dp" else "diloco"


def study_rows() -> list[Row]:
    rows = [Row("dp", mode="dp", groups=2, h=1, seeded=True, note="data parallel across 2 groups"),
            Row("dp-lr0.004", mode="dp", groups=2, h=1, inner_lr=4e-3, seeded=True,
                note="data parallel at inner lr 4e-3 (the small sweep's winner 8e-3 diverged on one seed of three)")]
    for m in (1, 2, 4):
        for h in (10, 30, 100):
            rows.append(Row(f"m{m}-h{h}", groups=m, h=h, seeded=h == 30))
    rows += [Row(f"m2-h30-{c}", codec=spec(c), seeded=True) for c in CODECS if c != "fp32"]
    rows += [Row("m2-h30-sign1", codec=spec("sign1"), note="sign1 with error feedback (gather exchange)"),
             Row("m2-h30-topk", codec=spec("topk"), note="top-k with error feedback (gather exchange)")]
    rows += [
        Row("streaming-p2", fragments=2, note="2 fragments, staggered, each sync blocking"),
        Row("overlap-p2-tau5", mode="overlap", fragments=2, tau=5, seeded=True,
            note="Streaming DiLoCo: tau=5 overlap, alpha=0.5"),
        Row("overlap-p2-tau5-fp4", mode="overlap", fragments=2, tau=5, codec=spec("fp4-e2m1"), seeded=True,
            note="Streaming DiLoCo with fp4-e2m1"),
        Row("eager", mode="eager", seeded=True, note="one-round eager outer step"),
        Row("delayed", mode="delayed", seeded=True, note="naive one-round-stale outer step (what eager corrects)"),
        Row("co2", mode="co2", seeded=True, note="CO2 defaults (lr 1, momentum 0, adaptive penalty, clip 1)"),
        Row("qsr", h=30, schedule="qsr", note="QSR: H = max(30, (alpha/lr)^2), alpha = peak lr x sqrt(30)"),
    ]
    tuned = "best outer lr/momentum of the sweep"
    rows += [Row(f"m{m}-h30-outer", groups=m, h=30, outer_tuned=True, seeded=True, note=tuned) for m in (1, 2, 4)]
    rows += [Row(f"m2-h{h}-outer", h=h, outer_tuned=True, note=tuned) for h in (10, 20, 25, 50, 100, 200, 230, 300)]
    rows += [Row(_outer_row(h, o), h=h, outer=o, note=f"H={h}, outer lr {o[0]:g} momentum {o[1]:g}")
             for h in ECOSYSTEM_HS.values() for o in ECOSYSTEM_OUTERS]
    rows += [Row(f"m2-h30-{c}-outer", codec=spec(c), outer_tuned=True, seeded=True, note=tuned)
             for c in CODECS if c != "fp32"]
    rows += [Row("qsr-outer", h=30, schedule="qsr", outer_tuned=True, seeded=True, note=f"QSR, {tuned}"),
             Row("m2-h30-sign1-outer", codec=spec("sign1"), outer_tuned=True,
                 note=f"sign1 with error feedback, {tuned}"),
             Row("m2-h30-topk-outer", codec=spec("topk"), outer_tuned=True, note=f"top-k with error feedback, {tuned}"),
             *[Row(f"m2-h100-{c}-outer", h=100, codec=spec(c), outer_tuned=True, note=f"H=100, {tuned}")
               for c in ("int4", "sign1", "topk")],
             Row("m2-h200-int4-outer", h=200, codec=spec("int4"), outer_tuned=True,
                 note=f"H=200 int4: 0.04 bits, {tuned}"),
             Row("co2-lr0.7-mom0", mode="co2", co2=(0.7, 0.0), note="CO2, outer lr 0.7"),
             Row("co2-lr1-mom0.3", mode="co2", co2=(1.0, 0.3), note="CO2, outer momentum 0.3"),
             Row("delayed-lr1-mom0", mode="delayed", outer=(1.0, 0.0), note="delayed, outer lr 1"),
             *[Row(f"delayed-lr{o[0]:g}-mom{o[1]:g}", mode="delayed", outer=o, seeded=True,
                   note="delayed, lowered outer lr (the eager paper's variant)") for o in ((0.5, 0.0), (0.35, 0.0))],
             *[Row(f"delayed-lr{o[0]:g}-mom{o[1]:g}", mode="delayed", outer=o, note="delayed with some momentum")
               for o in ((0.5, 0.3), (0.5, 0.5), (0.7, 0.3))],
             Row("eager-lr0.5-mom0.5", mode="eager", outer=(0.5, 0.5), note="eager, outer lr 0.5"),
             Row("co2-lr1.3-mom0", mode="co2", co2=(1.3, 0.0), note="CO2, outer lr 1.3"),
             Row("co2-lr1-mom0.15", mode="co2", co2=(1.0, 0.15), note="CO2, outer momentum 0.15"),
             Row("eager-lr0.7-mom0.7", mode="eager", outer=(0.7, 0.7), note="eager, outer momentum 0.7"),
             Row("eager-h10", mode="eager", h=10, seeded=True, note="eager at H=10: a round is 1 % of the run"),
             Row("eager-lr1-mom0.5", mode="eager", outer=(1.0, 0.5), note="eager, outer lr 1")]
    rows += sparseloco_rows()
    return rows


def sparseloco_rows() -> list[Row]:
    """SparseLoCo's rule (issue 31): top-k per 64x64 tile, 2-bit values, residual beta 0.95, outer
    SGD lr 1 without momentum; against fp32 DiLoCo (m2-h30-outer) and data parallel at equal tokens."""
    rows = [Row(_slo(h, d), h=h, codec=spec("topk", topk_density=d), rule="sparseloco",
                seeded=(h, d) == (30, 64 / 4096),
                note=f"SparseLoCo, H={h}, top-k {100 * d:.3g} %") for h in SPARSE_HS for d in SPARSE_DENSITIES]
    rows += [Row(f"slo-h30-lr{lr:g}-beta{beta:g}", codec=spec("topk"), rule="sparseloco", outer=(lr, 0.0), beta=beta,
                 note="SparseLoCo's outer lr and residual decay, around Covenant's 1 (later 0.65) and 0.95")
             for lr, beta in SPARSE_OUTER_SWEEP]
    rows += [Row("slo-sign1-h30", codec=spec("sign1"), rule="sparseloco",
                 note="SparseLoCo's rule with sign1 (1 bit, error-fed)"),
             Row("slo-overlap-p2-tau5", mode="overlap", fragments=2, tau=5, codec=spec("topk"), rule="sparseloco",
                 note="SparseLoCo with Streaming DiLoCo's overlap (2 fragments, tau 5)"),
             Row("slo-m4-h30", groups=4, codec=spec("topk"), rule="sparseloco", note="SparseLoCo with 4 groups")]
    # the same codecs as their bases (slo-h30-d1.56's density 64/4096 is topk's default k of 64 per 4096)
    rows += [Row(f"{base}-{suffix}", groups=groups, codec=spec("topk", **density, **options), rule="sparseloco",
                 seeded=True, note=f"SparseLoCo with {groups} groups, each index averaged over the groups that sent it"
                 f"{', each group clipped to the median norm first' if 'clip' in suffix else ''} (the authors' code)")
             for base, groups, density in (("slo-h30-d1.56", 2, dict(topk_density=64 / 4096)), ("slo-m4-h30", 4, {}))
             for suffix, options in SPARSE_MEANS.items()]
    dense = spec("topk", topk_density=SPARSE_DENSE_DENSITY, **SPARSE_MEANS["senders-clip"])
    rows.append(Row(SPARSE_DENSE_ROW, codec=dense, rule="sparseloco", seeded=True,
                    note="SparseLoCo as its authors run it (average over the senders, median clip), top-k 2.2 %: "
                    "under 0.01 bits per group at H=30"))
    rows.append(Row(_slo(30, SPARSE_DENSE_DENSITY), codec=spec("topk", topk_density=SPARSE_DENSE_DENSITY),
                    rule="sparseloco", seeded=True, note="SparseLoCo at top-k 2.2 %, averaged over all groups"))
    rows += [Row(f"m2-h{h}-int2-outer", h=h, codec=spec("int2"), outer_tuned=True,
                 note="int2 (2.125 bits/value) with error feedback under the tuned Nesterov outer step")
             for h in INT2_HS]
    rows += [Row(f"slo-int2-h{h}", h=h, codec=spec("int2"), rule="sparseloco",
                 note="SparseLoCo's rule with int2 (error-fed)")
             for h in (30, 100)]
    rows += [Row(_int2_h300(o), h=300, codec=spec("int2"), outer=o,
                 note=f"int2 at H=300, outer lr {o[0]:g} momentum {o[1]:g}") for o in INT2_H300_OUTERS]
    rows += [Row(f"m2-h{h}-sign1-outer", h=h, codec=spec("sign1"), outer_tuned=True,
                 note="sign1 (1.125 bits/value) with error feedback under the tuned Nesterov outer step")
             for h in SIGN1_HS]
    rows += [Row(f"m2-qsr{h}-int2-outer", h=h, schedule="qsr", codec=spec("int2"), outer_tuned=True,
                 note=f"int2 with error feedback under QSR from H_base={h}, tuned Nesterov outer step")
             for h in QSR_INT2_BASES]
    rows += [Row("m2-qsr100-outer", h=100, schedule="qsr", outer_tuned=True, note="fp32 under QSR from H_base=100")]
    rows += [Row(f"m2-{sched}-int2-int8final-outer", h=h, schedule="qsr" if sched.startswith("qsr") else "fixed",
                 codec=spec("int2", final_codec="int8"), outer_tuned=True,
                 note="int2 with error feedback, the last exchange int8 with the residuals (--final-codec int8)")
             for sched, h in (("h300", 300), ("qsr120", 120))]
    # int2 with 1024-value scale blocks (2.03 bits) at H=230 and an int4 last exchange: 0.0093 bits/param/step
    # per group (measured), at an H where fp32 itself costs less than at 300
    rows += [Row("m2-h230-int2b1024-int4final-outer", h=230, codec=spec("int2", codec_block=1024, final_codec="int4"),
                 outer_tuned=True, note="int2 (1024-value blocks) at H=230, the last exchange int4")]
    # the same without error feedback (--residual-decay 0: each exchange's 2-bit error is dropped, not sent a
    # round late): at H=230 the residual is stale error, as large as a fresh delta (bench/residual_staleness.py)
    rows += [Row(f"m2-h{h}-{c}b1024-int4final-decay0-outer", h=h, codec=spec(c, codec_block=1024, final_codec="int4"),
                 residual_decay=0.0, outer_tuned=True, note=f"{c} at H={h} without error feedback, last exchange int4")
             for c, h in (("int2", 230), ("sign1", 115))]
    # the same with zstd on the frames: int2's codes are not uniform (a Gaussian's high level is a third of
    # the values, fewer with heavier tails), so their entropy is under 2 bits; what zstd saves buys syncs, at
    # the same 0.01 bits a shorter H
    rows += [Row(f"m2-h{h}-int2b1024-int4final-decay0-zstd-outer", h=h,
                 codec=spec("int2", codec_block=1024, final_codec="int4", zstd=True),
                 residual_decay=0.0, outer_tuned=True,
                 note=f"int2 at H={h} without error feedback, zstd, last exchange int4") for h in INT2_ZSTD_HS]
    # and under QSR from H_base=110 (short rounds early, long late: fp32 under QSR from 100 is +0.55 %, seed 1),
    # where int2 with error feedback failed (m2-qsr110-int2-outer)
    rows += [Row("m2-qsr110-int2b1024-int4final-decay0-outer", h=110, schedule="qsr",
                 codec=spec("int2", codec_block=1024, final_codec="int4"),
                 residual_decay=0.0, outer_tuned=True,
                 note="int2 under QSR from H_base=110 without error feedback, last exchange int4")]
    # where the same 40 syncs go (bench/sync_plans.py): --schedule paced, H from 141 to 439 as the lr decays
    # tenfold (gamma 0.5), against fixed H=200; and QSR with gamma 0.5 from H_base=150 (39 syncs), the nearest
    # QSR: H = 150 through the warmup, then recomputed from the lr after each sync
    int2_zstd = dict(codec=spec("int2", codec_block=1024, final_codec="int4", zstd=True), residual_decay=0.0)
    rows += [Row(f"m2-paced200-{c}outer", h=200, schedule="paced", paced_gamma=0.5, outer_tuned=True,
                 note=f"{'int2 without error feedback, zstd, last exchange int4, ' if c else ''}a sync every 200 "
                 "steps on average (40 at 8,000 steps, 20 at 4,000), paced by gamma 0.5", **(int2_zstd if c else {}))
             for c in ("", "int2b1024-int4final-decay0-zstd-")]
    # four groups (issue 51 point 4; the study's global batch of 32 does not split over 3): a ring member sends
    # 2(G-1)/G of a vector and an all-gather member G-1 contributions, so the 2-group setting's 0.0096
    # bits/param/step per group is 0.028 at G=4 (bench/convergence_bits.py); paced H=600 (14 syncs) brings it
    # back under 0.01, beside fp32 DiLoCo at H=30 with 4 groups (m4-h30-outer)
    rows += [Row(f"m4-paced{h}-int2b1024-int4final-decay0-zstd-outer", groups=4, h=h, schedule="paced", paced_gamma=0.5,
                 outer_tuned=True, note=f"4 groups, int2 without error feedback, zstd, last exchange int4, paced H={h}",
                 **int2_zstd) for h in (200, 600)]
    # 27 syncs instead of 40 (0.0064 bits/param/step per group): an exchange of int2 every 300 steps on average is
    # 5 % of a round's compute at 2 Mbit/s for the 19M GPT on this CPU (bench/utilization.py), blocking
    rows += [Row("m2-paced300-int2b1024-int4final-decay0-zstd-outer", h=300, schedule="paced", paced_gamma=0.5,
                 outer_tuned=True, note="int2 without error feedback, zstd, last exchange int4, 27 syncs paced by "
                 "gamma 0.5", **int2_zstd)]
    # the same with Streaming DiLoCo's overlap (2 fragments, each exchange beside 15 inner steps): the setting
    # bench/utilization.py runs at 2 Mbit/s (19M parameters), whose loss cost is measured here
    rows += [Row(PACED_OVERLAP, mode="overlap", fragments=2, tau=15, h=200, schedule="paced", paced_gamma=0.5,
                 outer_tuned=True, note="int2 without error feedback, zstd, last exchange int4, 40 syncs paced by "
                 "gamma 0.5, 2 fragments overlapped by 15 steps", **int2_zstd)]
    # ... with another merge: alpha 0 takes the fragment's new global values whole (the tau steps' local work on it
    # is dropped), 0.25 keeps a quarter of the local (the default 0.5 keeps half: a fragment half-synced)
    rows += [Row(name, mode="overlap", fragments=2, tau=15, h=200, schedule="paced", paced_gamma=0.5, merge_alpha=a,
                 outer_tuned=True, note=f"the paced int2 overlap row with merge alpha {a:g}", **int2_zstd)
             for a, name in PACED_OVERLAP_ALPHAS.items()]
    rows += [Row("m2-qsr150-g0.5-int2b1024-int4final-decay0-zstd-outer", h=150, schedule="qsr", qsr_gamma=0.5,
                 outer_tuned=True, note="int2 without error feedback, zstd, last exchange int4, under QSR with "
                 "gamma 0.5 from H_base=150", **int2_zstd)]
    # the same under outer SGD without momentum (lr 1: plain averaging of the deltas): does momentum, which
    # re-applies what a residual delivers a round late, make error feedback's stale residual worse?
    rows += [Row(f"m2-h230-{c}lr{o[0]:g}-mom{o[1]:g}", h=230, outer=o,
                 note=f"H=230, outer lr {o[0]:g} momentum {o[1]:g}",
                 **(dict(codec=spec("int2", codec_block=1024, final_codec="int4")) if c else {}))
             for c in ("", "int2b1024-int4final-") for o in OUTER_NO_MOMENTUM]
    # sign1 with 1024-value blocks (1.03 bits) at H=110 and an int4 last exchange, at an H where fp32 is no worse
    # than at 30: 0.0101 bits/param/step per group measured (1 % over the budget; H=115 below is under it)
    rows += [Row("m2-h110-sign1b1024-int4final-outer", h=110, codec=spec("sign1", codec_block=1024, final_codec="int4"),
                 outer_tuned=True, note="sign1 (1024-value blocks) at H=110, the last exchange int4")]
    return rows


def sweep_rows(size: Size | None = None) -> list[Row]:
    lrs = size.inner_lrs if size is not None else INNER_LRS
    rows = [Row(f"sweep-dp-lr{lr:g}", mode="dp", groups=2, h=1, stage="sweep", inner_lr=lr) for lr in lrs]
    rows += [Row(f"sweep-diloco-lr{lr:g}", stage="sweep", inner_lr=lr) for lr in lrs]
    outers = size.outer_sweep if size is not None else OUTER_SWEEP
    rows += [Row(f"sweep-outer-lr{o[0]:g}-mom{o[1]:g}", stage="sweep", outer=o) for o in outers]
    return rows


QUICK_ROWS = ("dp", "m1-h30", "m2-h30", "m2-h30-int4", "streaming-p2", "overlap-p2-tau5-fp4", "eager")


def quick_rows() -> list[Row]:
    by_name = {r.name: r for r in study_rows()}
    return [by_name[n] for n in QUICK_ROWS]
