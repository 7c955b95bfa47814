"""Sharded (FSDP2) groups under DiLoCo: real processes, Gloo inside each group, TCP between groups.

Two launches (``sharded_helpers.launch``): two groups of 2 ranks, and a 2-rank group beside a
4-rank one (overlapping row ranges). In both, every sync mode, fragments, the initial copy, a
quantizing codec, an error-feedback codec and real FSDP training run; with fp32 the per-commit
global hashes (of the whole model: every rank's shard) must equal an unsharded run's bit for bit,
and every rank must send only its shard's share of the bytes.
"""

from __future__ import annotations

import pytest
from sharded_helpers import launch, reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODES = ["blocking", "overlap", "eager", "delayed", "co2"]
EXACT = [dict(mode=m, steps=12, h=4, inner="synthetic") for m in MODES] + [
    dict(mode="blocking", steps=12, h=4, fragments=2, inner="synthetic"),
    dict(mode="overlap", steps=12, h=4, fragments=2, inner="synthetic", initial_sync="copy"),
]
CODECS = [dict(mode="blocking", steps=12, h=4, codec="int8", inner="synthetic"),
          dict(mode="overlap", steps=12, h=4, codec="sign1", inner="synthetic")]
TRAIN = [dict(mode="blocking", steps=12, h=4, inner="adamw")]
WIDE = [dict(mode="blocking", steps=8, h=4, inner="synthetic", model="wide")]
REFUSALS = [dict(inner="refusals")]

RUNS = {"2+2": ([2, 2], EXACT + CODECS + TRAIN + WIDE + REFUSALS), "2+4": ([2, 4], EXACT + CODECS + TRAIN + WIDE)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {name: launch(sizes, configs, tmp_path_factory.mktemp(name.replace("+", "-")))
            for name, (sizes, configs) in RUNS.items()}


def ranks(result, k):
    """(group, rank, report of config k) for every rank."""
    return [(g, r, reports[k]) for g, group in enumerate(result) for r, reports in enumerate(group)]


@pytest.mark.parametrize("name", list(RUNS))
def test_every_mode_equals_the_unsharded_engine_bit_for_bit(runs, name):
    for k, config in enumerate(EXACT):
        expected = reference(config)
        for g, r, rep in ranks(runs[name], k):
            assert rep["hashes"] == expected[g], (name, config, g, r)
        assert len({h for _, h in expected[0]}) > 2  # the state moved from commit to commit


@pytest.mark.parametrize("name", list(RUNS))
def test_codecs_keep_the_groups_bit_identical(runs, name):
    for k, config in enumerate(CODECS, start=len(EXACT)):
        reports = ranks(runs[name], k)
        first = reports[0][2]["hashes"]
        assert len({h for _, h in first}) >= 3  # every commit a new state
        for g, r, rep in reports:
            assert rep["hashes"] == first, (name, config, g, r)


@pytest.mark.parametrize("name", list(RUNS))
def test_fsdp_training_merges_into_the_sharded_parameters(runs, name):
    k = len(EXACT) + len(CODECS)
    reports = ranks(runs[name], k)
    for g, r, rep in reports:
        assert rep["merged_equals_global"] == [True, True, True]  # after every blocking commit
        assert rep["hashes"] == reports[0][2]["hashes"]
        assert rep["eval_loss"] == reports[0][2]["eval_loss"] < 0.6  # trained (0.69 untrained)


@pytest.mark.parametrize("name", list(RUNS))
def test_every_rank_sends_only_its_share(runs, name):
    k = len(EXACT) + len(CODECS) + len(TRAIN)
    sizes = RUNS[name][0]
    for g, r, rep in ranks(runs[name], k):
        assert rep["global_bytes"] == rep["local_numel"] * 4 < rep["numel"] * 4  # state: the shard only
        share = 2 * rep["local_numel"] * 4  # two syncs; with two groups a ring sends its vector once
        assert 0.99 * share <= rep["bytes_sent"] <= 1.05 * share, (g, r, rep["bytes_sent"], share)
        if sizes[g] == sizes[1 - g]:
            assert rep["bytes_sent"] <= 1.05 * 2 * rep["numel"] * 4 / sizes[g]


def test_refusals_name_what_to_change(runs):
    k = len(RUNS["2+2"][1]) - 1
    for g, r, rep in ranks(runs["2+2"], k):
        assert "apply fully_shard to the root module" in rep["partly_sharded"]
        assert "cannot exchange a sharded model's shards" in rep["averager"]
        assert rep["local_numel"] < rep["numel"]
    assert len({rep["single_group_hash"] for _, _, rep in ranks(runs["2+2"], k)}) == 1
