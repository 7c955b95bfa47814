"""``DiLoCoTrainer``: torchtitan's ``Trainer``, its data-parallel replicas one DiLoCo group.

The extension point is torchtitan's own: a ``Trainer`` subclass whose ``Config`` subclasses
``Trainer.Config`` with one more section, ``diloco`` (``DiLoCoSection``: ``--diloco.group 1
--diloco.sync_every 20`` on torchtitan's command line), as torchtitan's ``experiments/torchft``
adds ``fault_tolerance``. Everything inside the group is torchtitan's: its model, parallelism (FSDP2
over the group's ranks: ``data_parallel_shard_degree``), inner optimizer, lr schedule, gradient
clipping, metrics and checkpoints. After each of torchtitan's optimizer steps (``train_step``) the
engine (``diloco.DiLoCo``) counts one inner step and, every ``sync_every`` steps, exchanges the
pseudo-gradient of this rank's shard with the other groups through the averager the caller connects
(``diloco.connect``: this project's coordinator and data plane), applies the outer Nesterov step and
loads the global parameters into the model. Groups end every round bit-identical.

Checkpoints stay torchtitan's (``CheckpointManager``, DCP): the engine's state (global parameters as
DTensors, outer momentum, round: ``diloco.engine.dcp_state``) is part of the trainer's ``train_state``. A checkpoint is only taken
where the model holds the global parameters (``checkpoint.interval`` and ``training.steps`` multiples of
``sync_every``, checked at start), so a resumed group continues bit-identically.

Import this module only through ``diloco.integrations.titan`` (which fixes torchtitan's device first).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from diloco.engine.averaging import Averager, SingleGroup
from diloco.engine.dcp_state import from_dcp, template, to_dcp
from diloco.engine.diloco import DiLoCo
from diloco.engine.outer import nesterov
from diloco.integrations import titan_env
from diloco.integrations.titan_data import CorpusDataLoader

titan_env.load()

from torchtitan.trainer import Trainer  # noqa: E402


class TitanConfigError(ValueError):
    """A torchtitan config the DiLoCo trainer cannot run; the message says which field and why."""


@dataclass(kw_only=True, slots=True)
class DiLoCoSection:
    """The ``diloco`` section of ``DiLoCoTrainer.Config`` (``--diloco.KEY VALUE`` on the command line)."""

    coordinator: str = ""
    """host:port of ``diloco coordinator`` (read by the example that connects; empty with one group)"""
    group: int = 0
    """this group's id, 0..groups-1 (also its shard of the training text)"""
    groups: int = 2
    """groups in the job"""
    sync_every: int = 20
    """H: inner steps (torchtitan optimizer steps) between two exchanges"""
    codec: str = "fp32"
    """the wire codec between groups (fp32, bf16, int8, int4, ...)"""
    probe_bytes: int = -1
    """bytes per bandwidth probe to each other group at start (0: none; -1: the data plane's default)"""
    outer_lr: float = 0.7
    """outer Nesterov learning rate"""
    outer_momentum: float = 0.9
    """outer Nesterov momentum"""
    eval_batches: int = 8
    """held-out batches the global model is evaluated on at the start and the end"""
    summary_json: str = ""
    """rank 0 of the group writes the group's summary (eval loss, round hashes, bytes) here"""


class DiLoCoTrainer(Trainer):
    """torchtitan's Trainer with DiLoCo between groups; ``connect()`` returns the averager (called
    once torch.distributed is up, on every rank of the group)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        diloco: DiLoCoSection = field(default_factory=DiLoCoSection)

    def __init__(self, config: Config, *, connect: Callable[[], Averager] | None = None) -> None:
        check_config(config, connected=connect is not None)
        if isinstance(config.dataloader, CorpusDataLoader.Config):  # the group's shard of the text
            config.dataloader.shard, config.dataloader.num_shards = config.diloco.group, config.diloco.groups
        self.engine: DiLoCo | None = None
        self.averager: Averager | None = None
        self.summary: dict[str, Any] = {}
        super().__init__(config)
        if len(self.model_parts) != 1:
            raise TitanConfigError("DiLoCoTrainer trains one model part: pipeline parallelism is not supported")
        self.averager = connect() if connect is not None else SingleGroup()
        # the engine reads the inner lr from its optimizer's first group: torchtitan's container of
        # optimizers keeps the lrs in the optimizers it holds
        self.engine = DiLoCo(self.model_parts[0], self.optimizers.optimizers[0], averager=self.averager,
                             sync_every=config.diloco.sync_every,
                             outer_optimizer=nesterov(config.diloco.outer_lr, config.diloco.outer_momentum))
        self.held_out = (self.dataloader.held_out(config.diloco.eval_batches)
                         if isinstance(self.dataloader, CorpusDataLoader) else [])
        self.initial_eval_loss = self.evaluate()
        self.logged_loss: float | None = None  # the global mean loss torchtitan logged last
        self._keep_logged_loss()
        # the group's data-parallel degree (tensor- and context-parallel ranks see the same samples)
        self.data_degree = self.parallel_dims.get_mesh("batch").size() if self.parallel_dims.dp_enabled else 1
        #: tokens the group trains on per step: every micro-batch of every data-parallel rank
        self.tokens_per_step = (self.gradient_accumulation_steps * config.training.local_batch_size * self.data_degree
                                * config.training.seq_len)

    def _keep_logged_loss(self) -> None:
        """Keep each loss torchtitan's metrics processor logs (every ``--metrics.log_freq`` steps),
        for the progress reports to the coordinator."""
        log = self.metrics_processor.log

        def log_and_keep(step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> Any:
            self.logged_loss = float(global_avg_loss)
            return log(step, global_avg_loss, *args, **kwargs)

        self.metrics_processor.log = log_and_keep

    def train_step(self, data_iterator: Any) -> None:
        """torchtitan's step (forward, backward, clip, optimizer, lr), then one engine step; on
        torchtitan's logging steps, a round's end and the last step, a progress report to the
        coordinator (what ``diloco status`` and the coordinator's metrics show): the step's lr, the
        loss torchtitan logged last (every ``--metrics.log_freq`` steps)."""
        lr = float(self.optimizers.optimizers[0].param_groups[0]["lr"])  # the step's: it moves the schedule on
        super().train_step(data_iterator)
        assert self.engine is not None
        events = self.engine.step()
        report = getattr(self.averager, "report_progress", None)
        steps = self.config.training.steps
        if report is not None and (self.metrics_processor.should_log(self.step) or events or self.step == steps):
            report(loss=self.logged_loss, step=self.step, steps=steps, lr=lr, tokens_per_step=self.tokens_per_step)

    def train(self) -> None:
        """torchtitan's loop; then the engine lands its last exchange (the model holds the global
        parameters), the global model is evaluated and the summary written (``tokens``: the group's,
        ``ntokens_seen`` of one rank times the data-parallel degree)."""
        super().train()
        assert self.engine is not None
        self.engine.close()
        eval_loss = self.evaluate()
        summary_of = getattr(self.averager, "summary", None)
        extra = {"eval_loss": eval_loss, "initial_eval_loss": self.initial_eval_loss, "steps": self.step,
                 "tokens": self.ntokens_seen * self.data_degree,
                 "data_samples": self.dataloader.state_dict()}
        self.summary = (summary_of(self.engine, **extra) if summary_of is not None else
                        {"outer_rounds": self.engine.round, "param_hash": self.engine.global_hash(),
                         "num_parameters": self.engine.numel, **extra})
        if self.config.diloco.summary_json and torch.distributed.get_rank() == 0:
            path = Path(self.config.diloco.summary_json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.summary, indent=1, default=str) + "\n")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-token loss (nats/token) of the model as it is on the held-out batches (every rank
        of the group runs the same batches: FSDP needs them all); NaN without held-out batches."""
        if not self.held_out:
            return float("nan")
        model = self.model_parts[0]
        model.eval()
        total = 0.0
        try:
            for input_dict, labels in self.held_out:
                inputs, labels = input_dict["input"].to(self.device), labels.to(self.device)
                pred = model(inputs)
                loss, _ = self.loss_fn(pred, labels, torch.tensor(labels.numel(), device=self.device))
                total += float(loss.item())
        finally:
            model.train()
        return total / len(self.held_out)

    def state_dict(self) -> dict[str, Any]:
        """torchtitan's train state (step, tokens seen) and the engine's as DCP entries
        (``diloco.engine.dcp_state``: DTensors laid out like the parameters) with their JSON metadata.

        Before the first exchange (a template DCP loads a checkpoint into) the entries include zeroed
        outer momentum buffers: every checkpoint is taken after at least one exchange (``check_config``),
        and DCP loads only the entries its template has."""
        state = dict(super().state_dict())
        if self.engine is not None:
            tensors, meta = to_dcp(self.engine)
            if self.engine.round == 0 and self.config.diloco.outer_momentum > 0:
                meta = _with_momentum(meta)
                tensors = template(self.engine, meta)
            state["diloco"], state["diloco_meta"] = tensors, json.dumps(meta)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore both (the engine loads the global parameters into the model)."""
        super().load_state_dict(state_dict)
        if self.engine is not None and "diloco" in state_dict:
            meta = json.loads(state_dict["diloco_meta"])
            self.engine.load_state_dict(from_dcp(self.engine, state_dict["diloco"], meta))

    def close(self) -> None:
        """The engine (abandoned if training did not finish), the averager, then torchtitan's own."""
        try:
            if self.engine is not None and not self.engine.finished:
                self.engine.abandon()
            close = getattr(self.averager, "close", None)
            if close is not None:
                close()
        finally:
            super().close()


def _with_momentum(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` of an engine before its first outer step, as it reads after one: every parameter with
    an outer Nesterov momentum buffer (the only outer state ``nesterov`` keeps)."""
    meta = json.loads(json.dumps(meta))
    for frag in meta["fragments"]:
        frag["outer_kinds"] = {str(i): {"momentum_buffer": "tensor"} for i in range(len(frag["names"]))}
    return meta


def check_config(config: Any, *, connected: bool) -> None:
    """TitanConfigError for a config DiLoCoTrainer cannot run, before any process group starts."""
    d = config.diloco
    if d.groups < 1 or not 0 <= d.group < d.groups:
        raise TitanConfigError(f"diloco.group={d.group} must be in 0..diloco.groups-1 (groups={d.groups})")
    if d.sync_every < 1:
        raise TitanConfigError(f"diloco.sync_every={d.sync_every}: the inner steps between syncs must be >= 1")
    if d.groups > 1 and not connected:
        raise TitanConfigError(f"diloco.groups={d.groups} needs an averager: build the trainer with "
                               "config.build(connect=lambda: diloco.connect(...)) (examples/titan_llama.py)")
    if d.eval_batches < 0:
        raise TitanConfigError(f"diloco.eval_batches={d.eval_batches} must be >= 0")
    if config.parallelism.pipeline_parallel_degree > 1:
        raise TitanConfigError("parallelism.pipeline_parallel_degree > 1: DiLoCoTrainer trains one model part")
    if config.checkpoint.enable:
        for name, value in (("checkpoint.interval", config.checkpoint.interval), ("training.steps", config.training.steps)):
            if value % d.sync_every:
                raise TitanConfigError(f"{name}={value} is not a multiple of diloco.sync_every={d.sync_every}: a "
                                       "checkpoint must fall where the model holds the global parameters")
    if d.summary_json and os.path.isdir(d.summary_json):
        raise TitanConfigError(f"diloco.summary_json={d.summary_json} is a directory, not a file path")
