"""This rank's averager, built as it joins: the fault-tolerant striped averager
(``diloco.exchange.quorum_averager.QuorumAverager``), the bandwidth probe of the other groups whose
rates shape its first plan, and the background re-probes that keep the plan current.

A probe that a lost peer never answers would hold the rank until its deadline, deaf to the
coordinator: it runs ``unless_evicted``, which gives up once the coordinator tells the group to leave.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from diloco.coordinator.liveness import heartbeat_interval_s
from diloco.coordinator.waiting import waiting
from diloco.exchange.network_plan import BandwidthMonitor, measure_rates
from diloco.exchange.quorum_averager import QuorumAverager
from diloco.job.config import TransportConfig

log = logging.getLogger("diloco.runtime.rank.connection")  # the connection's messages, as before the split
T = TypeVar("T")


class Reprobe:
    """Starts a background re-measurement every ``every`` exchanges of ``averager``; a failed one
    (a peer group restarted or left) is logged and tried again later, never fatal."""

    def __init__(self, monitor: BandwidthMonitor, averager: QuorumAverager, every: int) -> None:
        self.monitor, self.averager, self.every, self._last = monitor, averager, every, 0

    def after_step(self) -> None:
        if self.monitor.error is not None:  # a peer that restarted or left: the table keeps its last rates
            log.warning("bandwidth re-measurement failed (the plan keeps the last rates; tried again in %d "
                        "exchanges): %s", self.every, self.monitor.error)
            self.monitor.error = None
        exchanges = self.averager.exchanges
        if self.every and exchanges - self._last >= self.every:
            self._last = exchanges
            self.monitor.refresh()


def make_averager(t: TransportConfig, transport, membership, client, group: int, rank: int, device,
                  process_group=None, *, incarnation: str = "", heartbeat_timeout: float = 15.0,
                  tokens_per_step: float | None = None) -> tuple[QuorumAverager, Reprobe | None]:
    """Probe the other groups, report to the coordinator, and build the fault-tolerant striped
    averager; returns it with the background re-prober (None when probing is off)."""
    addresses = {g: membership.ranks(g) for g in membership.groups}
    averager = QuorumAverager(
        transport, membership, client, group=group, rank=rank, incarnation=incarnation, heal=membership.heal,
        tokens_per_step=tokens_per_step, heartbeat_interval_s=heartbeat_interval_s(heartbeat_timeout),
        codec=t.codec_spec().build(), timeout_s=t.timeout_s, plan_every=t.plan_every,
        stripes_per_rank=t.stripes_per_rank, comm_device=device, process_group=process_group,
    )
    if not t.probe_bytes or len(addresses) < 2:
        return averager, None

    def measure() -> dict[int, float]:
        return measure_rates(transport, addresses, group, rank, t.probe_bytes)

    peers = ", ".join(f"group {g}" for g in sorted(addresses) if g != group)
    try:
        with waiting(log, f"the bandwidth probe of {peers} (--probe-bytes {t.probe_bytes:,})"):
            rates = unless_evicted(measure, averager)
        client.report_bandwidth(group, rank, rates)
    except BaseException:
        averager.close()
        raise
    monitor = BandwidthMonitor(measure, lambda rates: client.report_bandwidth(group, rank, rates))
    return averager, Reprobe(monitor, averager, t.reprobe_every)


#: seconds between looks at whether the coordinator told this group to leave, while it probes
EVICTION_POLL_S = 0.1


def unless_evicted(work: Callable[[], T], averager: QuorumAverager) -> T:
    """``work()``, run in a thread and given up (GroupEvicted) once the coordinator tells this group
    to leave. A peer lost while this rank probes it never answers, and the probe would wait for it
    until its deadline (``--timeout``), deaf to a coordinator that restarted meanwhile and no longer
    knows this group; the thread left behind ends with the transport this rank then closes."""
    done, result = threading.Event(), {}

    def run() -> None:
        try:
            result["value"] = work()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            result["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=f"{getattr(work, '__name__', 'work')}-unless-evicted", daemon=True).start()
    while not done.wait(EVICTION_POLL_S):
        if averager.evicted.is_set():
            raise averager.departure()
    if "error" in result:
        raise result["error"]
    return result["value"]
