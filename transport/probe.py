"""Ring order from measured bandwidths: maximize the slowest link of the ring.

A ring all-reduce moves the same bytes over every link i -> i+1, so the slowest link sets the
pace. `ring_order` picks the cyclic order whose slowest directed link is fastest (ties broken by
the next-slowest link, and so on). Exact search for up to EXACT_MAX_GROUPS members; beyond that a
greedy start plus pairwise-swap improvement. Measurements come from `TransportBase.probe`, whose
timings `probe_rate` turns into a rate it can stand behind, or none.
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Sequence

from .errors import TransportError

EXACT_MAX_GROUPS = 9  # 8! = 40,320 orders

#: pairs of (tiny, big) round trips a probe times; the median of their differences is its transfer time
PROBE_PAIRS = 3
#: the shortest transfer time a probe trusts (s): below it the timer, the scheduler and the peer's
#: acknowledgement decide the difference, not the link (a 512 KiB probe resolves up to ~2.6 GB/s;
#: a faster link is probed again with more bytes)
PROBE_MIN_TRANSFER_S = 200e-6
#: the fastest rate a probe may report (B/s; 1.6 Tbit/s, beyond any NIC): above it the timings are wrong
PROBE_MAX_RATE = 200e9


class ProbeError(TransportError):
    """A bandwidth probe whose timings give no believable rate (the message names them)."""


def probe_rate(nbytes: int, pairs: Sequence[tuple[float, float]]) -> float | None:
    """Bytes/s of a link from timed round trips: ``pairs`` of (tiny message, ``nbytes`` message)
    seconds, each pair timed back to back so that drifts in the round trip cancel.

    The transfer time is the median of the pairs' differences (one slow round trip, such as a
    redial after a peer restarted, moves it by nothing). Returns None when that median is below
    ``PROBE_MIN_TRANSFER_S``: too short to time (probe with more bytes). Raises ProbeError for a
    rate above ``PROBE_MAX_RATE``, and ValueError for malformed input.
    """
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    if not pairs:
        raise ValueError("need at least one pair of round trips")
    for small, big in pairs:
        if not (math.isfinite(small) and math.isfinite(big) and small >= 0 and big >= 0):
            raise ValueError(f"round trips must be finite and >= 0 s, got {(small, big)}")
    transfer = statistics.median(big - small for small, big in pairs)
    if transfer < PROBE_MIN_TRANSFER_S:
        return None
    rate = nbytes / transfer
    if rate > PROBE_MAX_RATE:
        raise ProbeError(f"{nbytes} B in {transfer * 1e6:.0f} us is {rate:.3g} B/s, above any link "
                         f"({PROBE_MAX_RATE:.3g} B/s)")
    return rate


def ring_links(order: list[int], bw: list[list[float]]) -> list[float]:
    """Bandwidths of the directed links order[i] -> order[i+1] (wrapping around)."""
    return [bw[a][b] for a, b in zip(order, order[1:] + order[:1])]


def _key(order: list[int], bw: list[list[float]]) -> list[float]:
    return sorted(ring_links(order, bw))


def _check(bw: list[list[float]]) -> int:
    g = len(bw)
    if g == 0:
        raise ValueError("need at least one member")
    for row in bw:
        if len(row) != g:
            raise ValueError("bandwidth matrix must be square")
    for i in range(g):
        for j in range(g):
            if i != j and not (math.isfinite(bw[i][j]) and bw[i][j] >= 0):
                raise ValueError(f"bandwidth {i}->{j} must be finite and >= 0, got {bw[i][j]}")
    return g


def ring_order(bw: list[list[float]]) -> list[int]:
    """Member order (starting with member 0) that maximizes the slowest link; bw[i][j] = i -> j, any unit."""
    g = _check(bw)
    if g <= 2:
        return list(range(g))
    if g <= EXACT_MAX_GROUPS:
        best = None
        for rest in itertools.permutations(range(1, g)):
            order = [0, *rest]
            key = _key(order, bw)
            if best is None or key > best[0]:
                best = (key, order)
        return best[1]
    return _heuristic(bw, g)


def _heuristic(bw: list[list[float]], g: int) -> list[int]:
    best: tuple[list[float], list[int]] | None = None
    for start in range(g):  # greedy: always take the fastest outgoing link to an unvisited member
        order, left = [start], set(range(g)) - {start}
        while left:
            nxt = max(left, key=lambda j: (bw[order[-1]][j], -j))
            order.append(nxt)
            left.remove(nxt)
        key = _key(order, bw)
        if best is None or key > best[0]:
            best = (key, order)
    assert best is not None
    key, order = best
    improved = True
    while improved:
        improved = False
        for i in range(g):
            for j in range(i + 1, g):
                cand = order[:]
                cand[i], cand[j] = cand[j], cand[i]
                ck = _key(cand, bw)
                if ck > key:
                    key, order, improved = ck, cand, True
    k = order.index(0)
    return order[k:] + order[:k]
