"""Healing's state transfer: a donor group's engine state, sent to a recovering group's ranks; and
a committed mean, sent to a live group the grace window left out of its exchange (it catches up).

When a quorum holds healers (groups joining a running job), its donor group's ranks each send
their engine's ``state_dict()`` to the healer ranks mapped to them (healer rank h is served by
donor rank h mod donor size) over the data plane: a two-member ring on the same authenticated
links, the state packed by ``diloco.exchange.state_blob`` (no pickle). The donor announces the blob's
size and SHA-256 through the coordinator; the healer checks both, then checks the state's
global-parameter hash against the quorum's agreed one (a sharded group: every rank fetches its
own shard from the donor rank that holds it, and the ranks check the hash of the shards together,
``diloco.exchange.shard_healing``). The exchange around it (joining the
quorum at weight 0, voting, loading, rolling back) is ``diloco.exchange.quorum_averager``'s.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

import torch

from diloco.coordinator import CoordinatorError
from diloco.coordinator.messages import OfferQuery, QuorumResponse, StateOffer
from diloco.engine.outer_state import params_hash
from diloco.exchange import state_blob
from transport import CollectiveAborted, TransportError

if TYPE_CHECKING:
    from diloco.exchange.fault_stats import FaultStats

log = logging.getLogger(__name__)

#: calls the coordinator with the averager's patience: ``retry(what, call)`` returns ``call()``
Retry = Callable[[str, Callable[[], Any]], Any]
#: a sharded healer's check of the state its ranks fetched (None: this rank's fetch failed):
#: (ok, why), the same on every rank (``diloco.exchange.shard_healing``)
SharedCheck = Callable[[Any], tuple[bool, str]]


class StateTransfer:
    """This rank's side of healing's state transfers, as donor (``serve``) or healer (``fetch``).

    ``retry``: how coordinator calls are made (see ``Retry``). ``timeout_s``: deadline of each
    transfer and of waiting for the donor's offer, seconds. Completed transfers served are
    counted in ``stats.heals_served``.
    """

    def __init__(self, transport: Any, client: Any, retry: Retry, stats: "FaultStats", *, group: int, rank: int,
                 group_size: int, timeout_s: float) -> None:
        self.transport, self.client, self.retry, self.stats = transport, client, retry, stats
        self.group, self.rank, self.group_size, self.timeout_s = group, rank, group_size, timeout_s
        self._serving: list[threading.Thread] = []

    def serve(self, resp: QuorumResponse, state: dict[str, Any]) -> None:
        """As a rank of the donor group: send ``state`` (the engine's ``state_dict()``) to the
        healer ranks mapped to this rank; each transfer finishes in the background."""
        for frag in state.get("fragments", []):  # error-feedback residuals are the donor group's own
            if isinstance(frag, dict) and "residual" in frag:
                frag["residual"] = None
        self._serve(resp, state_blob.pack(state), {h: resp.members[h] for h in resp.healers}, "heal")

    def serve_mean(self, resp: QuorumResponse, mean: torch.Tensor) -> None:
        """As a rank of the donor group of a committed quorum: send its ``mean`` to the ranks of
        the live groups the grace window left out of it (``resp.left_out``), mapped to this rank;
        each transfer waits for its group to ask (it catches up) in the background."""
        self._serve(resp, state_blob.pack({"mean": mean}), dict(resp.left_out), "catch-up")

    def vouch_mean(self, resp: QuorumResponse, mean: torch.Tensor) -> None:
        """As rank 0 of a member of a committed quorum that is not its donor: tell the coordinator
        the SHA-256 of the ``mean`` this group landed, for each group the grace window left out
        (the donor's offer to them is released once a majority of the members vouch for it)."""
        blob = state_blob.pack({"mean": mean})
        digest = hashlib.sha256(blob).hexdigest()
        for group in sorted(resp.left_out):
            self.retry("committed mean's digest", lambda h=group: self.client.offer_state(
                StateOffer(resp.id, self.group, self.rank, h, 0, len(blob), digest)))

    def _serve(self, resp: QuorumResponse, blob: bytes, targets: dict[int, tuple[str, ...]], kind: str) -> None:
        """Send ``blob`` to every rank of ``targets`` (group -> addresses) that this rank serves
        (rank h of a group by donor rank h mod this group's size), announcing each offer."""
        digest = hashlib.sha256(blob).hexdigest()
        values = state_blob.to_values(blob)
        me = resp.members[self.group][self.rank]
        for group, addresses in targets.items():
            for h_rank, address in enumerate(addresses):
                if h_rank % self.group_size != self.rank:
                    continue
                handle = self.transport.all_reduce(values, [me, address], 0, tag=f"{kind}/{resp.id}/{group}/{h_rank}",
                                                   timeout_s=self.timeout_s, groups=[self.group, group])
                self.retry("state offer", lambda h=group, r=h_rank: self.client.offer_state(
                    StateOffer(resp.id, self.group, self.rank, h, r, len(blob), digest)))
                t = threading.Thread(target=self._watch_serve, args=(handle, resp.id, group, h_rank, kind),
                                     daemon=True)
                t.start()
                self._serving.append(t)

    def _watch_serve(self, handle: Any, quorum_id: str, group: int, h_rank: int, kind: str) -> None:
        try:
            handle.wait(self.timeout_s)
            if kind == "heal":
                self.stats.heals_served += 1
            else:
                self.stats.catch_ups_served += 1
        except (CollectiveAborted, TransportError) as e:
            log.warning("serving the %s of %s to group %d rank %d failed: %s",
                        "state" if kind == "heal" else "committed mean", quorum_id, group, h_rank, e)

    def fetch(self, resp: QuorumResponse, report: Callable[[bool, str], None],
              sharded: SharedCheck | None = None) -> dict[str, Any] | None:
        """As a healer rank: fetch and check the donor's state; ``report(ok, why)`` tells whether
        it did (checked once the healing exchange commits: no vote waits for it). Returns the
        state, or None if anything failed (the group then heals again). ``sharded``: the state is this rank's shard of a sharded model; the global
        hash is then checked by ``sharded(state or None)``, a collective of the healer's ranks
        that every rank calls once, whether its own fetch worked or not."""
        why = ""
        state = None
        try:
            state = self._fetch(resp, check_hash=sharded is None)
        except (CoordinatorError, CollectiveAborted, TransportError, state_blob.StateFormatError, KeyError,
                TypeError, ValueError) as e:
            why = f"healing fetch failed: {e}"
        except BaseException as e:  # the vote must still happen (no), then the error goes on
            report(False, f"healing fetch failed: {type(e).__name__}: {e}"[:400])
            raise
        if sharded is not None:
            ok, whose = sharded(None if why else state)
            why = why or ("" if ok else f"healing fetch failed: {whose}")
        report(not why, why[:400])
        return None if why else state

    def _fetch(self, resp: QuorumResponse, *, check_hash: bool) -> dict[str, Any]:
        state = state_blob.unpack(self._fetch_blob(resp, "heal"))
        got = params_hash([t for f in state["fragments"] for t in f["global"].values()]) if check_hash else ""
        if check_hash and resp.state_hash and got != resp.state_hash:
            raise state_blob.StateFormatError(f"the state's global hash {got} is not the quorum's {resp.state_hash}")
        return state

    def fetch_mean(self, resp: QuorumResponse, numel: int) -> torch.Tensor:
        """As a rank of a group left out of ``resp`` (which committed): its mean, from the donor rank
        that serves this rank, checked against the donor's announced SHA-256; ``numel`` fp32 values."""
        tree = state_blob.unpack(self._fetch_blob(resp, "catch-up"))
        mean = tree.get("mean") if isinstance(tree, dict) else None
        if not isinstance(mean, torch.Tensor) or mean.dtype != torch.float32 or mean.shape != (numel,):
            raise state_blob.StateFormatError(f"the donor's mean of {resp.id} is not {numel} fp32 values")
        return mean

    def _fetch_blob(self, resp: QuorumResponse, kind: str) -> bytes:
        """The blob the donor offers this rank in quorum ``resp`` (its size and SHA-256 checked)."""
        offer = self.retry("state offer", lambda: self.client.wait_offer(
            OfferQuery(resp.id, self.group, self.rank), timeout_s=self.timeout_s))
        donor = resp.members[offer.donor_group][offer.donor_rank]
        zeros = torch.zeros(state_blob.num_values(offer.nbytes), dtype=torch.float32)
        values = self.transport.all_reduce(zeros, [donor, self.transport.address], 1,
                                           tag=f"{kind}/{resp.id}/{self.group}/{self.rank}", timeout_s=self.timeout_s,
                                           groups=[offer.donor_group, self.group]).wait(self.timeout_s)
        blob = state_blob.from_values(values, offer.nbytes)
        if hashlib.sha256(blob).hexdigest() != offer.digest:
            raise state_blob.StateFormatError("the state's SHA-256 differs from the donor's offer")
        return blob

    def join(self, timeout_s: float) -> None:
        """Wait for the transfers this rank serves, up to ``timeout_s`` seconds each."""
        for t in self._serving:
            t.join(timeout_s)
