"""Threads per rank from the container's CPU request or quota, and the kernels a worker reports."""

from __future__ import annotations

import pytest

from diloco.runtime.rank import kernels
from diloco.runtime.rank.cpu_threads import CPU_REQUEST_ENV, cgroup_cpu_quota, threads_per_rank


def test_an_explicit_count_wins(tmp_path):
    assert threads_per_rank(3, {CPU_REQUEST_ENV: "8"}, cgroup_root=tmp_path) == (3, "--threads-per-rank")


def test_the_cpu_request_is_shared_by_the_nodes_ranks(tmp_path):
    n, why = threads_per_rank(0, {CPU_REQUEST_ENV: "4"}, cgroup_root=tmp_path)
    assert n == 4 and "4 cores" in why
    assert threads_per_rank(0, {CPU_REQUEST_ENV: "16", "LOCAL_WORLD_SIZE": "8"}, cgroup_root=tmp_path)[0] == 2
    assert threads_per_rank(0, {CPU_REQUEST_ENV: "2", "LOCAL_WORLD_SIZE": "8"}, cgroup_root=tmp_path)[0] == 1


def test_a_bad_request_is_an_error_naming_it(tmp_path):
    for bad in ("0", "1.5", "four", ""):
        with pytest.raises(ValueError, match=CPU_REQUEST_ENV):
            threads_per_rank(0, {CPU_REQUEST_ENV: bad}, cgroup_root=tmp_path)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        threads_per_rank(0, {CPU_REQUEST_ENV: "4", "LOCAL_WORLD_SIZE": "0"}, cgroup_root=tmp_path)
    with pytest.raises(ValueError, match=">= 0"):
        threads_per_rank(-1, {}, cgroup_root=tmp_path)


def test_the_cgroup_quota_when_no_request_is_given(tmp_path):
    (tmp_path / "cpu.max").write_text("300000 100000\n")  # cgroup v2: 3 cores
    assert cgroup_cpu_quota(tmp_path) == 3.0
    assert threads_per_rank(0, {"LOCAL_WORLD_SIZE": "1"}, cgroup_root=tmp_path)[0] == 3
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(v1) == 2.5 and threads_per_rank(0, {}, cgroup_root=v1)[0] == 2
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads_per_rank(0, {}, cgroup_root=v1) == (1, "neither a CPU request nor a CPU quota is known")


def test_the_kernels_in_use_are_named(monkeypatch):
    from compress.codecs import blockwise

    kind, sentence = kernels.describe("int4")
    assert kind == ("native" if blockwise.native_available() else "torch")
    if kind == "native":
        assert "C kernels" in sentence and "_native" in sentence
    monkeypatch.setattr(blockwise, "USE_NATIVE", False)
    kind, sentence = kernels.describe("int4")
    assert kind == "torch" and "COMPRESS_NATIVE=0" in sentence and "slower" in sentence
    monkeypatch.setattr(blockwise, "USE_NATIVE", True)
    monkeypatch.setattr(blockwise, "_native", None)
    kind, sentence = kernels.describe("fp32")
    assert kind == "torch" and "not built" in sentence and "slower" not in sentence
