"""The public way in: ``diloco.connect(...)`` puts this rank of this group into the job.

It does for any training loop what ``diloco worker`` does for the demo: opens this rank's
data-plane endpoint, joins the coordinator, probes the other groups' bandwidth and reports it,
builds the striped averager whose ring order and stripe shares follow the coordinator's plans,
serves Prometheus metrics, and reports round hashes, progress and the summary::

    import diloco
    link = diloco.connect("coord.example:29400", group=0, secret=os.environ["DILOCO_SECRET"],
                          codec="int8")                  # under torchrun: every rank calls it
    with link, diloco.DiLoCo(model, opt, averager=link, sync_every=100, hook_optimizer=True) as engine:
        for x, y in loader:                              # the user's own loop, unchanged
            loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
            link.report_progress(loss=loss.item())       # optional: live progress + loss metric
    print(link.summary(engine))                          # also reported to the coordinator

The connection is the engine's averager: every ``DiLoCo`` call that averages goes through it,
and after every inner step the engine tells it what happened (``observe``), which is when it
counts metrics, re-probes bandwidth in the background and reports round hashes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from diloco.coordinator import CoordinatorClient, CoordinatorError
from diloco.coordinator.credentials import for_group
from diloco.coordinator.waiting import waiting
from diloco.exchange.quorum_averager import QuorumAverager
from diloco.job.config import ConfigError, TransportConfig
from diloco.runtime.rank.averager_setup import Reprobe, make_averager
from diloco.runtime.rank.endpoint import (
    TOKEN_ENV,
    ConnectError,
    coordinator_tls,
    group_keys,
    make_transport,
    read_secret,
)
from diloco.runtime.ops.metrics import WIRE_COUNTERS, WorkerMetrics, read_counters
from transport.identity import GroupKeys

log = logging.getLogger(__name__)

#: seconds close() gives a background re-probe to end once the links are closed
REPROBE_CLOSE_S = 1.0


def _group_rank(process_group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise ConnectError("process_group given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _comm_device(process_group) -> torch.device:
    if dist.is_available() and dist.is_initialized() and dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GroupConnection:
    """This rank's membership in the job and its averager (pass it as ``DiLoCo(averager=...)``).

    ``round_hashes``: the global-parameter hash after each step that committed a sync (rank 0
    reports each to the coordinator, which compares groups). ``metrics``: the Prometheus series.
    """

    def __init__(self, *, transport, client: CoordinatorClient, membership, averager: QuorumAverager,
                 reprobe: Reprobe | None, metrics: WorkerMetrics, group: int, rank: int,
                 group_size: int, process_group=None) -> None:
        self.transport, self.client, self.membership = transport, client, membership
        self.averager, self.reprobe, self.metrics = averager, reprobe, metrics
        self.auto: dict[str, Any] | None = None  # what --codec/--h auto chose (diloco.runtime.rank.auto_setting)
        self.group, self.rank, self.group_size, self.process_group = group, rank, group_size, process_group
        self.round_hashes: list[str] = []
        self.round_keys: list[int] = []  # engine.round at each of round_hashes
        self._faults_counted: dict[str, float] = {}
        self.bytes_sent = self.bytes_received = 0  # the whole group's, as of the last commit
        self.inner_steps = 0
        self.periods: list[int] = []  # H of each round of fragment 0, as the engine set them
        self._rounds_counted = 0
        self._sync_seconds_seen = 0.0
        self._final_codec_logged = False
        self._last_observe = self._start = time.perf_counter()
        self._last_progress = (0, self._start)
        #: rank 0 logs a progress line at a report at most every this many seconds (0 = never)
        self.progress_every_s = 0.0
        self._last_line: float | None = None
        self.compute_seconds = 0.0
        self.loss: float | None = None
        self._finished_engine = None  # the engine whose close() this connection observed
        self._summary_reported = False

    # --- the averager protocol (the engine calls these) -------------------------------------
    # ``diloco.engine.averaging.Averager`` and the capabilities of its QuorumAverager (Weighted,
    # Screening, ShardExchanging, ErrorFed, CodecSwitching, Healing), forwarded; and Observing.

    @property
    def num_groups(self) -> int:
        return self.averager.num_groups

    @property
    def group_index(self) -> int:
        return self.averager.group_index

    weighted = True
    screens_contributions = True
    exchanges_shards = True  # a sharded (FSDP2) group: each rank exchanges its shard (``shards=``)

    def attach(self, engine) -> bool:
        return self.averager.attach(engine)

    def heal(self, engine) -> None:
        self.averager.heal(engine)

    def start(self, flat: torch.Tensor, *, tag: str, exact: bool = False, weight: float = 1.0,
              error_feedback: bool = False, shards=None, on_final=None, out=None):
        return self.averager.start(flat, tag=tag, exact=exact, weight=weight, error_feedback=error_feedback,
                                   shards=shards, on_final=on_final, out=out)

    @property
    def writes_into(self) -> bool:
        """``start`` takes ``out`` (``diloco.engine.averaging.WritesInto``)."""
        return self.averager.writes_into

    @property
    def streams_final(self) -> bool:
        """``start`` takes ``on_final`` (``diloco.engine.averaging.StreamsFinal``)."""
        return self.averager.streams_final

    @property
    def error_feedback(self) -> bool:
        """The codec needs error feedback (int2, sign1, topk): the engine keeps a residual per fragment."""
        return self.averager.error_feedback

    @property
    def codec(self):
        """The codec of this group's next exchange."""
        return self.averager.codec

    def set_codec(self, codec) -> None:
        """Run ``codec`` from the next exchange on (``--final-codec``: every group at the same launch)."""
        self.averager.set_codec(codec)

    @property
    def stop_requested(self) -> bool:
        """The job asked every group to checkpoint and stop: True from the step whose exchange said so."""
        return self.averager.stop_requested

    @property
    def fault_stats(self):
        """What fault tolerance did on this rank (``diloco.exchange.quorum_averager.FaultStats``)."""
        return self.averager.stats

    def all_reduce_mean(self, flat: torch.Tensor, *, round: int) -> torch.Tensor:
        return self.averager.all_reduce_mean(flat, round=round)

    def observe(self, engine, events: list) -> None:
        """After every engine step (and ``close()``): metrics, background re-probes, round hashes."""
        now = time.perf_counter()
        self.averager.step = engine.inner_step
        sync_s = engine.sync_seconds - self._sync_seconds_seen
        self._sync_seconds_seen = engine.sync_seconds
        self.metrics.sync_seconds.inc(sync_s)
        if not engine.finished:  # one inner step: the time since the last one, less the syncs
            compute = max(now - self._last_observe - sync_s, 0.0)
            self.inner_steps += 1
            self.compute_seconds += compute
            self.metrics.inner_steps.inc()
            self.metrics.compute_seconds.inc(compute)
            if self.reprobe is not None:
                self.reprobe.after_step()
        if getattr(engine, "time_rounds", None) is not None:  # rounds by time: this group's steps in each
            self.periods = list(engine.round_steps)
        else:
            if not self.periods:
                self.periods.append(engine.next_sync[0])
            self.periods.extend(e.next_period for e in events if e.kind == "launch" and e.fragment == 0 and e.next_period)
        self._log_final_codec(engine, events)
        committed = any(e.kind == "commit" for e in events)
        if engine.finished:
            self._finished_engine = engine
        if committed or engine.finished:
            self.bytes_sent, self.bytes_received = self._group_bytes()
        # eager groups' global copies differ until close() reconciles them: only the final hash counts
        report = engine.finished if engine.mode == "eager" else committed
        if report and self.rank == 0:  # keyed by the syncs launched so far: the same point on every group
            self.round_hashes.append(engine.global_hash())
            self.round_keys.append(engine.round)
            self._report("round hash", lambda: self.client.report_round(self.group, engine.round, self.round_hashes[-1]))
        self.metrics.outer_rounds.inc(engine.round - self._rounds_counted)
        self._rounds_counted = engine.round
        self.metrics.transport_totals(self.transport)
        self._count_faults()
        if self.periods:
            self.metrics.sync_period.set(self.periods[-1])
        self._last_observe = time.perf_counter()

    def _log_final_codec(self, engine, events: list) -> None:
        """Once, when the last exchange launches with ``--final-codec``: which codec and round."""
        final = getattr(engine, "final_codec", None)
        if final is None or self._final_codec_logged or self.rank != 0 or self.averager.codec is not final:
            return
        launch = next((e for e in events if e.kind == "launch"), None)
        if launch is not None:
            self._final_codec_logged = True
            decay = getattr(engine, "residual_decay", 1.0)
            carries = ("with the residual" if decay == 1.0 else "without a residual (--residual-decay 0)" if decay == 0
                       else f"with {decay:g} x the residual (--residual-decay)")
            log.info("group %d: the last exchange (fragment %d, round %d, step %d) runs %s %s (--final-codec)",
                     self.group, launch.fragment, launch.round, launch.inner_step, final.name, carries)

    def _count_faults(self) -> None:
        """Bring the fault-tolerance series up to this rank's FaultStats."""
        st = self.averager.stats
        now = {"rounds_committed": st.committed, "rounds_rolled_back": st.rollbacks, "heals": int(st.healed),
               "group_failures": st.failures_seen, "rejected_contributions": len(st.rejected),
               "stall_seconds": sum(st.stall_seconds)}
        for name, value in now.items():
            delta = value - self._faults_counted.get(name, 0)
            if delta > 0:
                getattr(self.metrics, name).inc(delta)
                self._faults_counted[name] = value
        if st.quorum_sizes:
            self.metrics.quorum_groups.set(st.quorum_sizes[-1])

    def _report(self, what: str, call) -> None:
        """A best-effort report: a coordinator that is away (or restarted and does not know us yet)
        costs a warning, never the training step."""
        try:
            call()
        except CoordinatorError as e:
            log.warning("%s report skipped: %s", what, e)

    def _group_bytes(self) -> tuple[int, int]:
        """Bytes this group's ranks sent and received between groups (a collective in the group)."""
        counts = read_counters(self.transport, WIRE_COUNTERS)
        sent, received = counts["bytes_sent"], counts["bytes_received"]
        if self.group_size == 1:
            return sent, received
        device = self.averager.comm_device
        t = torch.tensor([sent, received], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=self.process_group)
        return int(t[0]), int(t[1])

    def rank0_text(self, text: str) -> str:
        """Rank 0's ``text`` on every rank of the group (two broadcasts in the group; ``text``
        itself for a group of one): what each rank read from the coordinator on its own, made
        one value, e.g. the setting a healer builds its engine with."""
        if self.group_size == 1:
            return text
        device = self.averager.comm_device
        src = dist.get_process_group_ranks(self.process_group)[0] if self.process_group is not None else 0
        data = text.encode()
        length = torch.tensor([len(data)], dtype=torch.int64, device=device)
        dist.broadcast(length, src=src, group=self.process_group)
        if int(length.item()) == 0:
            return ""
        buf = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buf, src=src, group=self.process_group)
        return bytes(buf.cpu().tolist()).decode()

    # --- what the job sees ----------------------------------------------------------------------

    def report_progress(self, *, loss: float | None = None, step: int | None = None, steps: int = 0,
                        tokens_per_step: int = 0, lr: float | None = None) -> None:
        """Rank 0: send a progress snapshot to the coordinator (what ``diloco run`` shows live);
        every rank: update the loss and lr gauges. ``loss`` in nats/token (or the user's unit)."""
        if loss is not None:
            self.loss = float(loss)
            self.metrics.loss.set(self.loss)
        if lr is not None:
            self.metrics.inner_lr.set(lr)
        if self.rank != 0:
            return
        now = time.perf_counter()
        step = self.inner_steps if step is None else step
        last_step, last_t = self._last_progress
        self._last_progress = (step, now)
        snapshot: dict[str, Any] = {
            "step": step, "steps": steps,
            "tokens_per_s": round((step - last_step) * tokens_per_step / max(now - last_t, 1e-9), 1),
            "bytes_sent": self.bytes_sent, "round": self._rounds_counted,
            "h": self.periods[-1] if self.periods else 0,
            "utilization": round(self.compute_seconds / max(now - self._start, 1e-9), 4),
        }
        if self.loss is not None:
            snapshot["loss"] = round(self.loss, 4)
        if lr is not None:
            snapshot["lr"] = lr
        if self.auto is not None:
            snapshot["auto"] = self.auto["short"]
        self._report("progress", lambda: self.client.report_progress(self.group, self.rank, snapshot))
        if self.progress_every_s and (self._last_line is None or now - self._last_line >= self.progress_every_s
                                      or step == steps):
            self._last_line = now
            shown = f"{step}/{steps} ({100 * step / steps:.0f}%)" if steps else str(step)
            loss_text = f", loss {self.loss:.4f}" if self.loss is not None else ""
            lr_text = f", lr {lr:.3g}" if lr is not None else ""
            log.info("group %d: step %s%s%s, %s tokens/s, round %d, H %d, %.1f MB sent, utilization %.0f%%",
                     self.group, shown, loss_text, lr_text, f"{snapshot['tokens_per_s']:,.0f}", snapshot["round"],
                     snapshot["h"], snapshot["bytes_sent"] / 1e6, 100 * snapshot["utilization"],
                     extra={"progress": snapshot})

    def summary(self, engine, **extra: Any) -> dict[str, Any]:
        """This group's summary (rank 0 reports it to the coordinator; other ranks get their own
        counters only). ``extra``: fields to add, e.g. ``eval_loss``."""
        wall = time.perf_counter() - self._start
        launched = getattr(engine, "rounds", [engine.round])[0]  # fragment 0's rounds, which periods lists
        out: dict[str, Any] = {
            "group": self.group, "rank": self.rank, "round_hashes": list(self.round_hashes),
            "outer_rounds": engine.round, "inner_steps": engine.inner_step, "periods": self.periods[:launched],
            "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
            "param_hash": engine.global_hash(), "num_parameters": engine.numel,
            "seconds": wall, "compute_seconds": self.compute_seconds, "sync_seconds": engine.sync_seconds,
            "utilization": self.compute_seconds / max(wall, 1e-9), "mode": engine.mode,
            "fragments": len(engine.fragments), "fault": self.averager.stats.to_dict(),
            "incarnation": self.averager.incarnation, **({"auto": self.auto} if self.auto else {}), **extra,
        }
        if self.rank == 0:  # the job's summary needs it: retried while the coordinator is away
            self.averager.call_coordinator("summary", lambda: self.client.report_summary(self.group, out))
            self._summary_reported = True
        return out

    def close(self, *, failed: bool | None = None) -> None:
        """Stop the metrics endpoint, the data plane and the coordinator channel. Idempotent.

        A group whose engine closed normally has finished its part of the job: when rank 0 has not
        reported a summary (``summary()``), close reports one, so the coordinator counts the group
        finished instead of failing it for going quiet (and calling the job lost when it was the
        last). ``failed=True`` reports nothing: the group then goes quiet, the coordinator declares
        it failed, and the others go on without it. The default, None, means failed when an
        exception is propagating (close in a ``finally``, or the ``with`` block left on an error).

        A re-probe still in flight is not waited for: its peer may have finished and will never
        answer (a finished job then sat out --timeout here). Its thread is a daemon; closing the
        links ends its probe, and it is given REPROBE_CLOSE_S to notice."""
        if failed is None:
            failed = sys.exc_info()[0] is not None
        engine, self._finished_engine = self._finished_engine, None
        if engine is not None and not failed and self.rank == 0 and not self._summary_reported:
            try:
                self.summary(engine)
            except Exception as e:  # closing must still release the links and the channel
                log.warning("group %d: could not report the summary at close: %s", self.group, e)
        self.averager.close()
        self.metrics.close()
        self.transport.close()
        if self.reprobe is not None:
            self.reprobe.monitor.join(REPROBE_CLOSE_S)
        self.client.close()

    def __enter__(self) -> "GroupConnection":
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self.close(failed=exc_type is not None)


def _incarnation(process_group, size: int, device: torch.device) -> str:
    """A random id of this start of the group, the same on all its ranks (rank 0's)."""
    value = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=device)
    if size > 1:
        group_ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        dist.broadcast(value, src=group_ranks[0] if group_ranks else 0, group=process_group)
    return f"{int(value.item()):016x}"


def connect(coordinator: str, group: int, *, secret: bytes | str | GroupKeys | None = None, codec: str | None = None,
            process_group: "dist.ProcessGroup | None" = None, token: str | None = None,
            settings: TransportConfig | None = None, metrics_port: int = 0, heartbeat_timeout: float = 15.0,
            tokens_per_step: float | None = None, resume_step: int = -1,
            resume_exact: bool = False) -> GroupConnection:
    """Join the job as this rank of ``group``; returns the connection (the engine's averager).

    ``coordinator``: ``host:port``. ``secret``: the data plane's job secret (bytes or hex;
    default ``$DILOCO_SECRET``), from which this rank derives its group's keys; or the group's own
    keyring (``transport.identity.GroupKeys``). ``codec``: wire codec name (``fp32``, ``bf16``, ``int8``,
    ``int4``, ``fp4-e2m1``, ``fp4-e3m0``, or ``sign1`` / ``topk``, which need error feedback: their
    exchanges gather every group's own encoded Δ and ``DiLoCo`` keeps the residual; default
    ``settings.codec``). ``process_group``: this
    group's ranks (default: the whole torch.distributed world, or none when it is not
    initialized: a one-rank group). ``token``: the coordinator's job token or this group's
    credential (default ``$DILOCO_TOKEN``); the rank shows the coordinator only its group's.
    ``settings``: links, TLS, connections, probes, timeouts (``diloco.job.config.TransportConfig``,
    the same fields as the ``--host``, ``--link``, ``--tls-*`` ... flags); its TLS files also
    secure the coordinator calls when the coordinator is not on loopback (``coordinator_tls``). ``metrics_port``:
    serve Prometheus metrics on this port + the local rank, on ``settings.host`` (0 = off). ``heartbeat_timeout``: the
    coordinator's (seconds; this rank heartbeats every fifteenth of it). ``tokens_per_step``: what one
    inner step of this group weighs in the mean (default: its number of ranks). ``resume_step``:
    the newest job checkpoint step this group may resume from if the job starts now (-1: none; a
    group behind the job's newest is told to heal: ``membership.heal``); ``resume_exact``: that
    step was named, and every group must name it. Every rank of every
    group calls it; it returns once every expected group has joined (or, when the job already runs,
    once this group's ranks have: the engine then heals the group into the job).
    """
    t = settings if settings is not None else TransportConfig()
    if codec is not None:
        t = dataclasses.replace(t, codec=codec)
    try:
        t.codec_spec().build()
    except ValueError as e:
        raise ConfigError(f"codec {t.codec!r}: {e}") from None
    rank, size = _group_rank(process_group)
    key = group_keys(read_secret(secret), group)  # identity: this group's keys and coordinator credential only
    try:
        credential = for_group(token or os.environ.get(TOKEN_ENV) or None, group)
    except ValueError as e:
        raise ConnectError(str(e)) from None
    opened: list[Any] = []
    try:
        transport = make_transport(t, key, int(os.environ.get("LOCAL_RANK", rank)))
        opened.append(transport)
        tls = coordinator_tls(t, coordinator)
        if tls is not None:  # a certificate either side refuses is named at once, not after the client's deadline
            from diloco.runtime.rank.tls_check import check_coordinator

            with waiting(log, f"the coordinator at {coordinator} to accept connections (TLS)"):
                check_coordinator(coordinator, cert=tls.cert_file, key=tls.key_file, ca=tls.ca_file,
                                  timeout_s=t.timeout_s)
        client = CoordinatorClient(coordinator, token=credential, tls=tls, timeout_s=t.timeout_s)
        opened.append(client)
        device = _comm_device(process_group)
        incarnation = _incarnation(process_group, size, device)
        membership = client.join(group, rank, size, transport.address, incarnation=incarnation,
                                 resume_step=resume_step, resume_exact=resume_exact)
        averager, reprobe = make_averager(t, transport, membership, client, group, rank, device, process_group,
                                          incarnation=incarnation, heartbeat_timeout=heartbeat_timeout,
                                          tokens_per_step=tokens_per_step)
        opened.append(averager)
        metrics = WorkerMetrics(group, rank)
        opened.append(metrics)
        if metrics_port:
            metrics.serve(metrics_port + int(os.environ.get("LOCAL_RANK", rank)), host=t.host)
    except BaseException:
        for thing in reversed(opened):
            thing.close()
        raise
    return GroupConnection(transport=transport, client=client, membership=membership, averager=averager,
                           reprobe=reprobe, metrics=metrics, group=group, rank=rank, group_size=size,
                           process_group=process_group)
