"""Group plumbing: one group's ranks average a pseudo-gradient with the other groups.

The flat pseudo-gradient is cut into stripes (``transport.stripe_plan``). In every group each
stripe is carried by one rank, chosen in proportion to the ranks' measured bandwidth (groups may
have different numbers of ranks). Each stripe runs its own ring all-reduce across groups over the
carrying ranks' own data-plane endpoints, so every rank's NIC carries traffic. The averaged
stripes are then shared inside the group over its process group (Gloo or NCCL): each rank
broadcasts its contiguous run of stripes. Every rank ends with the whole mean, bit-identical
across ranks and groups.

The plan (ring order, stripe shares) may change between exchanges; ``plans(k)`` gives the plan of
exchange k and must give the same answer on every rank of every group (see
``diloco.exchange.network_plan``).

A sharded group (FSDP2) passes ``shards=``: each rank then exchanges only the shard it holds, with
the ranks of the other groups that hold the same elements, in the plan's ring order
(``diloco.exchange.shard_plan``); nothing is shared inside the group afterwards. The stripes of
such an exchange follow the shards, not the ranks' bandwidths: a rank carries what it holds.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.distributed as dist

from diloco.engine.averaging import FinalRanges, writable
from diloco.engine.shard_layout import ShardLayout
from diloco.engine.shard_reduce import sum_of_squares
from diloco.exchange.network_plan import NetworkPlan, equal_plan
from diloco.exchange.shard_plan import ShardExchangePlan, shard_exchange_plan
from transport import StripePlan, stripe_plan

Plan = StripePlan | ShardExchangePlan


class Membership(Protocol):
    groups: list[int]
    ring_order: list[int]

    def ranks(self, group: int) -> list[str]: ...


class StripedAverager:
    """Averages a flat fp32 vector across groups through ``transport``, striped over ranks (or,
    for a sharded model, shard by shard). An engine ``Averager`` (``diloco.engine.averaging``)
    that exchanges shards, feeds errors back and switches codecs (``ShardExchanging``,
    ``ErrorFed``, ``CodecSwitching``)."""

    exchanges_shards = True

    def __init__(
        self,
        transport,
        membership: Membership,
        *,
        group: int,
        rank: int,
        codec=None,
        timeout_s: float = 60.0,
        plans: Callable[[int], NetworkPlan] | None = None,
        stripes_per_rank: int = 4,
        process_group: dist.ProcessGroup | None = None,
        comm_device: torch.device | str = "cpu",
    ) -> None:
        self.transport = transport
        self.membership = membership
        self.group = group
        self.rank = rank
        self.group_size = len(membership.ranks(group))
        sizes = {g: len(membership.ranks(g)) for g in membership.groups}
        self.plans = plans if plans is not None else (lambda exchange, _p=equal_plan(sizes): _p)
        self.stripes_per_rank = stripes_per_rank
        self.codec = codec
        #: the codec needs error feedback (int2, sign1, topk): exchanges run as all-gathers of each
        #: group's own encoded contribution, and the caller keeps the residual (``DiLoCo`` does)
        self.error_feedback = bool(getattr(codec, "requires_error_feedback", False))
        self.timeout_s = timeout_s
        self.process_group = process_group
        self.comm_device = torch.device(comm_device)
        self.num_groups = len(sizes)
        #: ``start`` takes ``on_final`` (the transport's rings report final ranges of the mean)
        self.streams_final = bool(getattr(transport, "reports_final", False))
        self.writes_into = True  # start(out=): the mean in the caller's vector (averaging.WritesInto)
        self.exchanges = 0
        self._stripe_plans: dict[tuple[NetworkPlan, int], StripePlan] = {}
        self._shard_plans: dict[tuple, ShardExchangePlan] = {}

    @property
    def bytes_sent(self) -> int:
        return int(self.transport.bytes_sent)

    def set_codec(self, codec) -> None:
        """Use ``codec`` from the next ``start`` on (``--codec auto`` following the link: every
        group switches at the same exchange). Exchanges already started keep the codec they
        started with, retries included."""
        self.codec = codec
        self.error_feedback = bool(getattr(codec, "requires_error_feedback", False))

    def stripe_plan_for(self, plan: NetworkPlan, numel: int, codec=None) -> StripePlan:
        """The stripes of an ``numel``-element vector under ``plan``: ``stripes_per_rank`` per rank
        of the largest group in it (the same on every member of the plan), each starting at a
        multiple of the chunk of ``codec`` (default this averager's) where it has one (top-k's: its
        chunks are then the caller's, SparseLoCo's tiles)."""
        align = int(getattr(self.codec if codec is None else codec, "chunk", 1))
        key = (plan, numel, align)
        if key not in self._stripe_plans:
            bandwidths = [list(b) for b in plan.rank_bandwidths]
            stripes = self.stripes_per_rank * max(len(b) for b in bandwidths)
            if len(self._stripe_plans) > 64:
                self._stripe_plans.clear()
            self._stripe_plans[key] = stripe_plan(numel, bandwidths, min(stripes, max(numel, 1)), align=align)
        return self._stripe_plans[key]

    def shard_plan_for(self, shards: ShardLayout, sizes: list[int], me: int) -> ShardExchangePlan:
        """This rank's part of a sharded exchange among groups of ``sizes`` (this one at ``me``)."""
        if shards.size != self.group_size or shards.rank != self.rank:
            raise ValueError(f"a shard layout of rank {shards.rank} of {shards.size} given to rank {self.rank} "
                             f"of a {self.group_size}-rank group: the model must be sharded over the group's ranks")
        key = (shards, tuple(sizes), me)
        if key not in self._shard_plans:
            if len(self._shard_plans) > 64:
                self._shard_plans.clear()
            self._shard_plans[key] = shard_exchange_plan(shards, sizes, me, self.stripes_per_rank)
        return self._shard_plans[key]

    def contribution_norm(self, src: torch.Tensor, shards: ShardLayout | None = None) -> float:
        """L2 norm of a contribution: of ``src``, or with ``shards`` of the whole fragment (fp64
        sums of every rank's shard: a collective of the group, so every rank calls it)."""
        if shards is None:
            return float(src.norm())
        return sum_of_squares([src], self.process_group if self.group_size > 1 else None) ** 0.5

    @property
    def group_index(self) -> int:
        """This group's position among the member groups (sorted ids), 0-based."""
        return sorted(self.membership.groups).index(self.group)

    def start(self, flat: torch.Tensor, *, tag: str, exact: bool = False,
              error_feedback: bool = False, shards: ShardLayout | None = None,
              on_final: FinalRanges | None = None, out: torch.Tensor | None = None) -> "_StripedPending":
        """Launch the cross-group rings of this rank's stripes; every rank of the group calls it,
        in the same order as every other rank of every group. ``exact``: fp32 on the wire
        whatever ``codec`` is (control exchanges such as the initial-parameter check).
        ``error_feedback``: the caller keeps a residual (required for a codec that needs one);
        the pending result's ``sent`` then says what the other groups decoded of ``flat``.
        ``shards``: ``flat`` is this rank's shard of a sharded fragment laid out so (module doc).
        ``on_final``: told ``on_final(1, mean, lo, hi)`` as ``mean[lo:hi]`` of this rank's own
        stripes becomes final (``FinalRanges``; its attempt is always 1 here). ``out``: where the
        mean goes (``averaging.WritesInto``; a vector of its own unless given)."""
        gather = self.gathers(exact, error_feedback)
        plan = self.plans(self.exchanges)
        self.exchanges += 1
        # On a GPU the vector stays there: the rings encode it there and only frames cross to the host.
        src = flat.detach().to(torch.float32).contiguous()
        out = writable(out, src)
        sent = torch.empty_like(src) if gather else None
        addresses = {g: self.membership.ranks(g) for g in plan.groups}
        sp, me, handles = self.launch(src, out, plan, addresses, tag=tag, exact=exact, sent=sent, shards=shards,
                                      on_final=None if on_final is None else (lambda m, lo, hi: on_final(1, m, lo, hi)))
        return _StripedPending(self, out, sp, me, handles, flat.device, sent=sent)

    def gathers(self, exact: bool, error_feedback: bool) -> bool:
        """Whether an exchange runs as an all-gather of each group's own encoded contribution
        (``transport`` ``all_gather_mean``) instead of the ring all-reduce: for a codec that
        needs error feedback, except exact (fp32) exchanges. ValueError when such a codec is
        used by a caller that keeps no residual: without one, its bias is never corrected."""
        if exact or not self.error_feedback:
            return False
        if not error_feedback:
            raise ValueError(f"codec {getattr(self.codec, 'name', self.codec)!r} needs error feedback: the caller "
                             "must keep the residual and say so (error_feedback=True, as diloco.DiLoCo does)")
        return True

    def launch(self, src: torch.Tensor, out: torch.Tensor, plan: NetworkPlan, addresses: dict[int, list[str]],
               *, tag: str, exact: bool = False, sent: torch.Tensor | None = None,
               scales: dict[int, float] | None = None, shards: ShardLayout | None = None,
               codec=None, on_final: Callable[[torch.Tensor, int, int], None] | None = None) -> tuple[Plan, int, list]:
        """Start the rings of this rank's stripes of ``src`` among ``plan.groups`` (data-plane
        ``addresses`` by group, by rank); each writes its stripe of the mean into ``out``.
        With ``sent`` the rings are all-gathers of each group's own encoded stripe, and each
        writes what the others decoded of ours into its stripe of ``sent``; ``scales``: each
        group's weight in their mean (by group id; default 1). ``shards``: ``src`` is this
        rank's shard laid out so; ``out`` and ``sent`` are then in the plan's exchange order
        until ``land`` puts them back. ``codec``: the exchange's (default this averager's now).
        ``on_final(out, lo, hi)``: ``out[lo:hi]`` is final (the all-reduce of unsharded stripes
        reports it as it goes; the other exchanges do not).
        Returns the stripe plan, this group's index in ``plan.groups`` and the ring handles."""
        codec = self.codec if codec is None else codec
        me = plan.groups.index(self.group)
        ranks = [addresses[g] for g in plan.groups]
        order = [plan.groups.index(g) for g in plan.ring_order]
        if shards is None:
            sp: Plan = self.stripe_plan_for(plan, src.numel(), codec)
            mine, ring_of = sp.stripes_of(me, self.rank), (lambda s: sp.ring(s.index, ranks, order))
        else:
            sp = self.shard_plan_for(shards, [len(a) for a in ranks], me)
            if src.numel() != sp.numel:
                raise ValueError(f"{tag}: a shard of {src.numel()} elements, its layout says {sp.numel}")
            src = sp.to_exchange_order(src)
            mine, ring_of = list(sp.stripes), (lambda s: sp.ring(s, ranks, order))
        index = order.index(me)
        ring_groups = [plan.groups[o] for o in order]  # each ring member's group: its neighbours must prove it
        if sent is not None:
            weights = None if scales is None else [scales[g] for g in ring_groups]
            return sp, me, [
                (s, self.transport.all_gather_mean(
                    src[s.start : s.stop], ring_of(s), index,
                    tag=f"{tag}/s{s.index}", codec=codec, timeout_s=self.timeout_s,
                    out=out[s.start : s.stop], sent=sent[s.start : s.stop], groups=ring_groups, finite=True,
                    scales=weights,
                ))
                for s in mine if s.size
            ]
        streamed = on_final is not None and shards is None and self.streams_final
        handles = [
            (s, self.transport.all_reduce(
                src[s.start : s.stop], ring_of(s), index,
                tag=f"{tag}/s{s.index}", codec=None if exact else codec, timeout_s=self.timeout_s,
                out=out[s.start : s.stop], groups=ring_groups, finite=not exact,
                **({"on_final": _offset(on_final, out, s.start)} if streamed else {}),
            ))
            for s in mine if s.size
        ]
        return sp, me, handles

    def all_reduce_mean(self, flat: torch.Tensor, *, round: int) -> torch.Tensor:
        """Blocking mean of ``flat`` over groups; every rank of this group passes the same vector."""
        return self.start(flat, tag=f"r{round}").wait()

    def land(self, out: torch.Tensor, sent: torch.Tensor | None, sp: Plan, me: int) \
            -> tuple[torch.Tensor, torch.Tensor | None]:
        """After this rank's rings finished: the mean (and ``sent``) as the caller passed its
        vector. Striped: every rank's stripes shared inside the group; sharded: this rank's
        shard put back in its own order (nothing crosses the group)."""
        if isinstance(sp, ShardExchangePlan):
            return sp.to_shard_order(out), None if sent is None else sp.to_shard_order(sent)
        if self.group_size > 1:
            out = self.share_in_group(out, sp, me)
            if sent is not None:
                sent = self.share_in_group(sent, sp, me)
        return out, sent

    def share_in_group(self, out: torch.Tensor, sp: StripePlan, me: int) -> torch.Tensor:
        """Each rank broadcasts its contiguous run of averaged stripes to the rest of its group
        (over NCCL on GPUs, where ``out`` already is); the whole mean, on ``comm_device``."""
        buf = out.to(self.comm_device)
        group_ranks = None if self.process_group is None else dist.get_process_group_ranks(self.process_group)
        for r in range(self.group_size):
            stripes = sp.stripes_of(me, r)
            if not stripes:
                continue
            lo, hi = stripes[0].start, stripes[-1].stop
            if hi > lo:
                src = r if group_ranks is None else group_ranks[r]
                dist.broadcast(buf[lo:hi], src=src, group=self.process_group)
        return buf


def _offset(on_final: Callable[[torch.Tensor, int, int], None], out: torch.Tensor, start: int) \
        -> Callable[[int, int], None]:
    """A stripe's ring reports ranges of its stripe; the caller hears them in ``out``'s terms."""
    return lambda lo, hi: on_final(out, start + lo, start + hi)


class _StripedPending:
    """Cross-group rings in flight; ``wait`` collects them and shares the stripes in the group.
    With error feedback, ``sent`` (after ``wait``) is the whole of what the other groups
    decoded of this group's contribution (each rank's stripes, shared in the group)."""

    def __init__(self, averager: StripedAverager, out, sp: Plan, me: int, handles, device,
                 sent: torch.Tensor | None = None) -> None:
        self._avg, self._out, self._sp, self._me, self._handles, self._device = averager, out, sp, me, handles, device
        self._sent = sent
        self.sent: torch.Tensor | None = None
        self._value: torch.Tensor | None = None
        self.final_attempt = 1  # the attempt whose ranges ``on_final`` reported (there is one)

    def wait(self) -> torch.Tensor:
        if self._value is None:
            out = self._out  # each ring wrote its stripe of the mean here
            for _, h in self._handles:
                h.wait(self._avg.timeout_s)
            out, sent = self._avg.land(out, self._sent, self._sp, self._me)
            if sent is not None:
                self.sent = sent.to(self._device)
            self._value = out.to(self._device)
        return self._value
