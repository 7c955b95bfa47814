
import pytest
import torch

from diloco.demo.model import GPT, GPTConfig
from diloco.runtime.checkpoints import checkpoint
from diloco.runtime.checkpoints.checkpoint import CheckpointError


def small():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))


def test_round_trip_into_a_model(tmp_path):
    m = small()
    path = checkpoint.save(tmp_path / "ck" / "global.pt",
                           {"global": {n: p.detach() for n, p in m.named_parameters()}, "step": 7, "note": "x"})
    fresh = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
    state = checkpoint.load_global_model(path, fresh)
    assert state["step"] == 7
    for a, b in zip(m.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["global.pt", "global.pt.sha256"]


def test_flipped_byte_and_truncation_are_detected(tmp_path):
    path = checkpoint.save(tmp_path / "g.pt", {"global": {"w": torch.ones(100)}})
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="do not match"):
        checkpoint.load(path)
    path = checkpoint.save(tmp_path / "h.pt", {"global": {"w": torch.ones(100)}})
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="truncated or altered"):
        checkpoint.load(path)


def test_missing_file_or_checksum(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        checkpoint.load(tmp_path / "nope.pt")
    path = checkpoint.save(tmp_path / "g.pt", {"global": {}})
    (tmp_path / "g.pt.sha256").unlink()
    with pytest.raises(CheckpointError, match="checksum file"):
        checkpoint.load(path)


class Evil:
    def __reduce__(self):
        return (print, ("code ran",))


def test_pickled_objects_are_refused_even_with_a_matching_checksum(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    torch.save({"global": {}, "payload": Evil()}, path)
    import hashlib

    (tmp_path / "evil.pt.sha256").write_text(hashlib.sha256(path.read_bytes()).hexdigest())
    with pytest.raises(CheckpointError, match="weights-only"):
        checkpoint.load(path)
    assert "code ran" not in capsys.readouterr().out


def test_shape_mismatch_is_a_clear_error(tmp_path):
    path = checkpoint.save(tmp_path / "g.pt", {"global": {n: torch.zeros(1) for n, _ in small().named_parameters()}})
    with pytest.raises(CheckpointError, match="has shape"):
        checkpoint.load_global_model(path, small())
