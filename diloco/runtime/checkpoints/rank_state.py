"""One rank's training state as a dict of tensors and plain values, and back.

``capture`` takes everything the next inner step depends on: the engine's ``state_dict()``
(global parameters, outer-optimizer state, rounds, next syncs, exchanges in flight — landed, so
every group stores the same mean), the model's own (local) parameters and buffers, the inner
optimizer's state, the data position (``Task.data_state``), the torch / CUDA / numpy / Python
RNG states, the step, the smoothed training loss and the config. ``restore`` puts it back, in the
order that makes the next inner step the one an uninterrupted run takes. Everything in the dict
loads with ``torch.load(weights_only=True)``; ``diloco.runtime.checkpoints.job_checkpoint`` writes it to disk.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn as nn

from diloco.engine.averaging import Averager
from diloco.job.config import Config
from diloco.runtime.checkpoints import local_shards

FORMAT = "diloco-rank-state"
VERSION = 1
STEP_BITS = 48  # agree_on_step compares steps below 2**48


@dataclass(frozen=True)
class Progress:
    """Where a restored rank stands: inner steps done, smoothed loss, the run's initial eval loss,
    and H of every round of fragment 0 so far (what the summary shows)."""

    step: int
    loss_ema: float | None
    initial_eval_loss: float
    periods: tuple[int, ...] = ()


def engine_state(engine: Any) -> dict[str, Any]:
    """``engine.state_dict()`` (lands exchanges in flight), or the counters of the data-parallel
    baseline, whose model is its whole state."""
    if hasattr(engine, "state_dict"):
        return engine.state_dict()
    return {"mode": engine.mode, "round": int(engine.round), "inner_step": int(engine.inner_step),
            "finished": bool(engine.finished)}


def load_engine_state(engine: Any, state: dict[str, Any]) -> None:
    """Inverse of ``engine_state``; ValueError if it is another mode's state."""
    if hasattr(engine, "load_state_dict"):
        engine.load_state_dict(state)
        return
    if state.get("mode") != engine.mode:
        raise ValueError(f"engine state is for mode {state.get('mode')!r}, this engine runs {engine.mode!r}")
    engine.round, engine.inner_step = int(state["round"]), int(state["inner_step"])
    engine.finished = bool(state["finished"])


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """The global RNG states: torch (CPU), CUDA (``device``'s, if a CUDA device), numpy, Python."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None,
        "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": version, "state": list(py_state), "gauss": py_gauss},
    }


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))


def capture(*, step: int, cfg: Config | None, engine: Any, model: nn.Module, inner: torch.optim.Optimizer,
            task: Any = None, loss_ema: float | None = None, initial_eval_loss: float = math.nan,
            group: int = 0, rank: int = 0, device: torch.device | None = None,
            periods: Sequence[int] = (),
            data_positions: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """This rank's state after ``step`` inner steps (``model``: the bare module, not DDP). The
    dict shares tensors with the live objects: save it before training on. Waits for the
    exchanges in flight, so every group must call it at the same step. ``data_positions``: returns the
    table of every group's committed data position (``DataPositions.state``), called after the
    engine's state is taken so that it holds the exchanges the engine landed."""
    if engine.inner_step != step:
        raise ValueError(f"the engine counted {engine.inner_step} inner steps, the caller {step}")
    data_state = getattr(task, "data_state", None)
    return {
        "format": FORMAT, "version": VERSION, "step": int(step), "group": int(group), "rank": int(rank),
        "config": cfg.to_dict() if cfg is not None else None,
        "engine": engine_state(engine),
        "data_positions": data_positions() if data_positions is not None else None,
        "model": local_shards.localize(model.state_dict()),  # a sharded (FSDP2) model: this rank's shards
        "inner_optimizer": local_shards.localize(inner.state_dict()),
        "data": data_state() if data_state is not None else None,
        "rng": rng_state(device),
        "loss_ema": loss_ema,
        "initial_eval_loss": float(initial_eval_loss),
        "periods": [int(h) for h in periods],
    }


def restore(state: dict[str, Any], *, engine: Any, model: nn.Module, inner: torch.optim.Optimizer,
            task: Any = None, batches: Iterator[Any] | None = None,
            device: torch.device | None = None) -> Progress:
    """Put ``capture``'s state back into freshly built objects (the same model, optimizer and
    engine configuration). Data: ``task.load_data_state`` if the task has it, else the first
    ``step`` batches of ``batches`` are drawn and discarded. RNG states last, after the data.
    Raises ValueError (or RuntimeError from torch) when something does not fit."""
    step = int(state["step"])
    load_engine_state(engine, state["engine"])  # loads the global parameters into the model ...
    local_shards.load_model_state(model, state["model"])  # ... then the group's own, mid-round ones
    local_shards.load_optimizer_state(inner, state["inner_optimizer"])
    load_data_state = getattr(task, "load_data_state", None)
    if load_data_state is not None:
        if state.get("data") is None:
            raise ValueError("the checkpoint holds no data position, but the task keeps one (Task.data_state)")
        load_data_state(state["data"])
    elif batches is not None:
        for drawn in range(step):
            try:
                next(batches)
            except StopIteration:
                raise ValueError(f"train_batches ran out after {drawn} batches while replaying {step}") from None
    set_rng_state(state["rng"], device)
    loss = state.get("loss_ema")
    return Progress(step, None if loss is None else float(loss), float(state.get("initial_eval_loss", math.nan)),
                    tuple(int(h) for h in state.get("periods", ())))


@torch.no_grad()
def agree_on_step(averager: Averager, step: int, *, tag: str) -> None:
    """A barrier across groups that also checks they all stand at ``step``: each group sends the
    bits of ``step`` as 0/1 values (fp32, exact); the mean of a bit is 0 or 1 only if every group
    sent the same, so every group sees a difference and raises ValueError."""
    if getattr(averager, "num_groups", 1) < 2:
        return
    if not 0 <= step < 2**STEP_BITS:
        raise ValueError(f"step {step} outside [0, 2**{STEP_BITS})")
    bits = torch.tensor([(step >> i) & 1 for i in range(STEP_BITS)], dtype=torch.float32)
    mean = averager.start(bits, tag=tag, exact=True).wait().to("cpu")
    if not torch.equal(mean, bits):
        raise ValueError(f"{tag}: the groups are not at the same step (this group: {step}); resume every "
                         "group from the same checkpoint step (--resume DIR/step-NNNNNN)")
