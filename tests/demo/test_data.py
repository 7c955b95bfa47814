import numpy as np
import pytest
import torch

from diloco.demo import data
from diloco.demo.model import GPT, GPTConfig


def test_bundled_shakespeare_is_real_text():
    corpus = data.load_corpus(None)
    assert len(corpus) > 1_000_000 and corpus.vocab_size == 256
    assert b"HAMLET" in corpus.tokens.tobytes().upper()


def test_directory_of_text_files_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "a.txt").write_text("first")
    corpus = data.load_corpus(tmp_path)
    assert corpus.tokens.tobytes() == b"first\nsecond\nthird"


def test_uint16_bin_file(tmp_path):
    tokens = np.arange(5000, dtype=np.uint16) % 1234
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    corpus = data.load_corpus(path)
    assert corpus.vocab_size == 1234 and np.array_equal(np.asarray(corpus.tokens), tokens)
    x, y = data.BatchSampler(corpus.tokens, 3, 16, seed=0).next()
    assert x.dtype == torch.int64 and x.shape == (3, 16) and torch.equal(x[:, 1:], y[:, :-1])
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, block_size=16, n_layer=1, n_embd=32))
    _, loss = model(x, y)
    assert torch.isfinite(loss)


def test_bad_sources_are_clear_errors(tmp_path):
    with pytest.raises(data.DataError, match="does not exist"):
        data.load_corpus(tmp_path / "missing")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(data.DataError, match="uint16"):
        data.load_corpus(odd)
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.DataError, match="no text files"):
        data.load_corpus(tmp_path / "empty")


def test_shards_partition_the_tokens():
    bounds = [data.shard_bounds(103, 4, i) for i in range(4)]
    assert bounds[0][0] == 0 and bounds[-1][1] == 103
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    with pytest.raises(data.DataError, match="cannot feed"):
        data.check_feedable(100, 4, block_size=32)


def test_sampler_is_seeded_and_eval_batches_deterministic():
    tokens = np.frombuffer(bytes(range(256)) * 50, dtype=np.uint8)
    a = data.BatchSampler(tokens, 4, 8, seed=3).next()[0]
    b = data.BatchSampler(tokens, 4, 8, seed=3).next()[0]
    c = data.BatchSampler(tokens, 4, 8, seed=4).next()[0]
    assert torch.equal(a, b) and not torch.equal(a, c)
    e1 = data.eval_batches(tokens, 4, 8, 3)
    e2 = data.eval_batches(tokens, 4, 8, 3)
    assert len(e1) == 3 and all(torch.equal(p[0], q[0]) for p, q in zip(e1, e2))
