"""How a vector is cut into index ranges: near-equal segments (one per ring member, or one per
stripe) and chunks of bounded size (one message each)."""

from __future__ import annotations


def segment_bounds(n: int, g: int) -> list[tuple[int, int]]:
    """[start, stop) element ranges of the g segments of an n-element vector (sizes differ by <= 1)."""
    return [(k * n // g, (k + 1) * n // g) for k in range(g)]


def chunk_bounds(start: int, stop: int, chunk_elems: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of consecutive chunks of at most chunk_elems elements; [] if empty."""
    return [(a, min(a + chunk_elems, stop)) for a in range(start, stop, chunk_elems)]
