"""One exchange of the fault-tolerant averager (``diloco.exchange.quorum_averager``): its attempts
run in a background thread (this rank's rings among the quorum's groups, its vote, and on a roll
back the same contribution again in the next quorum) until one commits; ``wait`` then shares the
stripes inside the group and returns the mean. ``avg`` is the ``QuorumAverager`` that started it:
its rings, votes, retries, data positions and fault counters. An exchange the grace window left
this group out of, which committed without it, is taken as its committed mean from the quorum's
donor instead (the group *catches up*)."""

from __future__ import annotations

import logging
import threading
import time

import torch

from diloco.coordinator.messages import QuorumRequest, QuorumResponse
from diloco.coordinator.rounds import own_share
from diloco.coordinator.waiting import waiting
from transport.streams import side_stream_for

log = logging.getLogger("diloco.exchange.quorum_averager")  # one logger for the averager's messages, as before the split


class RolledBack(RuntimeError):
    """The healer's quorum was rolled back: heal again with the next one."""


class QuorumPending:
    """One exchange: attempts (rings, vote) run in a background thread until one commits;
    ``wait`` then shares the stripes inside the group and returns the mean."""

    def __init__(self, avg, src: torch.Tensor, ask: QuorumRequest | None, resp: QuorumResponse,
                 device, *, exact: bool = False, asked: float | None = None, gather: bool = False,
                 shards=None, on_final=None, out: torch.Tensor | None = None) -> None:
        self._avg, self._src, self._ask, self._resp, self._device = avg, src, ask, resp, device
        self._out = out  # the caller's vector for the first attempt's mean (averaging.WritesInto)
        self._exact = exact
        self._shards = shards
        self._gather = gather
        self._on_final = on_final  # FinalRanges: told each attempt's final ranges (StripedAverager.start)
        #: after ``wait``: the attempt that committed, whose final ranges ``on_final`` was told
        self.final_attempt: int | None = None
        self._codec = avg.codec  # every attempt of this exchange uses the codec it started with
        #: error feedback: after ``wait``, what the other groups decoded of this group's contribution
        #: in the attempt that committed (each rank's stripes, shared in the group)
        self.sent: torch.Tensor | None = None
        self.own_rejected = avg.group in resp.rejected
        #: after ``wait``: this group's share of the committed weighted mean (eager's correction)
        self.own_share: float | None = None
        #: after ``wait``: when the attempt that committed was decided (``time.monotonic``)
        self.committed_at: float | None = None
        self._value: torch.Tensor | None = None
        self._committed: QuorumResponse | None = None  # the attempt that committed
        self._caught_up: QuorumResponse | None = None  # the quorum that committed without this group
        self._fetch_error = ""
        self._result = None
        self._error: BaseException | None = None
        self._started = time.perf_counter() if asked is None else asked
        # CUDA: the attempts' kernels (scaling, the rings' sums) go on a stream of their own that
        # waits for src as the caller's stream holds it now -- not on the thread's default stream,
        # which would wait for the training kernels queued meanwhile, or not wait for src at all
        # when the caller computes on a stream of its own
        self._order = side_stream_for(src)
        self._thread = threading.Thread(target=self._run, name=f"exchange[{resp.tag}]", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._order is None:
                self._result = self._attempts()
            else:
                with self._order.running():
                    self._result = self._attempts()
        except BaseException as e:  # noqa: BLE001 - re-raised in wait()
            self._error = e

    def _attempts(self):
        avg, resp = self._avg, self._resp
        attempts = 0
        while True:
            if resp.catch_up:
                return self._catch_up(resp)
            attempts += 1
            self.own_rejected = avg.group in resp.rejected
            if self.own_rejected:
                avg.stats.rejected.append(resp.rejected[avg.group])
                log.warning("group %d: the quorum refused this group's contribution to %s: %s", avg.group,
                            resp.tag, resp.rejected[avg.group])
            out, sp, me, ok, why, sent = avg.run_rings(self._src, resp, self._exact, self._gather, self._shards,
                                                       self._codec, self._reporter(attempts),
                                                       out=self._out if attempts == 1 else None)
            decision = avg.vote(resp, ok, why)
            if decision.committed:
                self._committed = resp
                self.final_attempt = attempts
                self.committed_at = time.monotonic()
                avg.stats.record(resp.exchange, time.perf_counter() - self._started, attempts, len(resp.members))
                self.own_share = own_share(resp.weights, avg.group)
                if self._ask is not None and not self._exact:  # a healer takes the donor's table (heal)
                    avg.positions.commit(resp.tag, resp.weights, refused=self.own_rejected)
                return out, sp, me, sent
            avg.stats.rollbacks += 1
            log.warning("group %d rank %d: %s rolled back (%s)", avg.group, avg.rank, resp.id, decision.reason)
            if self._ask is None:
                raise RolledBack(decision.reason)
            if attempts >= avg.max_attempts:
                raise avg._gave_up(f"exchange {resp.tag}", attempts, decision.reason)
            resp = avg.retry_quorum(self._ask)

    def _reporter(self, attempt: int):
        """``run_rings``' ``on_final`` for ``attempt``: the caller's, told which attempt it is."""
        on_final = self._on_final
        return None if on_final is None else (lambda out, lo, hi: on_final(attempt, out, lo, hi))

    def _catch_up(self, resp: QuorumResponse) -> torch.Tensor | None:
        """The grace window left this group out of this exchange, which committed without it:
        fetch the committed mean from the quorum's donor (None if that failed; ``wait`` decides
        with the group's other ranks). This group weighs 0 in it (``own_share``), its contribution
        is dropped as a refused one is (``own_rejected``: the engine restarts the fragment from the
        new global parameters, the data feed draws the round's samples again), and with error
        feedback the others decoded nothing of it (``sent`` is zeros)."""
        avg = self._avg
        if self._shards is not None:
            avg.leave(f"group {avg.group}: the grace window left it out of {resp.tag}, and a sharded group takes the "
                      "committed mean by healing: it restarts")
            raise avg.departure()
        log.warning("group %d rank %d: the grace window left this group out of %s (%s), which committed without it; "
                    "taking its mean from group %d at weight 0", avg.group, avg.rank, resp.tag, resp.id, resp.donor)
        self._caught_up, self.own_rejected, self.own_share = resp, True, 0.0
        self.committed_at = time.monotonic()
        try:
            return avg.fetch_committed_mean(resp, self._src.numel())
        except Exception as e:  # noqa: BLE001 - every rank learns in wait() whether all of them fetched
            self._fetch_error = f"{type(e).__name__}: {e}"[:400]
            return None

    def _land_caught_up(self, mean: torch.Tensor | None) -> torch.Tensor:
        """The committed mean this group took (every rank of it, or none: it then heals)."""
        avg, resp = self._avg, self._caught_up
        assert resp is not None
        if not avg.every_rank_fetched(mean is not None):
            why = self._fetch_error or "another rank of this group could not fetch it"
            avg.leave(f"group {avg.group}: could not take the committed mean of {resp.tag} ({resp.id}) from group "
                      f"{resp.donor} ({why}): it restarts and heals")
            raise avg.departure()
        assert mean is not None
        avg.positions.commit(resp.tag, resp.weights, refused=True)
        avg.stats.caught_up += 1
        if self._gather:
            self.sent = torch.zeros_like(self._src).to(self._device)
        return mean.to(self._device)

    def wait(self) -> torch.Tensor:
        if self._value is None:
            # every step of an attempt has its own deadline; this bounds a pathological chain of them
            with waiting(log, lambda: f"exchange {self._resp.tag} among groups {sorted(self._resp.members)} "
                                      "to finish (the rings' data and every member's vote)"):
                self._thread.join(4 * self._avg.round_timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"exchange {self._resp.tag} did not commit within {4 * self._avg.round_timeout_s:g}s")
            if self._error is not None:
                raise self._error
            if self._caught_up is not None:
                self._value = self._land_caught_up(self._result)
                return self._value
            out, sp, me, sent = self._result
            if self._order is not None:  # made on the attempts' stream, used on the caller's from here
                self._order.hand_over(out, sent)
            out, sent = self._avg.land(out, sent, sp, me)  # shared in the group, or a shard put back in order
            if sent is not None:
                self.sent = sent.to(self._device)
            self._value = out.to(self._device)
            if self._committed is not None and self._committed.left_out:
                self._avg.serve_left_out(self._committed, self._value, sharded=self._shards is not None)
        return self._value

