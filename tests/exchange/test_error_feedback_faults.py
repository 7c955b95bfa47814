"""Fault tolerance with the error-feedback codecs: the groups of test_fault_tolerance, whose
exchanges now gather each group's own frames, with sign1 under the default Nesterov outer step and
with SparseLoCo (topk, its outer rule: the residual decays by beta and stands in for momentum). A
rolled-back round must leave every residual as it was (the job ends bit-identical to a clean one),
a healed group starts with a zero residual, and a refused (NaN) contribution does not enter the
residual."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import test_fault_tolerance as ft
import torch

import diloco
from diloco.coordinator import CoordinatorServer
from transport import FaultProxy


@pytest.fixture(autouse=True, params=["sign1", "sparseloco"])
def codec(request, monkeypatch):
    if request.param == "sign1":
        monkeypatch.setattr(ft, "SETTINGS", dataclasses.replace(ft.SETTINGS, codec="sign1"))
    else:  # whole 64x64 tiles per frame: chunks of 4096 values
        monkeypatch.setattr(ft, "SETTINGS", dataclasses.replace(ft.SETTINGS, codec="topk", chunk_bytes=4 * 4096))
        monkeypatch.setattr(ft.diloco, "DiLoCo", functools.partial(diloco.DiLoCo, outer_optimizer=diloco.sparseloco()))
    return request.param


@pytest.fixture
def coordinator():
    server = CoordinatorServer("127.0.0.1", 0, expected_groups=3, heartbeat_timeout_s=ft.HEARTBEAT_S,
                               join_timeout_s=30.0)
    server.start()
    yield server
    server.stop()


def residuals(group: ft.Group) -> list[torch.Tensor | None]:
    return group.engine.error_feedback.residual


def test_a_corrupted_round_rolls_back_the_residuals_too(coordinator):
    proxies: list[FaultProxy] = []

    def through_proxy(link) -> None:
        target = link.membership.ranks(1)[0]
        proxy = FaultProxy(target)
        proxies.append(proxy)
        link.transport.dial_overrides[target] = proxy.address
        proxy.corrupt(at_offset=1500, direction="up")  # a mid-job sign1 frame (about 3 kB in all)

    faulty = ft.run_job(coordinator.address, through_proxy)
    try:
        assert proxies[0].bytes_corrupted == 1
    finally:
        proxies[0].close()
    assert len({g.final_hash for g in faulty}) == 1
    assert sum(g.link.fault_stats.rollbacks for g in faulty) >= 3
    clean_server = CoordinatorServer("127.0.0.1", 0, expected_groups=3, heartbeat_timeout_s=ft.HEARTBEAT_S,
                                     join_timeout_s=30.0)
    clean_server.start()
    try:
        clean = ft.run_job(clean_server.address)
    finally:
        clean_server.stop()
    assert faulty[0].final_hash == clean[0].final_hash
    for f, c in zip(faulty, clean):
        assert all(torch.equal(a, b) for a, b in zip(residuals(f), residuals(c)))


@pytest.mark.parametrize("mode,fragments", [("blocking", None), ("overlap", ft.LAYERS)])
def test_a_killed_group_heals_back_with_a_zero_residual(coordinator, mode, fragments):
    first = [ft.Group(coordinator.address, g, mode=mode, fragments=fragments, die_at=13 if g == 2 else None).start()
             for g in range(3)]
    first[2].join()
    healer = ft.Group(coordinator.address, 2, mode=mode, fragments=fragments).start()
    survivors = [first[0], first[1], healer]
    ft.finish(survivors)
    assert len({g.final_hash for g in survivors}) == 1
    assert healer.link.fault_stats.healed
    assert coordinator.snapshot()["rounds_state"]["heals"] == 1
    assert all(e is None or torch.isfinite(e).all() for g in survivors for e in residuals(g))


def test_a_nan_contribution_is_refused_and_kept_out_of_the_residual(coordinator):
    groups = [ft.Group(coordinator.address, g, poison_at=10 if g == 1 else None).start() for g in range(3)]
    ft.finish(groups)
    assert len({g.final_hash for g in groups}) == 1
    assert any("NaN" in why for why in groups[1].link.fault_stats.rejected)
    assert all(e is not None and torch.isfinite(e).all() for g in groups for e in residuals(g))
