"""The fault-tolerant averager: every exchange runs in a quorum, is voted on, and is retried.

For each exchange the engine starts, every rank of this group asks the coordinator for the
exchange's quorum (``diloco.coordinator.rounds``): the groups alive now, their weights and a ring.
The striped rings then run among those groups only; every rank votes whether its rings finished,
and the mean is handed to the engine only if every rank of every member did (the commit). If not,
nothing was applied anywhere — the engine applies a mean only when ``wait()`` returns it — and the
exchange is retried with the next quorum, which leaves out the groups that failed. So a lost group
costs the others one heartbeat timeout (the coordinator declares it failed; at once when it starts
again) plus one heartbeat of theirs (the coordinator then tells each rank running rings with it, and
the rank aborts them), never the job; the rings' own deadline is the bound when the coordinator
cannot be reached.

Healing: a group that joins while the job runs starts with ``attach() -> True``; the engine then
calls ``heal()``, which joins the next quorum as a member of weight 0 and votes on its rings
alone, while it fetches the state of the quorum's donor (the engine's ``state_dict()``, taken as
the donor launched the same exchange; ``diloco.exchange.healing`` moves and checks it): the
exchange commits without waiting for the transfer, which overlaps the others' next inner steps.
Once both are done the healer loads the state and applies the committed mean like everyone else;
a fetch that failed after the commit heals again in the next quorum. The inner optimizer starts fresh: its moments belong to the group's own past data, and a group that
was down for a while is better served by a few steps of warm-up than by stale moments.

Liveness: a background thread heartbeats the coordinator, and calls to it are retried, rejoined after
its restart, and turned into ``GroupEvicted`` when it says this group is out (``diloco.exchange.heartbeat``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from compress.finite import all_finite
from diloco.coordinator.messages import (
    CommitRequest,
    CommitResponse,
    QuorumRequest,
    QuorumResponse,
)
from diloco.coordinator.rounds import HEAL, weighted_scale
from diloco.engine.averaging import Done, writable
from diloco.exchange.data_positions import DataPositions
from diloco.exchange.fault_stats import FaultStats
from diloco.exchange.healing import StateTransfer
from diloco.exchange.heartbeat import CoordinatorRetry, GroupEvicted, Heartbeat, JobHalted
from diloco.exchange.network_plan import NetworkPlan, equal_plan, plan_from_table
from diloco.exchange.quorum_pending import QuorumPending, RolledBack
from diloco.exchange.shard_healing import (
    healing_layout,
    refuse_other_sizes,
    sharded_check,
)
from diloco.exchange.striped import StripedAverager
from transport import CollectiveAborted, TransportError
from transport.errors import auth_cause

log = logging.getLogger(__name__)


class ExchangeFailed(RuntimeError):
    """An exchange (or healing) rolled back ``max_attempts`` times in a row: a failure that
    repeats (a bug, a link that corrupts every frame, a stale build) rather than a group lost
    once. The rank stops with the last attempt's reason; its group is restarted and heals, as
    after any failure -- unless every attempt met a failed handshake (``auth_failure``: a wrong
    secret or certificate, exit code 2)."""

    auth_failure: BaseException | None = None


class JobFinished(RuntimeError):
    """This group joined too late: the job's groups have finished; there is nothing to heal into."""


class QuorumAverager(StripedAverager):
    """``StripedAverager`` whose every exchange runs in a quorum from the coordinator (see the
    module doc). ``tokens_per_step``: what one inner step of this group weighs (tokens; default
    its number of ranks), so groups of different sizes are averaged by tokens. ``heal``: this
    group joined a running job. ``heartbeat_interval_s``: seconds between heartbeats.
    ``round_timeout_s``: longest this rank keeps asking an unreachable coordinator.
    ``max_attempts``: attempts of one exchange, or of healing (each rolled back and retried in a
    new quorum), before this rank gives up with ExchangeFailed; a lost group costs one or two.

    To the engine, a ``StripedAverager`` that also weighs contributions, screens them and heals
    (``Weighted``, ``Screening``, ``Healing`` of ``diloco.engine.averaging``); its pending results
    say ``own_rejected``, ``own_share`` and ``sent`` (``Refusable``, ``Shared``, ``Gathered``)."""

    weighted = True  # the engine passes each contribution's weight (inner steps)
    screens_contributions = True  # NaN/Inf contributions go to the coordinator, which refuses them

    def __init__(self, transport, membership, client, *, group: int, rank: int, incarnation: str,
                 heal: bool = False, tokens_per_step: float | None = None, heartbeat_interval_s: float = 2.0,
                 round_timeout_s: float = 600.0, plan_every: int = 8, max_attempts: int = 20,
                 **kwargs: Any) -> None:
        super().__init__(transport, membership, group=group, rank=rank, **kwargs)
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        self.max_attempts = max_attempts
        self.auth_failures_in_a_row, self.last_auth_failure = 0, None  # run_rings' failed handshakes
        self.client = client
        self.plan_every = plan_every
        self._table: tuple[int, int, Any] | None = None  # (block, version, bandwidth table)
        self.incarnation = incarnation
        self.tokens_per_step = float(tokens_per_step if tokens_per_step is not None else self.group_size)
        self.stats = FaultStats()
        #: every group's committed data position, updated at each commit (diloco.exchange.data_positions)
        self.positions = DataPositions(group, self.tokens_per_step)
        self.stop_requested = False
        self.step = 0  # inner steps, for heartbeats
        self._needs_heal = heal
        self._engine = None
        #: --codec/--h auto: the setting whose codec this group's exchanges run, sent with each quorum
        #: request (""  without auto); ``on_setting(name)``: what a healer does when the exchange it
        #: joins runs another one (switch to its codec), before it takes part
        self.setting = ""
        self.on_setting: Callable[[str], None] | None = None
        self._evicted: str | None = None
        self._halted = False  # the coordinator halted the job (JobHalted), rather than evicted this group
        #: set once the coordinator told this group to leave (``evicted_reason`` says why): a wait that is
        #: not an exchange (the first bandwidth probe) gives up on it
        self.evicted = threading.Event()
        self.round_timeout_s = round_timeout_s
        self._retry = CoordinatorRetry(self, round_timeout_s)
        self._rejoin_lock = threading.Lock()
        self._transfer = StateTransfer(transport, client, self._retry, self.stats, group=group, rank=rank,
                                       group_size=self.group_size, timeout_s=self.timeout_s)
        #: heartbeats the coordinator and aborts this rank's rings of a quorum that can no longer commit
        self.heartbeat = Heartbeat(self, heartbeat_interval_s)

    # --- engine hooks -------------------------------------------------------------------------

    def attach(self, engine) -> bool:
        """Called by the engine as it is built; True: heal (``heal(engine)``) instead of the
        initial-parameter agreement."""
        self._engine = engine
        self.positions.fragments = len(getattr(engine, "fragments", ())) or 1
        return self._needs_heal

    def start(self, flat: torch.Tensor, *, tag: str, exact: bool = False, weight: float = 1.0,
              error_feedback: bool = False, shards=None, on_final=None, out=None) -> QuorumPending:
        """Ask for this exchange's quorum and launch it; the result is voted on and retried in the
        background. ``weight``: inner steps since this fragment's last exchange.
        ``error_feedback``, ``shards``, ``on_final``: see ``StripedAverager.start`` (the committed
        attempt's ``sent``; a sharded fragment: the quorum sees its whole size and its whole norm;
        final ranges are reported per attempt, and the pending result's ``final_attempt`` says
        which one committed); ``out``: where the first attempt writes the mean (``averaging.WritesInto``;
        a retry writes into a vector of its own: an abandoned attempt's threads may still write ``out``)."""
        if self._evicted is not None:
            raise self.departure()
        gather = self.gathers(exact, error_feedback)
        asked = time.perf_counter()
        exchange = self.exchanges
        self.exchanges += 1
        src = flat.detach().to(torch.float32).contiguous()
        lead = self.rank == 0 and not exact
        engine = self._engine
        norm = self.contribution_norm(src, shards) if lead or (shards is not None and not exact) else 0.0
        ask = QuorumRequest(
            self.group, self.rank, self.incarnation, exchange, tag=tag,
            numel=src.numel() if shards is None else shards.numel,
            weight=1.0 if exact else max(weight, 0.0) * self.tokens_per_step,  # control exchanges: a plain mean
            state_hash=engine.global_hash() if lead and engine is not None and engine.mode != "eager" else "",
            delta_norm=norm if lead else 0.0, retry=False, setting=self.setting,
            weight_cap=0.0 if exact else self.weight_cap())
        resp = self._ask(ask, healable=not exact)  # catch_up: left out of it by the grace window (QuorumPending)
        if resp.healers and resp.donor == self.group and engine is not None:
            self._transfer.serve(resp, {**engine.state_dict(), "data_positions": self.positions.state()})
        return QuorumPending(self, src, ask, resp, flat.device, exact=exact, asked=asked, gather=gather,
                              shards=shards, on_final=on_final, out=out)

    def weight_cap(self) -> float:
        """The most tokens one rank of this group can contribute to one exchange under the engine's
        schedule (its longest round in steps x this group's tokens per step per rank), which every
        member declares alike and the coordinator holds weights to; 0 when nothing bounds a round."""
        steps = getattr(self._engine, "max_round_steps", None)
        return float(steps) * self.tokens_per_step / self.group_size if steps else 0.0

    def heal(self, engine) -> None:
        """Join the job: fetch a live member's state in the next quorum and finish its exchange."""
        started = time.perf_counter()
        attempts = 0
        while True:
            resp = self._ask(QuorumRequest(self.group, self.rank, self.incarnation, HEAL), healable=True)
            if resp.finished:
                raise JobFinished(f"group {self.group}: the job's groups finished before this group could heal")
            refuse_other_sizes(engine, resp, self.group)
            self._take_setting(resp)
            shards = healing_layout(engine, resp.tag)  # None unless the model is sharded
            zeros = torch.zeros(resp.numel if shards is None else shards.local_numel(), dtype=torch.float32,
                                device=engine.fragments[0].global_params[0].device)
            # with an error-feedback codec the quorum gathers: this group takes part with zeros; its
            # vote is on its rings only: the exchange does not wait for the state transfer below
            pending = QuorumPending(self, zeros, None, resp, zeros.device, gather=self.error_feedback, shards=shards)
            fetched: list[str] = []
            state = self._transfer.fetch(resp, lambda ok, why, into=fetched: into.append(why),
                                         sharded=sharded_check(engine, resp))
            try:
                mean = pending.wait()
            except RolledBack as e:
                attempts += 1
                if attempts >= self.max_attempts:
                    raise self._gave_up("healing", attempts, str(e)) from None
                log.warning("group %d: healing in %s rolled back (%s); trying the next quorum", self.group, resp.id, e)
                continue
            if not self.every_rank_fetched(state is not None):  # committed, but without this group's state
                attempts += 1
                why = next((w for w in fetched if w), "another rank of this group failed its fetch")
                if attempts >= self.max_attempts:
                    raise self._gave_up("healing", attempts, why)
                log.warning("group %d: %s committed but the state transfer failed (%s); healing again in the "
                            "next quorum", self.group, resp.id, why)
                continue
            self.positions.load_state(state.pop("data_positions", None))  # the donor's, before this exchange
            self.positions.commit(resp.tag, resp.weights)
            engine.load_state_dict(state)
            self.exchanges = resp.exchange + 1
            # the exchange committed before the transfer ended: time rounds run from the commit
            committed_at = engine.clock() - (time.monotonic() - pending.committed_at)
            engine.adopt(resp.tag, Done(mean), committed_at=committed_at)
            self._needs_heal = False
            self.stats.healed = True
            self.stats.heal_seconds = time.perf_counter() - started
            log.info("group %d rank %d healed from group %d in %.2fs at %s", self.group, self.rank, resp.donor,
                     self.stats.heal_seconds, resp.tag)
            return

    def serve_left_out(self, resp: QuorumResponse, mean: torch.Tensor, sharded: bool) -> None:
        """As a rank of a member of a committed quorum that the grace window formed without some
        live groups: the donor's ranks serve each of their ranks the committed ``mean`` (in the
        background; a left-out group fetches it when it asks for this exchange, and catches up),
        and every other member's rank 0 vouches for its SHA-256, so that a donor's word alone
        plants no mean in a left-out group."""
        if not resp.left_out or self.group not in resp.members or self.group in resp.healers:
            return
        if sharded:  # each rank holds a shard of the mean: the left-out group heals instead
            log.warning("group %d rank %d: groups %s were left out of %s, and this sharded group cannot serve or "
                        "vouch for the whole mean: they heal", self.group, self.rank, sorted(resp.left_out), resp.id)
            return
        if resp.donor == self.group:
            self._transfer.serve_mean(resp, mean)
        elif self.rank == 0:
            self._transfer.vouch_mean(resp, mean)

    def fetch_committed_mean(self, resp: QuorumResponse, numel: int) -> torch.Tensor:
        """As a rank of a group the grace window left out of ``resp`` (``catch_up``): the mean
        that quorum committed, from the donor rank that serves this rank (``numel`` fp32 values)."""
        return self._transfer.fetch_mean(resp, numel)

    def _take_setting(self, resp: QuorumResponse) -> None:
        """A healer runs the codec of the exchange it joins: that of the members' auto setting."""
        if not resp.setting or resp.setting == self.setting:
            return
        if self.on_setting is None:
            raise ValueError(f"group {self.group}: the job runs the auto setting {resp.setting!r} (--codec/--h auto) "
                             "and this group was started with fixed flags: start it with the job's flags")
        self.on_setting(resp.setting)
        if self.setting != resp.setting:
            raise ValueError(f"group {self.group}: could not switch to the job's auto setting {resp.setting!r}")

    def every_rank_fetched(self, mine: bool) -> bool:
        """Whether every rank of this group got its state (a collective of the group's ranks,
        after the healing exchange's mean was shared), so that they heal again together."""
        if self.group_size == 1:
            return mine
        flag = torch.tensor([int(mine)], dtype=torch.int32, device=self.comm_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.process_group)
        return bool(flag.item())

    def _gave_up(self, what: str, attempts: int, reason: str) -> ExchangeFailed:
        failed = ExchangeFailed(f"group {self.group} rank {self.rank}: {what} rolled back {attempts} times in a row "
                                f"(the last: {reason}); a failure that repeats, not a lost group: stopping instead "
                                "of retrying it")
        if self.auth_failures_in_a_row >= attempts:  # every attempt met a wrong secret or certificate
            failed.auth_failure = self.last_auth_failure
        return failed

    # --- one exchange ---------------------------------------------------------------------------

    def _ask(self, req: QuorumRequest, *, healable: bool) -> QuorumResponse:
        req = dataclasses.replace(req, healable=healable)
        while True:
            resp = self._retry(f"quorum for exchange {req.exchange}", lambda: self.client.quorum(req))
            if not resp.disagreement:
                break
            log.warning("group %d rank %d: exchange %d did not form: %s; asking again", self.group, self.rank,
                        req.exchange, resp.disagreement)
            self.stats.disagreements += 1
            req = dataclasses.replace(req, retry=True)
        if resp.halted:
            self.leave(resp.halted, halted=True)
            raise self.departure()
        if resp.stop and not req.retry:  # a first attempt is asked at the same step on every group
            self.stop_requested = True
        if resp.evicted:
            self.leave(resp.evicted)
            raise GroupEvicted(f"group {self.group}: {resp.evicted}")
        if not resp.finished:
            self.num_groups = len(resp.members)
        return resp

    def _plan(self, resp: QuorumResponse) -> NetworkPlan:
        """The plan of this exchange among the quorum's groups: the coordinator's bandwidth table
        pinned for the exchange's block of ``plan_every``, restricted to the quorum (pure given
        both, so every member derives the same plan)."""
        sizes = {g: len(a) for g, a in resp.members.items()}
        block = resp.exchange - resp.exchange % self.plan_every
        if self._table is None or self._table[0] != block:
            version, table = self._retry("network plan", lambda: self.client.plan(block))
            self._table = (block, version, table)
        _, version, table = self._table
        mine = {g: {r: {h: x for h, x in rates.items() if h in sizes} for r, rates in table.get(g, {}).items()}
                for g in sizes}
        try:
            return plan_from_table(version, sizes, mine)
        except ValueError:  # a member measured nothing towards the quorum's others
            return equal_plan(sizes)

    def run_rings(self, src: torch.Tensor, resp: QuorumResponse, exact: bool, gather: bool = False, shards=None,
                  codec=None, on_final=None, out: torch.Tensor | None = None):
        """One attempt: this rank's stripes of the weighted contribution, among the quorum's groups.
        ``gather``: all-gathers of each group's own encoded contribution, weighted on arrival
        (error feedback: ``sent`` is then what the others decoded of ``src``, or of zeros when
        this group's weight is 0). ``codec``: the exchange's (default the averager's now).
        ``on_final(out, lo, hi)``: see ``StripedAverager.launch``. ``out``: where the mean goes (a
        vector of its own unless given).
        Returns (out, stripe plan, group index, ok, why, sent)."""
        scale = weighted_scale(resp.weights, self.group)
        sent = scales = None
        if gather:
            x = torch.zeros_like(src) if scale == 0.0 else src  # a refused contribution may hold NaN
            sent = torch.empty_like(src)
            scales = {g: weighted_scale(resp.weights, g) for g in resp.members}
        else:
            x = src if scale == 1.0 else (torch.zeros_like(src) if scale == 0.0 else src * scale)
        out = writable(out, src)
        plan = self._plan(resp)
        sp, me, handles = self.launch(x, out, plan, {g: list(a) for g, a in resp.members.items()},
                                      tag=f"{resp.tag}/{resp.id}", exact=exact, sent=sent, scales=scales,
                                      shards=shards, codec=codec, on_final=on_final)
        why, auth = "", None
        self.heartbeat.track(resp.id, [h for _, h in handles])
        try:
            for s, h in handles:
                try:
                    h.wait(self.timeout_s)
                    if not all_finite(out[s.start:s.stop]):
                        why = why or f"the mean of stripe {s.index} holds NaN/Inf"
                except (CollectiveAborted, TransportError) as e:
                    auth = auth or auth_cause(e)
                    why = why or str(e)[:400]
        finally:
            self.heartbeat.done(resp.id)
        # attempts in a row that a failed handshake (a wrong secret or certificate) aborted here: when
        # every attempt was one, giving up says so (exit 2: no restart mends it; a corrupting link fails
        # some handshakes too, never every attempt's)
        self.auth_failures_in_a_row = self.auth_failures_in_a_row + 1 if auth is not None else 0
        self.last_auth_failure = auth
        return out, sp, me, not why, why, sent

    def vote(self, resp: QuorumResponse, ok: bool, why: str) -> CommitResponse:
        """This rank's vote; returns the quorum's decision."""
        req = CommitRequest(self.group, self.rank, self.incarnation, resp.id, resp.exchange,
                            tuple(sorted(resp.members)), ok, why[:500])
        return self._retry(f"vote on {resp.id}", lambda: self.client.commit(req),
                           on_not_found=lambda e: CommitResponse(False, f"the coordinator lost quorum {resp.id}: {e}"))

    def call_coordinator(self, what: str, call):
        """``call()`` with this averager's patience: retried while the coordinator is unreachable,
        after a rejoin if it restarted."""
        return self._retry(what, call)

    def retry_quorum(self, ask: QuorumRequest) -> QuorumResponse:
        return self._ask(dataclasses.replace(ask, retry=True), healable=False)

    # --- liveness -------------------------------------------------------------------------------

    def rejoin(self) -> None:
        """Join the coordinator again (it restarted) as a member at the next exchange. A group
        still healing holds none of the job's state, so it does not rejoin as a member (a new
        coordinator would take the job for running on its word, and make the next group to come
        wait to heal from it): GroupEvicted tells it to restart, and its next start joins the new
        coordinator as any group does (it heals from a live group, or, when the job was lost,
        resumes from its checkpoint)."""
        if self._needs_heal:
            self.leave(f"group {self.group}: the coordinator restarted while this group was healing (it holds "
                        "none of the job's state yet): restart it to join the job anew")
            raise GroupEvicted(self._evicted)
        with self._rejoin_lock:
            self.client.join(self.group, self.rank, self.group_size, self.transport.address,
                             incarnation=self.incarnation, exchange=self.exchanges)
            self.stats.rejoins += 1
        log.warning("group %d rank %d: rejoined the coordinator, which no longer knew this rank (restarted?)",
                    self.group, self.rank)

    @property
    def evicted_reason(self) -> str | None:
        """Why the coordinator told this group to leave; None while it has not."""
        return self._evicted

    def leave(self, why: str, *, halted: bool = False) -> None:
        """The coordinator told this group to leave (``halted``: halted the job): its next call
        raises ``departure()``."""
        self._evicted = why
        self._halted = self._halted or halted
        self.evicted.set()

    def departure(self) -> Exception:
        """What this rank raises once the coordinator told its group to leave: JobHalted when the
        job halted (exit 2), else GroupEvicted (exit 75: restart and heal)."""
        why = self._evicted or "the coordinator told this group to leave"
        return JobHalted(f"group {self.group}: {why}") if self._halted else GroupEvicted(why)

    def close(self) -> None:
        """Stop heartbeating; wait briefly for state transfers this rank serves."""
        self.heartbeat.close()
        self._transfer.join(self.timeout_s)
