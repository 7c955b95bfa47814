"""The state format healers receive: exact round trip, and every malformed blob refused."""

import json
import struct

import pytest
import torch

from diloco.exchange import state_blob
from diloco.exchange.state_blob import StateFormatError


def sample() -> dict:
    return {"version": 1, "fragments": [{"global": {"w": torch.randn(3, 4), "b": torch.zeros(0)},
                                         "outer_optimizer": {"state": {0: {"momentum_buffer": torch.randn(12)}},
                                                             "param_groups": [{"lr": 0.7, "betas": (0.9, 0.99),
                                                                               "params": [0, 1]}]},
                                         "in_flight": None, "round": 3}],
            "mask": torch.tensor([True, False]), "steps": torch.arange(5), "nan": float("nan")}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return a == b


def test_round_trip_is_exact_including_int_keys_tuples_negative_zero_and_nan():
    tree = sample()
    tree["fragments"][0]["global"]["w"][0, 0] = -0.0
    assert same(state_blob.unpack(state_blob.pack(tree)), tree)


@pytest.mark.parametrize("nbytes", [0, 1, 2, 3, 4, 1000, 1001])
def test_bytes_cross_an_fp32_mean_exactly(nbytes):
    data = bytes(range(256)) * 4
    data = data[:nbytes]
    values = state_blob.to_values(data)
    assert values.numel() == state_blob.num_values(nbytes)
    mean = (values + torch.zeros_like(values)) / 2  # what a two-member ring computes
    assert state_blob.from_values(mean, nbytes) == data
    with pytest.raises(StateFormatError):
        state_blob.from_values(mean + 0.5, nbytes) if nbytes else state_blob.from_values(torch.zeros(1), 0)


def corrupt_header(blob: bytes, edit) -> bytes:
    magic, version, hlen = struct.unpack_from("<8sIQ", blob)
    header = json.loads(blob[20:20 + hlen])
    edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<8sIQ", magic, version, len(raw)) + raw + blob[20 + hlen:]


@pytest.mark.parametrize("edit,match", [
    (lambda h: h["tensors"][0].update(dtype="object"), "dtype"),
    (lambda h: h["tensors"][0].update(shape=[1 << 40]), "do not match"),
    (lambda h: h["tensors"][0].update(offset=-1), "offset"),
    (lambda h: h["tensors"][0].update(nbytes=4), "do not match"),
    (lambda h: h.update(extra=1), "exactly"),
    (lambda h: h["tree"].update(x={"$t": 99}), "out of range"),
    (lambda h: h["tree"].update(x={"$code": "os.system"}), "unknown marker"),
])
def test_a_malformed_header_is_refused_before_anything_is_built(edit, match):
    blob = corrupt_header(state_blob.pack(sample()), edit)
    with pytest.raises(StateFormatError, match=match):
        state_blob.unpack(blob)


def test_truncated_or_foreign_bytes_are_refused():
    blob = state_blob.pack(sample())
    for bad in (blob[:10], blob[:-1], b"PK\x03\x04" + blob[4:], blob[:8] + b"\x02" + blob[9:]):
        with pytest.raises(StateFormatError):
            state_blob.unpack(bad)
    with pytest.raises(ValueError, match="cannot send"):
        state_blob.pack({"x": object()})
