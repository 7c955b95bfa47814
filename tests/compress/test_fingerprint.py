"""compress.fingerprint: the definition (checked against plain Python integers), the C kernel
against the torch path, what it tells apart, and CPU against GPU where there is one."""

import pytest
import torch

from compress import fingerprint as fp
from compress.codecs import blockwise

MASK = (1 << 64) - 1


def words_of(tensors) -> list[int]:
    out = []
    for t in tensors:
        out += [x & 0xFFFFFFFF for x in t.detach().to(torch.float32).reshape(-1).view(torch.int32).tolist()]
    return out


def rows_part(words: list[int], start: int = 0) -> int:
    """sum_r a_r * (r * W1 + W2 | 1) for words at stream offsets start onwards (mod 2^64)."""
    k1 = [int(k) for k in fp._K1]
    k2 = [int(k) for k in fp._K2]
    rows: dict[int, int] = {}
    for g, x in enumerate(words, start):
        c = g % fp.ROW
        rows[g // fp.ROW] = (rows.get(g // fp.ROW, 0) + (x ^ k1[c]) * (x ^ k2[c])) & MASK
    return sum(a * (((r * fp.W1 + fp.W2) & MASK) | 1) for r, a in rows.items()) & MASK


def reference(tensors) -> int:
    """The module docstring's definition, word by word in Python integers."""
    h = rows_part(words_of(tensors))
    h += sum(t.numel() * (((i * fp.W3 + fp.W4) & MASK) | 1) for i, t in enumerate(tensors))
    return fp._avalanche(h & MASK)


def special_values() -> torch.Tensor:
    bits = torch.tensor([0x7FC00001, 0xFFC00000, 0x7F800000, 0xFF800000, 0x80000000, 0, 1, 0x7F7FFFFF],
                        dtype=torch.int64).to(torch.int32)
    return bits.view(torch.float32)


CASES = {
    "empty": [torch.empty(0)],
    "one": [torch.tensor([1.5])],
    "one row": [torch.randn(1024, generator=torch.Generator().manual_seed(1))],
    "rows and a tail": [torch.randn(3 * 1024 + 7, generator=torch.Generator().manual_seed(2))],
    "several tensors": [torch.randn(5, 300, generator=torch.Generator().manual_seed(3)), torch.randn(1),
                        torch.randn(2048, generator=torch.Generator().manual_seed(4))],
    "rows across tensors": [torch.randn(1000, generator=torch.Generator().manual_seed(9)), torch.empty(0),
                            torch.randn(30), torch.randn(2100, generator=torch.Generator().manual_seed(10))],
    "special values": [special_values(), -special_values()],
}


@pytest.mark.parametrize("name", list(CASES))
def test_both_paths_give_the_definition(name):
    tensors = CASES[name]
    want = reference(tensors)
    assert fp.fingerprint(tensors, native=False) == want
    assert fp.fingerprint(tensors) == want


@pytest.mark.skipif(not blockwise.native_available(), reason="compress/_native.c is not built (pip install -e .)")
def test_the_kernel_matches_the_torch_path_on_large_tensors():
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(300_001, generator=g) * 1e30, torch.randn(77, 1024, generator=g), torch.zeros(4096)]
    assert fp.fingerprint(tensors) == fp.fingerprint(tensors, native=False)


@pytest.mark.parametrize("start", [0, 500, 1024, 3000])
def test_the_torch_paths_steps_cut_across_tensors_and_rows(start):
    """The GPU's path in small steps: steps that end inside tensors and rows, a stream that
    starts inside a row (a run of GPU tensors after CPU ones), tensors shorter than a row."""
    g = torch.Generator().manual_seed(11)
    flats = [torch.randn(n, generator=g) for n in (700, 5, 2500, 1024, 3)]
    got = fp._stream_torch(flats, start, 2 * fp.ROW)
    assert int(got) & MASK == rows_part(words_of(flats), start)


def test_it_tells_apart_what_differs():
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(2500, generator=g), torch.randn(700, generator=g)
    base = fp.fingerprint([a, b])
    seen = {base}
    for pos in (0, 1023, 1024, 2047, 2499):  # row starts and ends, and the tail
        c = a.clone()
        c[pos] = torch.nextafter(c[pos], torch.tensor(float("inf")))  # one ulp
        seen.add(fp.fingerprint([c, b]))
    swapped_in_row, swapped_rows = a.clone(), a.clone()
    swapped_in_row[[3, 4]] = a[[4, 3]]
    swapped_rows[[3, 1027]] = a[[1027, 3]]
    zero, negzero = a.clone(), a.clone()
    zero[10], negzero[10] = 0.0, -0.0
    for variant in ([swapped_in_row, b], [swapped_rows, b], [b, a], [torch.cat([a, b])], [a[:1000], a[1000:], b],
                    [zero, b], [negzero, b], [a]):
        seen.add(fp.fingerprint(variant))
    assert len(seen) == 1 + 5 + 8  # every variant its own value


def test_the_same_values_give_the_same_fingerprint_whatever_the_layout():
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(7))
    assert fp.fingerprint([x]) == fp.fingerprint([x.reshape(-1)]) == fp.fingerprint([x.t().contiguous().t()])
    assert fp.fingerprint([x.to(torch.float64)]) == fp.fingerprint([x])  # converted to fp32 first
    assert 0 <= fp.fingerprint([x]) <= MASK


def test_params_hash_is_the_fingerprint_in_hex():
    from diloco.engine.outer_state import params_hash

    x = [torch.randn(100), torch.randn(3, 3)]
    assert params_hash(x) == f"{fp.fingerprint(x):016x}" and len(params_hash(x)) == 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_gives_the_cpus_fingerprint():
    g = torch.Generator().manual_seed(8)
    tensors = [torch.randn(1_000_003, generator=g), torch.randn(64, 1024, generator=g), special_values()]
    on_gpu = [t.cuda() for t in tensors]
    assert fp.fingerprint(on_gpu) == fp.fingerprint(tensors) == fp.fingerprint(tensors, native=False)
