"""torchtitan's tokenizer and dataloader extension points, filled with this project's corpus.

``ByteTokenizer`` is a ``torchtitan.components.tokenizer.BaseTokenizer`` (a ``Configurable``): UTF-8
bytes as ids 0..255, built in code, so no tokenizer files (torchtitan's debug config reads
``./tests/assets/tokenizer`` from its source tree, which the wheel does not ship). ``CorpusDataLoader``
is a ``BaseDataLoader`` (a ``Configurable`` and ``Stateful``): the bundled Shakespeare (or a directory of
text files), split into training text and a held-out tail as ``diloco run`` splits it, the training
text cut into one contiguous shard per DiLoCo group (``shard`` of ``num_shards``), and each data-parallel
rank of a group drawing its rows through ``diloco.demo.data.EpochSampler`` (every window once per
epoch). Its position is a sample counter, saved in torchtitan's checkpoint (DCP) with the rest of the
trainer's state, so a resumed run continues with the next unseen window.

Import this module only through ``diloco.integrations.titan`` (which fixes torchtitan's device first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from diloco.demo import data as data_mod
from diloco.integrations import hf, titan_env

titan_env.load()

from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402


class TitanDataError(ValueError):
    """A corpus or data setting the torchtitan integration cannot use; the message says why."""


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as token ids 0..255 (no special tokens, no files): torchtitan's tokenizer interface."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, **kwargs: Any) -> None:
        super().__init__()
        self._bytes = hf.ByteTokenizer()

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        """Token ids of ``text``."""
        return self._bytes.encode(text).tolist()

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> str:
        """The text of ``ids`` (invalid UTF-8 replaced)."""
        return self._bytes.decode(ids)

    def get_vocab_size(self) -> int:
        """256."""
        return self._bytes.vocab_size


def corpus_splits(path: str, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, held-out tokens) of the corpus at ``path`` ("" = the bundled plays), as ``diloco
    run`` splits it (``diloco.demo.data.split``: the held-out part is the tail)."""
    tokenizer = hf.ByteTokenizer()
    try:
        tokens = hf.load_tokens(hf.text_files(path or None), tokenizer)
    except hf.HFTaskError as e:
        raise TitanDataError(str(e)) from None
    return data_mod.split(data_mod.Corpus(tokens, tokenizer.vocab_size, "text files"), val_fraction)


class CorpusDataLoader(BaseDataLoader):
    """One data-parallel rank's batches of its DiLoCo group's shard of a local text corpus.

    Yields ``({"input": x}, labels)``, both (``local_batch_size``, ``seq_len``) int64 ids (labels are
    the inputs shifted by one token). ``shard``/``num_shards``: the group's contiguous part of the
    training text (0 of 1: all of it, as a data-parallel job without DiLoCo trains)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "shakespeare"
        """a name for logs; the text is ``dataset_path``, or the bundled Shakespeare plays when it is empty"""
        val_fraction: float = 0.05
        """the held-out tail of the corpus (never trained; ``held_out`` batches come from it)"""
        seed: int = 0
        """the window order's seed (each shard adds its own offset)"""
        shard: int = 0
        """this group's shard of the training text (``DiLoCoTrainer`` sets it: its group)"""
        num_shards: int = 1
        """how many shards the training text is cut into (``DiLoCoTrainer`` sets it: its number of groups)"""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer | None,
                 seq_len: int, local_batch_size: int, **kwargs: Any) -> None:
        if not 0 <= config.shard < config.num_shards:
            raise TitanDataError(f"dataloader.shard={config.shard} outside 0..num_shards-1 ({config.num_shards})")
        if not 0.0 < config.val_fraction < 1.0:
            raise TitanDataError(f"dataloader.val_fraction={config.val_fraction}: must be in (0, 1)")
        if tokenizer is not None and tokenizer.get_vocab_size() != hf.ByteTokenizer.vocab_size:
            raise TitanDataError(f"CorpusDataLoader reads bytes (ids 0..255); the tokenizer has "
                                 f"{tokenizer.get_vocab_size()} ids: use tokenizer=ByteTokenizer.Config()")
        self.config, self.seq_len, self.batch_size = config, seq_len, local_batch_size
        train, self._val = corpus_splits(config.dataset_path or "", config.val_fraction)
        lo, hi = data_mod.shard_bounds(len(train), config.num_shards, config.shard)
        try:
            self.sampler = data_mod.EpochSampler(train[lo:hi], local_batch_size, seq_len,
                                                 seed=config.seed + 7919 * (config.shard + 1),
                                                 rank=dp_rank, group_size=dp_world_size)
        except data_mod.DataError as e:
            raise TitanDataError(f"shard {config.shard} of {config.num_shards}: {e}") from None

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            x, y = self.sampler.next()
            yield {"input": x}, y

    def held_out(self, batches: int, batch_size: int | None = None) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """``batches`` held-out batches (the same on every rank and group)."""
        out = data_mod.eval_batches(self._val, batch_size or self.batch_size, self.seq_len, batches)
        return [({"input": x}, y) for x, y in out]

    def state_dict(self) -> dict[str, Any]:
        """The group's sample counter and what it counts (plain values: saved by torchtitan's checkpointer)."""
        return dict(self.sampler.state())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue after the samples ``state_dict`` counted; TitanDataError if it is another sampler's."""
        try:
            self.sampler.load_state(dict(state_dict))
        except data_mod.DataError as e:
            raise TitanDataError(f"the checkpoint's data position does not fit this dataloader: {e}") from None
