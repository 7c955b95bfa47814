"""partition() on arbitrary nn.Modules: default balanced split, explicit groups, errors, GPT preset."""

import pytest
import torch
import torch.nn as nn

from diloco.demo.model import GPT, GPTConfig
from diloco.engine.averaging import SingleGroup
from diloco.engine.fragments import gpt_fragments, partition
from diloco.engine.streaming import StreamingDiLoCo


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 128), nn.Linear(128, 32))


def small_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=4, n_head=2, n_embd=32, dropout=0.0))


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()


class WithRootParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2048))
        self.body = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
        self.head = nn.Linear(32, 4)


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.encoder = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        self.decoder = nn.Linear(16, 16)
        self.head = nn.Linear(16, 8)
        self.extra = nn.Linear(8, 8)


def trainable(model: nn.Module) -> dict[str, int]:
    return {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}


def assert_exact_cover(model: nn.Module, frags: list[list[str]]) -> None:
    names = [n for f in frags for n in f]
    assert sorted(names) == sorted(trainable(model)) and len(names) == len(set(names))
    assert all(frags)


def loads(model: nn.Module, frags: list[list[str]]) -> list[int]:
    sizes = trainable(model)
    return [sum(sizes[n] for n in f) for f in frags]


def assert_within(model: nn.Module, frags: list[list[str]], tolerance: float = 0.25) -> None:
    total = sum(trainable(model).values())
    assert max(loads(model, frags)) <= (1 + tolerance) * total / len(frags)


# --- default rule ----------------------------------------------------------------------------


def test_sequential_splits_into_balanced_fragments_covering_every_parameter_once():
    model = mlp()
    frags = partition(model, 2)
    assert len(frags) == 2
    assert_exact_cover(model, frags)
    assert_within(model, frags)
    assert loads(model, frags) == [1056 + 4128, 4224]
    order = list(trainable(model))
    assert all(f == sorted(f, key=order.index) for f in frags)


def test_single_wrapper_child_is_expanded():
    model = Wrapped()
    frags = partition(model, 2)
    assert len(frags) == 2
    assert_exact_cover(model, frags)
    assert_within(model, frags)
    assert all(n.startswith("net.") for f in frags for n in f)


def test_leaf_module_is_expanded_into_its_parameters():
    model = mlp()
    frags = partition(model, 4, tolerance=1.0)
    assert len(frags) == 4
    assert_exact_cover(model, frags)
    assert ["2.weight"] in frags and ["2.bias"] in frags


def test_root_level_parameter_is_a_unit_of_its_own():
    model = WithRootParameter()
    frags = partition(model, 2)
    assert_exact_cover(model, frags)
    assert_within(model, frags)
    # scale (2,048) and head (132) balance body (2,112)
    body = [f"body.{i}.{k}" for i in (0, 1) for k in ("weight", "bias")]
    assert frags == [["scale", "head.weight", "head.bias"], body]


def test_frozen_and_tied_parameters():
    model = small_gpt()
    model.pos_emb.weight.requires_grad_(False)
    frags = partition(model, 3)
    names = [n for f in frags for n in f]
    assert "pos_emb.weight" not in names and "head.weight" not in names
    assert names.count("tok_emb.weight") == 1
    assert_exact_cover(model, frags)
    assert_within(model, frags)


def test_one_fragment_holds_everything():
    model = WithRootParameter()
    assert partition(model, 1) == [list(trainable(model))]


def test_impossible_tolerance_names_the_parameter_and_the_way_out():
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"'0\.weight' \(10,000 elements\).*fewer fragments.*tolerance"):
        partition(model, 2)
    assert len(partition(model, 2, tolerance=1.0)) == 2


def test_too_few_parameters_for_the_fragments():
    with pytest.raises(ValueError, match="fewer fragments"):
        partition(nn.Linear(4, 4), 3, tolerance=10.0)


# --- explicit groups -------------------------------------------------------------------------


def test_groups_match_whole_dotted_prefixes_and_balance_the_rest():
    model = EncoderDecoder()
    frags = partition(model, 2, groups=[["encoder"], ["decoder", "head"]])
    assert_exact_cover(model, frags)
    encoder = [f"encoder.{i}.{k}" for i in (0, 1) for k in ("weight", "bias")]
    assert [n for n in frags[0] if n.startswith("enc")] == encoder
    assert "decoder.weight" in frags[1] and "head.bias" in frags[1]
    # 'enc' and 'extra' are in no group: they join the smaller fragment (the second one)
    assert "enc.weight" in frags[1] and "extra.weight" in frags[1]


def test_group_prefix_matches_a_parameter_named_exactly():
    model = WithRootParameter()
    frags = partition(model, 2, groups=[["scale"], ["body", "head"]])
    assert frags == [["scale"], [n for n in trainable(model) if n != "scale"]]


def test_group_prefix_that_matches_nothing_lists_valid_names():
    model = EncoderDecoder()
    with pytest.raises(ValueError, match=r"'encod' matches no.*'encoder'.*'decoder'"):
        partition(model, 2, groups=[["encod"], ["decoder"]])


def test_parameter_in_two_groups_is_an_error():
    with pytest.raises(ValueError, match=r"'encoder\.0\.weight' is matched by groups\[0\] and groups\[1\]"):
        partition(EncoderDecoder(), 2, groups=[["encoder"], ["encoder.0"]])


# --- block rules ------------------------------------------------------------------------------


def test_missing_blocks_path_says_what_to_pass():
    with pytest.raises(ValueError, match=r"no submodule 'blocks'.*'net'.*Omit blocks"):
        partition(Wrapped(), 2, blocks="blocks")


def test_non_matching_block_pattern_says_what_to_pass():
    with pytest.raises(ValueError, match=r"matches no parameter name.*Omit blocks"):
        partition(mlp(), 2, block_pattern=r"layers\.(\d+)\.")
    with pytest.raises(ValueError, match="group that captures"):
        partition(mlp(), 2, block_pattern=r"\d+")


def test_gpt_preset_is_the_strided_split():
    model = small_gpt()
    names = list(trainable(model))
    blocks = {i: [n for n in names if n.startswith(f"blocks.{i}.")] for i in range(4)}
    expected = [
        blocks[0] + blocks[2] + ["tok_emb.weight"],
        blocks[1] + blocks[3] + ["pos_emb.weight", "ln_f.weight", "ln_f.bias"],
    ]
    expected = [sorted(f, key=names.index) for f in expected]
    assert partition(model, 2, blocks="blocks") == expected
    assert gpt_fragments(model, 2) == expected
    by_pattern = partition(model, 2, block_pattern=r"blocks\.(\d+)\.")
    assert by_pattern == expected


def test_default_partition_feeds_streaming_diloco():
    model = mlp()
    frags = partition(model, 2)
    engine = StreamingDiLoCo(
        model, torch.optim.SGD(model.parameters(), lr=0.01), fragments=frags,
        sync_every=4, overlap_steps=1, averager=SingleGroup(),
    )
    assert [f.names for f in engine.fragments] == frags
    x = torch.randn(8, 32)
    for _ in range(8):
        engine.inner_optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        engine.inner_optimizer.step()
        engine.step()
    engine.finish()


def test_pattern_or_rest_without_their_rule_is_an_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="blocks="):
        partition(model, 2, pattern="sequential")
    with pytest.raises(ValueError, match="rest"):
        partition(model, 2, rest="own")
