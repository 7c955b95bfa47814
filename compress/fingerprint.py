"""A 64-bit fingerprint of fp32 tensors that is the same number on every device.

DiLoCo groups report a hash of their global parameters after every round, and the lead of each
exchange sends one with its quorum request; groups compare them, and a healing group checks the
state it received against one. On a GPU, hashing the bytes on the host (XXH3) first copies every
parameter to the host: 340 MB per hash at 85M parameters. This fingerprint is computed where the
tensors live -- a few elementwise integer kernels and a sum on a GPU, one pass in C on a CPU --
and only 8 bytes cross to the host. It is exact integer arithmetic (products and sums mod 2^64),
so a CPU and a GPU, or two GPU models, give the same fingerprint for the same bits.

Definition. The tensors' values, flattened and in order, form one stream of unsigned 32-bit words
x_g (their fp32 bit patterns); with n_i the length of tensor i, rows of 1024 words (word g in
row r = g // 1024, column c = g % 1024) and per-column keys k1[c], k2[c] (32-bit, SplitMix64):

    a_r = sum over row r's words of (x_g ^ k1[c]) * (x_g ^ k2[c])            (64-bit products)
    F   = avalanche( sum_r a_r * (r * W1 + W2 | 1)  +  sum_i n_i * (i * W3 + W4 | 1) )
                                                                                all mod 2^64

A change of one value changes its row's a_r unless the two products happen to be equal, and
the odd row weight carries it into F; values swapped between columns or rows change F, and the
lengths term tells apart the same stream cut into other tensors. It tells apart groups whose
parameters differ (one value is enough); where several values differ, only in bits j and above
(e.g. signs only), 64 - j bits of it are left to tell them apart. It is not a defence against
forgery, as a group reports whatever it likes. Groups that compare fingerprints must all run a
version that has it (2026-11-23 on): before, the round hash was XXH3-128 of the bytes.

On CPU tensors the sum runs in ``compress/_native.c`` (GIL released) where it is built; the
torch path, which gives the same number (tests/compress/test_fingerprint.py), runs on every
other device and where the kernels are not built.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .codecs import blockwise

ROW = 1024
MASK64 = (1 << 64) - 1
W1, W2 = 0x9E3779B97F4A7C15, 0x632BE59BD9B4E019  # row weights (also in _native.c)
W3, W4 = 0xD6E8FEB86659FD93, 0xA0761D6478BD642F  # tensor weights
#: words per step of the torch path: on a GPU 4 Mi words (a 16 MiB concatenation of the tensors'
#: words and two int64 temporaries of 32 MiB), so a model of many small tensors costs some ten
#: kernel launches per step, not per tensor; on a CPU without the kernels, small steps that stay
#: in cache (measured best of 32 .. 16384 rows)
_STEP_WORDS = {"cpu": 32 * ROW}
_STEP_WORDS_ELSEWHERE = 4096 * ROW


def _splitmix64(state: int) -> tuple[int, int]:
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def _column_keys() -> tuple[torch.Tensor, torch.Tensor]:
    k1, k2, state = [], [], 0x5EED_F1D6_E4A1_0001
    for _ in range(ROW):
        state, z = _splitmix64(state)
        k1.append(z & 0xFFFFFFFF)
        k2.append(z >> 32)
    return torch.tensor(k1, dtype=torch.int64), torch.tensor(k2, dtype=torch.int64)


_K1, _K2 = _column_keys()  # int64 holding 32-bit keys: the torch path's operands
_K1_U32, _K2_U32 = _K1.to(torch.int32), _K2.to(torch.int32)  # the same bits, for the C kernel
_keys_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _signed(v: int) -> int:
    """v mod 2^64 as a signed int64 (what a torch int64 tensor holds)."""
    v &= MASK64
    return v - (1 << 64) if v >> 63 else v


def row_weight(r: int) -> int:
    """The odd weight of row r (mod 2^64)."""
    return ((r * W1 + W2) & MASK64) | 1


def tensor_weight(i: int) -> int:
    """The odd weight of tensor i's length (mod 2^64)."""
    return ((i * W3 + W4) & MASK64) | 1


def _rows_torch(words: torch.Tensor, start: int) -> torch.Tensor:
    """sum_r a_r * row weight over words (int32, on any device) at stream offsets start ..
    start + len - 1: an int64 scalar on their device, not yet read (mod 2^64)."""
    dev = words.device
    if dev not in _keys_on:
        _keys_on[dev] = (_K1.to(dev), _K2.to(dev))
    k1, k2 = _keys_on[dev]
    total = torch.zeros((), dtype=torch.int64, device=dev)
    c0 = start % ROW
    if c0 and words.numel():  # the end of a row begun before these words
        head = min(ROW - c0, words.numel())
        u = words[:head].to(torch.int64) & 0xFFFFFFFF
        total += ((u ^ k1[c0:c0 + head]) * (u ^ k2[c0:c0 + head])).sum() * _signed(row_weight(start // ROW))
        words, start = words[head:], start + head
    n, full, r0 = words.numel(), words.numel() // ROW, start // ROW
    if full:
        u = words[:full * ROW].view(full, ROW).to(torch.int64).bitwise_and_(0xFFFFFFFF)
        t = u ^ k1
        a = t.mul_(u.bitwise_xor_(k2)).sum(dim=1)  # wraps mod 2^64, in any order: the same everywhere
        del u, t
        r = torch.arange(r0, r0 + full, dtype=torch.int64, device=dev)
        total += (a * ((r * _signed(W1) + _signed(W2)) | 1)).sum()
    if n > full * ROW:
        u = words[full * ROW:].to(torch.int64) & 0xFFFFFFFF
        t = n - full * ROW
        total += ((u ^ k1[:t]) * (u ^ k2[:t])).sum() * _signed(row_weight(r0 + full))
    return total


def _stream_torch(flats: list[torch.Tensor], start: int, step: int) -> torch.Tensor:
    """The rows part of the sum for flat fp32 tensors on one device whose words sit at stream
    offsets start onwards, in steps of about step words cut across tensor boundaries."""
    total = None
    pieces: list[torch.Tensor] = []
    have, at = 0, start
    for x in flats:
        w, off = x.view(torch.int32), 0
        while off < w.numel():
            take = min(w.numel() - off, step - have)
            pieces.append(w[off:off + take])
            have, off = have + take, off + take
            if have == step:
                part = _rows_torch(torch.cat(pieces) if len(pieces) > 1 else pieces[0], at)
                total = part if total is None else total + part
                pieces, have, at = [], 0, at + step
    if have:
        part = _rows_torch(torch.cat(pieces) if len(pieces) > 1 else pieces[0], at)
        total = part if total is None else total + part
    return total


def _avalanche(z: int) -> int:
    z = ((z ^ (z >> 33)) * 0xFF51AFD7ED558CCD) & MASK64
    z = ((z ^ (z >> 33)) * 0xC4CEB9FE1A85EC53) & MASK64
    return z ^ (z >> 33)


def fingerprint(tensors: Sequence[torch.Tensor], native: bool = True) -> int:
    """The fingerprint (an unsigned 64-bit int) of the tensors' values as fp32, in order.

    Tensors of another dtype are converted to fp32 first, on their device. On a GPU the whole
    sum stays there and is read once (one synchronization). native=False takes the torch path on
    CPU too (the tests compare the two)."""
    flats = []
    for t in tensors:
        x = t.detach()
        if x.dtype != torch.float32:
            x = x.to(torch.float32)
        flats.append(x.contiguous().reshape(-1))
    h = sum(x.numel() * tensor_weight(i) for i, x in enumerate(flats))
    use_kernel = native and blockwise.native_available()
    start, i = 0, 0
    while i < len(flats):  # runs of consecutive tensors on one device
        j = i
        while j < len(flats) and flats[j].device == flats[i].device:
            j += 1
        run, dev = flats[i:j], flats[i].device
        if dev.type == "cpu" and use_kernel:
            at = start
            for x in run:
                h += blockwise._native.fingerprint32(x.data_ptr(), x.numel(), at, _K1_U32.data_ptr(),
                                                     _K2_U32.data_ptr())
                at += x.numel()
        elif any(x.numel() for x in run):
            h += int(_stream_torch(run, start, _STEP_WORDS.get(dev.type, _STEP_WORDS_ELSEWHERE)).item())
        start += sum(x.numel() for x in run)
        i = j
    return _avalanche(h & MASK64)
