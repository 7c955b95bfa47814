"""A healer's first exchange as a member, under rounds of a fixed H: how long the survivors wait
for it, with and without the catch-up (issue 32, point 2).

Three single-rank groups in threads of this process, on real links and a real coordinator (the
harness of ``tests/exchange/test_quorum_grace_groups.py``: H=40 steps of about 30 ms, so a round
lasts about 1.2 s). Group 2 dies at step 50; its replacement's state transfer takes 0.8 s more
than it would (a large model's). With the catch-up the healer counts the steps the transfer took
untrained (``DiLoCo.steps_behind`` / ``skip_step``) and launches with the others; without it
(``steps_behind`` patched to 0) it trains all H steps and the others wait at that exchange.

    python bench/healer_catch_up.py --runs 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "exchange"), str(ROOT / "tests")]

import test_fault_tolerance as ft  # noqa: E402  (the harness, after the path above)
import test_quorum_grace_groups as harness  # noqa: E402

from diloco.coordinator import CoordinatorServer  # noqa: E402
from diloco.engine.diloco import DiLoCo  # noqa: E402


def one_run(catch_up: bool) -> tuple[int, list[float]]:
    """(steps the healer skipped, each survivor's seconds in the healer's first member exchange)."""
    real = DiLoCo.steps_behind
    if not catch_up:
        DiLoCo.steps_behind = lambda self: 0
    server = CoordinatorServer("127.0.0.1", 0, expected_groups=3, join_timeout_s=30.0,
                               heartbeat_timeout_s=ft.HEARTBEAT_S)
    server.start()
    try:
        first = [harness.CatchingUpGroup(server.address, g, die_at=50 if g == 2 else None).start() for g in range(3)]
        first[2].join()
        healer = harness.CatchingUpGroup(server.address, 2,
                                         on_connected=harness.slow_transfer(harness.TIMED_FETCH_S)).start()
        ft.finish([first[0], first[1], healer])
        healed = next(e["exchange"] for e in server.snapshot()["rounds_state"]["events"] if e["kind"] == "healed")
        took = [{e: s for e, s, _, _ in g.link.fault_stats.exchanges}[healed + 1] for g in first[:2]]
        return healer.skipped, took
    finally:
        server.stop()
        DiLoCo.steps_behind = real


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=2, help="runs of each variant, alternating")
    a = p.parse_args(argv)
    for _ in range(a.runs):
        for catch_up in (True, False):
            skipped, took = one_run(catch_up)
            print(f"{'with' if catch_up else 'without'} the catch-up: the healer skipped {skipped} steps; the "
                  f"survivors spent {', '.join(f'{s:.3f}' for s in took)} s in its first exchange as a member",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
