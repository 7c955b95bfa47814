"""The faults a `FaultProxy` (``transport.faultproxy``) does to the bytes it relays, per direction.

Set from any thread (``stall``, ``drop_after``, ``corrupt``, ``clear``; the proxy's methods of those
names check and document them), and applied by the proxy's relay loop to every block of bytes it
reads (``apply``): a stall holds a direction's bytes until it ends, a drop lets a budget of bytes
through and then has the connection that carried the last of them reset, a corruption flips one
bit in chosen bytes. Byte positions and budgets count the bytes read in a direction after the
call, over all connections together. Pure standard library.
"""

from __future__ import annotations

import math
import random
import threading
import time
from typing import Literal

Direction = Literal["up", "down", "both"]
DIRECTIONS = ("up", "down")


def directions(direction: Direction) -> tuple[str, ...]:
    """The directions ``direction`` names ("both": up and down)."""
    if direction == "both":
        return DIRECTIONS
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'up', 'down' or 'both', got {direction!r}")
    return (direction,)


class _Corruption:
    """Which byte positions (counted in one direction from `start`) get a bit flipped."""

    def __init__(self, start: int, probability: float | None, every_nth: int | None, at_offset: int | None,
                 rng: random.Random, xor_mask: int | None) -> None:
        self.probability, self.every_nth, self.once = probability, every_nth, at_offset is not None
        self.rng, self.xor_mask = rng, xor_mask
        if at_offset is not None:
            self.next = start + at_offset
        elif every_nth is not None:
            self.next = start + every_nth - 1
        else:
            self.next = start + self._gap()

    def _gap(self) -> int:
        p = self.probability
        if p >= 1.0:
            return 0
        # geometric gap: the number of untouched bytes before the next flipped one
        return int(math.log(1.0 - self.rng.random()) / math.log(1.0 - p))

    def mask(self) -> int:
        return self.xor_mask if self.xor_mask is not None else 1 << self.rng.randrange(8)

    def advance(self) -> bool:
        """Move to the next position; False when there is none (a one-shot offset)."""
        if self.once:
            return False
        self.next += self.every_nth if self.every_nth is not None else 1 + self._gap()
        return True


class StreamFaults:
    """The stalls, drop and corruptions set for each direction, and the bytes read in each. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stalled_until = {d: 0.0 for d in DIRECTIONS}
        self._corruption: dict[str, _Corruption | None] = {d: None for d in DIRECTIONS}
        self._drop_dirs: tuple[str, ...] = ()
        self._drop_left = 0
        self._read = {d: 0 for d in DIRECTIONS}  # bytes read per direction (corruption positions)
        self._corrupted = 0

    # -- set from any thread ---------------------------------------------------------------------
    def stall(self, seconds: float, direction: Direction) -> None:
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        with self._lock:
            until = time.monotonic() + seconds
            for d in directions(direction):
                self._stalled_until[d] = until

    def drop_after(self, nbytes: int, direction: Direction) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            self._drop_dirs, self._drop_left = directions(direction), int(nbytes)

    def corrupt(self, *, at_offset: int | None, every_nth: int | None, probability: float | None,
                direction: Direction, seed: int, xor_mask: int | None) -> None:
        if sum(v is not None for v in (at_offset, every_nth, probability)) != 1:
            raise ValueError("give exactly one of at_offset, every_nth, probability")
        if at_offset is not None and at_offset < 0:
            raise ValueError(f"at_offset must be >= 0, got {at_offset}")
        if every_nth is not None and every_nth < 1:
            raise ValueError(f"every_nth must be >= 1, got {every_nth}")
        if probability is not None and not 0.0 < probability <= 1.0:
            raise ValueError(f"probability must be in (0, 1], got {probability}")
        if xor_mask is not None and not 0 < xor_mask < 256:
            raise ValueError(f"xor_mask must be in [1, 255], got {xor_mask}")
        with self._lock:
            for d in directions(direction):
                rng = random.Random(f"{seed}/{d}")
                self._corruption[d] = _Corruption(self._read[d], probability, every_nth, at_offset, rng, xor_mask)

    def clear(self) -> None:
        with self._lock:
            self._stalled_until = {d: 0.0 for d in DIRECTIONS}
            self._corruption = {d: None for d in DIRECTIONS}
            self._drop_dirs, self._drop_left = (), 0

    # -- read by the relay loop ------------------------------------------------------------------
    @property
    def corrupted(self) -> int:
        """Bytes that had a bit flipped so far (both directions)."""
        with self._lock:
            return self._corrupted

    def stalled(self, direction: str) -> bool:
        with self._lock:
            return self._stalled_until[direction] > time.monotonic()

    def next_stall_end(self, now: float) -> float | None:
        """When the first stall still running at ``now`` ends; None when none runs."""
        with self._lock:
            ends = [t for t in self._stalled_until.values() if t > now]
        return min(ends) if ends else None

    def apply(self, direction: str, data: bytes) -> tuple[bytes | bytearray, bool]:
        """The bytes to forward of ``data``, just read in ``direction``, and whether a drop ended
        inside them (the connection is to be reset once they are written)."""
        d, reset = direction, False
        with self._lock:
            start = self._read[d]
            self._read[d] += len(data)
            if d in self._drop_dirs:
                if self._drop_left <= len(data):
                    data = data[:self._drop_left]
                    reset = True
                    self._drop_dirs, self._drop_left = (), 0
                else:
                    self._drop_left -= len(data)
            c = self._corruption[d]
            if c is None or c.next >= start + len(data):
                return data, reset
            out = bytearray(data)
            while c is not None and c.next < start + len(data):
                if c.next >= start:  # positions in bytes an earlier drop threw away are skipped
                    out[c.next - start] ^= c.mask()
                    self._corrupted += 1
                if not c.advance():
                    self._corruption[d] = c = None
            return out, reset
