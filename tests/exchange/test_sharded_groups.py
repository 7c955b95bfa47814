"""Sharded (FSDP2) groups under DiLoCo: real processes, Gloo inside each group, TCP between groups.

Two launches (``sharded_helpers.launch``): two groups of 2 ranks, and a 2-rank group beside a
4-rank one (overlapping row ranges). In both, every sync mode, fragments, the initial copy, a
quantizing codec, an error-feedback codec and real FSDP training run; with fp32 the per-commit
global hashes (of the whole model: every rank's shard) must equal an unsharded run's bit for bit,
and every rank must send only its shard's share of the bytes. The 2+2 launch also stops mid-run,
saves DCP checkpoints and resumes; the 2+4 launch resumes from them with 4 ranks where 2 saved.
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
# stopped after inner step 6 and resumed from a DCP checkpoint: an exchange in flight (overlap,
# 2 fragments), eager's own previous Δ, an error-feedback residual (sign1)
RESUME = [dict(mode="overlap", fragments=2, steps=12, h=4, stop=6, inner="synthetic"),
          dict(mode="eager", steps=12, h=4, stop=6, inner="synthetic"),
          dict(mode="overlap", steps=12, h=4, stop=6, codec="sign1", inner="synthetic")]
SIZES = {"2+2": [2, 2], "2+4": [2, 4]}


def configs(name: str, folder) -> list[dict]:
    """The configs of each launch: the 2+4 one resumes (resharding group 1 from 2 to 4 ranks)
    from the checkpoints the 2+2 one wrote."""
    resume = [dict(c, dir=str(folder / f"ckpt-{k}")) for k, c in enumerate(RESUME)]
    if name == "2+2":
        return EXACT + CODECS + TRAIN + WIDE + resume + REFUSALS
    return EXACT + CODECS + TRAIN + WIDE + [dict(c, load_from=c["dir"]) for c in resume]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharded")
    return {name: launch(sizes, configs(name, folder), folder / name.replace("+", "-"))
            for name, sizes in SIZES.items()}


def ranks(result, k):
    """(group, rank, report of config k) for every rank."""
    return [(g, r, reports[k]) for g, group in enumerate(result) for r, reports in enumerate(group)]


@pytest.mark.parametrize("name", list(SIZES))
def test_every_mode_equals_the_unsharded_engine_bit_for_bit(runs, name):
    for k, config in enumerate(EXACT):
        expected = reference(config)
        for g, r, rep in ranks(runs[name], k):
            assert rep["hashes"] == expected[g], (name, config, g, r)
        assert len({h for _, h in expected[0]}) > 2  # the state moved from commit to commit


@pytest.mark.parametrize("name", list(SIZES))
def test_codecs_keep_the_groups_bit_identical(runs, name):
    for k, config in enumerate(CODECS, start=len(EXACT)):
        reports = ranks(runs[name], k)
        first = reports[0][2]["hashes"]
        assert len({h for _, h in first}) >= 3  # every commit a new state
        for g, r, rep in reports:
            assert rep["hashes"] == first, (name, config, g, r)


@pytest.mark.parametrize("name", list(SIZES))
def test_fsdp_training_merges_into_the_sharded_parameters(runs, name):
    k = len(EXACT) + len(CODECS)
    reports = ranks(runs[name], k)
    for g, r, rep in reports:
        assert rep["merged_equals_global"] == [True, True, True]  # after every blocking commit
        assert rep["hashes"] == reports[0][2]["hashes"]
        assert rep["eval_loss"] == reports[0][2]["eval_loss"] < 0.6  # trained (0.69 untrained)


@pytest.mark.parametrize("name", list(SIZES))
def test_every_rank_sends_only_its_share(runs, name):
    k = len(EXACT) + len(CODECS) + len(TRAIN)
    sizes = SIZES[name]
    for g, r, rep in ranks(runs[name], k):
        assert rep["global_bytes"] == rep["local_numel"] * 4 < rep["numel"] * 4  # state: the shard only
        share = 2 * rep["local_numel"] * 4  # two syncs; with two groups a ring sends its vector once
        assert 0.99 * share <= rep["bytes_sent"] <= 1.05 * share, (g, r, rep["bytes_sent"], share)
        if sizes[g] == sizes[1 - g]:
            assert rep["bytes_sent"] <= 1.05 * 2 * rep["numel"] * 4 / sizes[g]


def test_resume_from_dcp_is_bit_identical_also_onto_other_ranks(runs):
    k0 = len(EXACT) + len(CODECS) + len(TRAIN) + len(WIDE)
    for k, config in enumerate(RESUME, start=k0):
        saved = {}
        for g, r, rep in ranks(runs["2+2"], k):
            assert rep["loaded_hash"] == rep["saved_hash"]
            assert rep["resumed"][-1] == rep["full"][-1], (config, g, r)  # as if never stopped
            assert rep["resumed"] == [h for h in rep["full"] if h[0] == "final" or h[0] >= config["stop"]]
            saved[g] = rep
        for g, r, rep in ranks(runs["2+4"], k):  # group 1 resharded from 2 ranks to 4
            assert rep["loaded_hash"] == saved[g]["saved_hash"], (config, g, r)
            if config.get("codec") is None:  # fp32 does not depend on the cut; a codec's blocks do
                assert rep["resumed"] == saved[g]["resumed"], (config, g, r)


def test_refusals_name_what_to_change(runs):
    k = len(EXACT + CODECS + TRAIN + WIDE + RESUME)  # the last config of the 2+2 launch
    for g, r, rep in ranks(runs["2+2"], k):
        assert "apply fully_shard to the root module" in rep["partly_sharded"]
        assert "cannot exchange a sharded model's shards" in rep["averager"]
        assert rep["local_numel"] < rep["numel"]
    assert len({rep["single_group_hash"] for _, _, rep in ranks(runs["2+2"], k)}) == 1
