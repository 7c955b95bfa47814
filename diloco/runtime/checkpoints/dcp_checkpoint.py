"""Checkpoints of a group with ``torch.distributed.checkpoint`` (DCP): every rank writes its shards.

``save(path, engine, model=None, optimizer=None)`` writes the engine's state
(``diloco.engine.dcp_state``: DTensors when the model is sharded), and optionally the model's own
parameters and the inner optimizer's state (``torch.distributed.checkpoint.state_dict``), in
parallel from every rank of the group, plus ``engine.json`` (counters and settings, written by
rank 0). ``load(...)`` reads them back into the same objects; a checkpoint written with another
number of ranks per group (or unsharded) is resharded by DCP, so resuming with 2 ranks what 4
ranks saved gives exactly the saved values. Resuming with the same ranks continues bit-identically.

Nothing read runs code from the files: DCP's own reader unpickles its ``.metadata`` and loads
non-tensor items with ``torch.load(weights_only=False)``; here the metadata goes through an
unpickler that admits only DCP's metadata classes, torch sizes and dtypes, and non-tensor items
load with ``weights_only=True``.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from diloco.engine.dcp_state import from_dcp, template, to_dcp

META_FILE = "engine.json"

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
     ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
     ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}


class CheckpointRefused(RuntimeError):
    """A checkpoint that cannot be read safely or does not fit (the message says why)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointRefused(f"the checkpoint's metadata names {module}.{name}, which a DCP metadata file never holds")


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata unpickling admits DCP's metadata classes only."""

    def read_metadata(self, *args: Any, **kwargs: Any):  # noqa: D102 - see the class
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor items with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:  # noqa: D102 - see the class
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _is_rank0(group: Any) -> bool:
    return not dist.is_initialized() or dist.get_rank(group) == 0


def _barrier(group: Any) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def save(path: str | Path, engine: Any, model: torch.nn.Module | None = None,
         optimizer: torch.optim.Optimizer | None = None, *, extra: dict[str, Any] | None = None,
         process_group: Any = None) -> Path:
    """Write the group's checkpoint to folder ``path`` (shared by the group's ranks; every rank
    calls this at the same point). ``extra``: JSON values kept beside (``load`` returns them)."""
    folder = Path(path)
    tensors, meta = to_dcp(engine)
    state: dict[str, Any] = {"engine": tensors}
    if model is not None:
        state["model"] = get_model_state_dict(model)
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    elif optimizer is not None:
        raise ValueError("an inner optimizer's state is saved with its model: pass model= too")
    meta["contains"] = sorted(state)
    meta["extra"] = extra or {}
    meta["group_size"] = dist.get_world_size(process_group) if dist.is_initialized() else 1
    if _is_rank0(process_group):
        folder.mkdir(parents=True, exist_ok=True)
    _barrier(process_group)
    dcp.save(state, checkpoint_id=str(folder), process_group=process_group)
    if _is_rank0(process_group):  # last: a folder without it is an unfinished checkpoint
        tmp = folder / (META_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.replace(folder / META_FILE)
    _barrier(process_group)
    return folder


def read_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's ``engine.json``; CheckpointRefused if it is missing (unfinished) or not JSON."""
    file = Path(path) / META_FILE
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointRefused(f"{path}: no {META_FILE}: not a finished diloco DCP checkpoint") from None
    except json.JSONDecodeError as e:
        raise CheckpointRefused(f"{file}: not JSON ({e})") from None


def load(path: str | Path, engine: Any, model: torch.nn.Module | None = None,
         optimizer: torch.optim.Optimizer | None = None, *, process_group: Any = None) -> dict[str, Any]:
    """Load the checkpoint in ``path`` into ``engine`` (and ``model``/``optimizer`` if given, which
    it must then hold), resharding where the layout differs. Returns the saved ``extra``."""
    meta = read_meta(path)
    wanted = ["engine"] + (["model"] if model is not None else []) + (["optimizer"] if optimizer is not None else [])
    missing = [k for k in wanted if k not in meta.get("contains", [])]
    if missing:
        raise CheckpointRefused(f"{path}: the checkpoint holds {meta.get('contains')}, not {missing}")
    if optimizer is not None and model is None:
        raise ValueError("an inner optimizer's state is loaded with its model: pass model= too")
    state: dict[str, Any] = {"engine": template(engine, meta)}
    _read(path, state, process_group)
    engine.load_state_dict(from_dcp(engine, state["engine"], meta))  # loads the global params into the model...
    if model is not None:  # ...so the model's own state is read after it (its entries alias the parameters)
        state = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(model, optimizer)
        _read(path, state, process_group)
        set_model_state_dict(model, state["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
    return meta.get("extra", {})


def _read(path: str | Path, state: dict[str, Any], process_group: Any) -> None:
    dcp.load(state, checkpoint_id=str(path), storage_reader=SafeReader(str(path)), planner=SafePlanner(),
             process_group=process_group)
