"""Bits per parameter per inner step per sending group, counted two ways (issue 51, point 4).

* **As SparseLoCo counts them** (Sarfi et al. 2025): the payload bits of one group's contribution to
  one exchange (the codec's parts: values, scales, indices; no frame header, no zstd) over the
  model's parameters, over the period H (steps / exchanges). It ignores how many times those bits
  cross links, so it is the same for every G.
* **As the wire counts them**: the bytes one group's transport sends over the whole job, over
  parameters and inner steps, from the codecs' frame sizes (``Codec.frame_size``: the 52 bytes of
  header and checksum included) and the transport's envelopes (``transport.wire.HEADER``, 36 bytes,
  and the exchange's tag in every message). An error-fed codec (int2, sign1, topk) runs as an
  all-gather (``transport/gather.py``): every group's own frames travel G − 1 hops, so each group
  sends (G − 1) contributions per exchange. An exchange without a residual (fp32, int4: the last
  exchange of ``--final-codec``, the initial-parameter check) is the ring all-reduce: each group
  sends 2 (G − 1) segment frames of ~n / G values per stripe. Each stripe is a ring of its own
  (``stripes_per_rank`` = 4 per rank, aligned to the codec's chunk: SparseLoCo's 64 x 64 tiles),
  cut into chunks of at most ``chunk_elems`` values (1 MiB of fp32). Bandwidth probes: each group
  probes each other group with a warm-up and ``PROBE_PAIRS`` pairs of (1 B, ``probe_bytes``)
  messages at start and every ``reprobe_every`` exchanges (``diloco run``'s defaults 512 KiB and
  100; the study ran with probes off). Acknowledgements and the coordinator's gRPC are not counted.

zstd's savings depend on the values, so a frame size with zstd is not known without the data: the
count here is without zstd, and ``zstd_ratio`` (measured bytes over this count for the same G=2 run)
carries the measured saving over to G = 3, 4 (the all-gather forwards each group's frames verbatim,
so the ratio of the frames is the same for every G).

Pure functions; ``python bench/convergence_bits.py`` prints the table of bench/pages/convergence.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.convergence_rows import SPARSE_DENSE_ROW, study_rows, sweep_rows  # noqa: E402
from compress import frame  # noqa: E402
from transport.partition import chunk_bounds, segment_bounds  # noqa: E402
from transport.plan import stripe_plan  # noqa: E402
from transport.probe import PROBE_PAIRS  # noqa: E402
from transport.wire import HEADER as WIRE_HEADER  # noqa: E402

ENVELOPE = WIRE_HEADER.size  # 36 bytes before every message's tag and payload
DEFAULT_CHUNK_ELEMS = (1 << 20) // 4
STRIPES_PER_RANK = 4
INIT_CHECK_VALUES = 32  # diloco/engine/initial.py: the XXH3-128's 16 bytes as v and v², fp32


def stripe_sizes(numel: int, stripes: int = STRIPES_PER_RANK, align: int = 1) -> list[int]:
    """The stripe lengths of a ``numel`` vector between groups of one rank (``stripe_plan``)."""
    plan = stripe_plan(numel, [[1.0], [1.0]], min(stripes, max(numel, 1)), align=align)
    return [s.stop - s.start for s in plan.stripes if s.stop > s.start]


def _tag_len(tag: str, stripe: int) -> int:
    return len(f"{tag}/s{stripe}".encode())


def gather_bytes(frame_size: Callable[[int], int], stripes: list[int], groups: int, tag: str = "f0/r100",
                 chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> int:
    """Bytes one group sends in one all-gather exchange: its own frames and those it forwards,
    (G − 1) of each chunk's frame with its envelope. ``frame_size(count)``: the codec's."""
    one = sum(frame_size(b - a) + ENVELOPE + _tag_len(tag, i)
              for i, n in enumerate(stripes) for a, b in chunk_bounds(0, n, chunk_elems))
    return (groups - 1) * one


def ring_bytes(frame_size: Callable[[int], int], stripes: list[int], groups: int, tag: str = "f0/r100",
               chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> float:
    """Bytes one group sends in one ring all-reduce, averaged over the groups: per stripe, G − 1
    reduce-scatter and G − 1 all-gather messages, each a chunk of one of the G segments; a group
    sends every segment but one in each phase, so 2 (G − 1) / G of all segments' frames."""
    total = 0
    for i, n in enumerate(stripes):
        for a, b in segment_bounds(n, groups):
            total += sum(frame_size(d - c) + ENVELOPE + _tag_len(tag, i) for c, d in chunk_bounds(a, b, chunk_elems))
    return 2 * (groups - 1) / groups * total


def probe_bytes_per_group(groups: int, probe_bytes: int, exchanges: int, reprobe_every: int) -> int:
    """Bytes one group's probes send: to each of the G − 1 others a warm-up (1 B), ``PROBE_PAIRS``
    pairs of (1 B, ``probe_bytes``) and an end message, each with an envelope; once at start and
    again every ``reprobe_every`` exchanges (0: only at start). No probes: ``probe_bytes`` 0."""
    if not probe_bytes or groups < 2:
        return 0
    rounds = 1 + (exchanges // reprobe_every if reprobe_every else 0)
    per_peer = (1 + ENVELOPE) * 2 + PROBE_PAIRS * (1 + probe_bytes + 2 * ENVELOPE)
    return rounds * (groups - 1) * per_peer


def fp32_frame(count: int) -> int:
    """An exact (fp32) frame of ``count`` values."""
    return frame.OVERHEAD + 4 * count


@dataclass(frozen=True)
class Budget:
    """One group's bytes over a job, by part, and the two counts in bits/param/step."""

    groups: int
    sparseloco_bits: float  # payload bits of one contribution / params / H
    exchange_bytes: float  # the codec's exchanges (all-gathers, or rings without error feedback)
    final_bytes: float  # the last exchange's (ring all-reduce of --final-codec), 0 without one
    init_bytes: float  # the initial-parameter check
    probe_bytes: float
    params: int
    steps: int

    @property
    def wire_bytes(self) -> float:
        """Everything one group sends over the job."""
        return self.exchange_bytes + self.final_bytes + self.init_bytes + self.probe_bytes

    def bits(self, nbytes: float) -> float:
        """``nbytes`` of one group as bits per parameter per inner step."""
        return 8.0 * nbytes / (self.params * self.steps)

    @property
    def wire_bits(self) -> float:
        """The wire's count: ``wire_bytes`` in bits per parameter per inner step."""
        return self.bits(self.wire_bytes)


def budget(codec: Any, params: int, steps: int, exchanges: int, groups: int, *, fragments: int = 1,
           exchanged: int | None = None, final_codec: Any = None, align: int = 1, probe_bytes: int = 0,
           reprobe_every: int = 100, zstd_ratio: float = 1.0, chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> Budget:
    """One group's two counts for a job of ``exchanges`` exchanges (all fragments') over ``steps``
    inner steps of a ``params``-parameter model at G = ``groups``; each exchange is one of
    ``fragments`` equal parts of the vector. ``exchanged``: the vector's length (SparseLoCo's
    tile-major layout pads it; default ``params``). ``final_codec``: each fragment's last exchange's
    (a ring all-reduce), else every exchange is ``codec``'s. ``zstd_ratio`` scales the frames of
    ``codec``'s exchanges (measured / counted without zstd; 1 without zstd)."""
    n = -(-(params if exchanged is None else exchanged) // fragments)
    stripes = stripe_sizes(n, align=align)
    gathered = bool(getattr(codec, "requires_error_feedback", False))
    one = (gather_bytes if gathered else ring_bytes)(codec.frame_size, stripes, groups, chunk_elems=chunk_elems)
    lasts = fragments if final_codec is not None else 0
    final = 0.0
    if final_codec is not None:
        final = lasts * ring_bytes(final_codec.frame_size, stripe_sizes(n), groups, chunk_elems=chunk_elems)
    init = ring_bytes(fp32_frame, stripe_sizes(INIT_CHECK_VALUES), groups, tag="init/check")
    return Budget(groups=groups, sparseloco_bits=8.0 * codec.payload_size(n) * exchanges / (params * steps),
                  exchange_bytes=(exchanges - lasts) * one * zstd_ratio, final_bytes=final, init_bytes=init,
                  probe_bytes=probe_bytes_per_group(groups, probe_bytes, exchanges, reprobe_every),
                  params=params, steps=steps)


def measured_per_group(records: list[dict], size: str, row: str) -> list[float]:
    """Each seed's measured ``bytes_sent`` of (size, row) per group (all groups' / G)."""
    return [r["bytes_sent"] / r["groups"] for r in records if r["size"] == size and r["row"] == row]


# --- the table of bench/pages/convergence.md ---------------------------------------------------------------

SIZE, PROBES = "small-xlong", 1 << 19
ROWS = ("m2-paced200-int2b1024-int4final-decay0-zstd-outer",
        "m2-paced200-int2b1024-int4final-decay0-zstd-p2-tau15-a0-outer",
        "slo-h30-d1.56", "slo-h100-d1.56", "slo-h100-d3", SPARSE_DENSE_ROW)


def _row_budgets(records: list[dict], name: str, size: str = SIZE) -> tuple[dict, list[Budget], list[Budget], float, float]:
    """(a record of ``size``, budgets at G = 2, 3, 4 without probes and with diloco run's, measured/counted at G=2)."""
    from diloco.demo.model import GPT, GPTConfig
    from diloco.engine.tiles import TileLayout

    row = next(r for r in study_rows() + sweep_rows() if r.name == name)
    rec = next(r for r in records if r["size"] == size and r["row"] == name)
    codec, final = row.codec.build(), row.codec.final()
    final = final.build() if final is not None else None
    params = rec["num_parameters"]
    exchanged, align = params, 1
    if getattr(row, "rule", None) == "sparseloco":
        model = GPT(GPTConfig(n_layer=rec["n_layer"], n_embd=rec["n_embd"], block_size=rec["block_size"]))
        exchanged, align = TileLayout([p.shape for p in model.parameters()]).padded_numel, 4096

    def at(g: int, ratio: float, probes: int) -> Budget:
        return budget(codec, params, rec["steps"], rec["syncs"], g, fragments=rec["fragments"], exchanged=exchanged,
                      final_codec=final, align=align, zstd_ratio=ratio, probe_bytes=probes)

    b2 = at(2, 1.0, 0)
    counted = b2.wire_bytes
    seeds = measured_per_group(records, size, name)
    measured = sum(seeds) / len(seeds)
    ratio = (measured - b2.final_bytes - b2.init_bytes) / b2.exchange_bytes if codec.zstd else 1.0
    plain = [at(g, ratio, 0) for g in (2, 3, 4)]
    probed = [at(g, ratio, PROBES) for g in (2, 3, 4)]
    return rec, plain, probed, measured, counted


def bits_table(records: list[dict], size: str = SIZE) -> str:
    """Markdown: each row of ``ROWS`` the records hold at ``size``, at G = 2, 3, 4, both counts, and
    the G=2 cross-check (ValueError when they hold none of them)."""
    lines = ["| row | G | SparseLoCo's count | wire: exchanges | + last exchange, init check | "
             "= wire, no probes | wire with diloco run's probes (512 KiB) | G=2 measured per group (mean of seeds) |",
             "|" + "---|" * 8]
    names = [name for name in ROWS if measured_per_group(records, size, name)]
    if not names:
        raise ValueError(f"the records hold none of {', '.join(ROWS)} at size {size!r}")
    for name in names:
        rec, plain, probed, measured, counted = _row_budgets(records, name, size)
        for b, p in zip(plain, probed):
            check = (f"{b.bits(measured):.5f} ({measured:,.0f} B; counted without zstd {counted:,.0f} B, "
                     f"measured / counted {measured / counted:.4f})"
                     if b.groups == 2 else "—")
            lines.append(f"| {name} | {b.groups} | {b.sparseloco_bits:.5f} | {b.bits(b.exchange_bytes):.5f} | "
                         f"{b.bits(b.final_bytes + b.init_bytes):.5f} | {b.wire_bits:.5f} | {p.wire_bits:.4f} | {check} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print ``bits_table`` of a convergence records file (default bench/results/convergence.json)."""
    parser = argparse.ArgumentParser(description="Bits per parameter per inner step per sending group, "
                                     "as SparseLoCo counts them and as the wire counts them, for G = 2, 3, 4.")
    parser.add_argument("records", nargs="?", type=Path, default=ROOT / "bench" / "results" / "convergence.json",
                        help="the convergence bench's JSON records (default: %(default)s)")
    parser.add_argument("--size", default=SIZE, help="the study size whose rows are counted (default: %(default)s)")
    args = parser.parse_args(argv)
    if not args.records.is_file():
        parser.error(f"no records file at {args.records}")
    try:
        print(bits_table(json.loads(args.records.read_text()), args.size))
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
