"""The codec family's spec: its table of codecs agrees with the registered classes, its checks name
the option and the codecs that take it, ``build()`` makes the codec, and it reads without torch."""

import inspect
import subprocess
import sys

import pytest

import compress
from compress.codec_spec import CODECS, CodecSpec, codec_names, codec_options
from compress.codec_table import _BY_NAME


def _constructor_keywords(cls: type) -> set[str]:
    return {p for klass in cls.__mro__ if "__init__" in vars(klass)
            for p in inspect.signature(klass.__init__).parameters} - {"self", "kw"}


def test_the_table_is_the_registered_codecs_with_their_parameters():
    assert list(CODECS) == compress.available_codecs()
    for name, traits in CODECS.items():
        cls = _BY_NAME[name]
        assert traits.error_feedback == cls.requires_error_feedback, name
        built = set(compress.get_codec(name).params) - {"zstd", "zstd_level"}
        assert built <= traits.params <= _constructor_keywords(cls), name


def test_each_option_reaches_the_codec_under_its_parameter():
    codec = CodecSpec(codec="topk", codec_block=1024, topk_density=0.015, zstd=True, zstd_level=3).build()
    assert (codec.name, codec.chunk, codec.k, codec.zstd, codec.zstd_level) == ("topk", 1024, 15, True, 3)
    assert CodecSpec(codec="int8", codec_block=64).build().block_size == 64
    assert CodecSpec(codec="int4", codec_fast=True).build().params["search"] is False
    assert CodecSpec().build().name == "fp32"


@pytest.mark.parametrize("change, message", [
    (dict(codec="fp32", codec_block=64), "--codec fp32: --codec-block applies to the codecs with scale blocks or "
                                         "chunks (int8, int4, fp4-e2m1, fp4-e3m0, sign1, topk, lloyd4, int2), not fp32"),
    (dict(codec="int8", codec_fast=True), "--codec int8: --codec-fast applies to the 4-bit codecs (int4, fp4-e2m1, "
                                          "fp4-e3m0, lloyd4), not int8"),
    (dict(codec="int8", topk_density=0.1), "--codec int8: --topk-density applies to --codec topk only, not int8"),
    (dict(codec="int3"), "--codec int3: unknown codec 'int3'; available: fp32, bf16"),
    (dict(codec="int8", final_codec="sign1"), "--final-codec sign1 keeps a residual itself"),
    (dict(codec="int8", final_codec="nope"), "--final-codec nope: unknown codec 'nope'"),
    (dict(codec="int8", zstd_level=40), "--codec int8: zstd_level must be in [-7, 22], got 40"),
])
def test_a_problem_names_the_option_and_the_codecs_that_take_it(change, message):
    problems = CodecSpec(**change).problems()
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_the_final_codec_keeps_the_entropy_stage_and_nothing_else():
    spec = CodecSpec(codec="topk", codec_block=1024, topk_density=0.015, zstd=True, zstd_level=5, final_codec="int8")
    assert spec.final() == CodecSpec(codec="int8", zstd=True, zstd_level=5)
    assert CodecSpec(codec="int8").final() is None


def test_the_options_are_the_flags_of_a_job_and_their_names_come_from_the_table():
    from diloco.job.config import TransportConfig

    assert [f.name for f in codec_options()] == ["codec", "codec_block", "topk_density", "final_codec", "codec_fast",
                                                 "zstd", "zstd_level", *[f.name for f in codec_options()[7:]]]
    t = TransportConfig(codec="int2", codec_block=1024)
    assert t.codec_spec() == CodecSpec(codec="int2", codec_block=1024)
    codec_help = codec_options()[0].metadata["help"]
    assert all(name in codec_help for name in CODECS)
    assert codec_names(error_feedback=True) == ["sign1", "topk", "int2"]


def test_the_spec_reads_and_checks_without_torch():
    program = ("import sys\nfrom compress.codec_spec import CodecSpec\n"
               "assert CodecSpec(codec='int8', codec_fast=True, zstd=False).problems()\n"
               "assert not CodecSpec().problems()\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


# --topk-value-bits: the option added by editing the spec alone (its field in CodecOptions)

def test_topk_value_bits_is_a_flag_a_toml_key_and_listed_in_the_help():
    import argparse

    from diloco.job.config_parse import add_arguments, from_args, from_dict

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "--topk-value-bits" in parser.format_help()
    cfg = from_args(parser.parse_args(["--codec", "topk", "--topk-value-bits", "4"]))
    assert cfg.transport.topk_value_bits == 4 and cfg.transport.codec_spec().build().value_bits == 4
    assert from_dict({"transport": {"codec": "topk", "topk_value_bits": 8}}).validate().transport.topk_value_bits == 8
    assert from_args(parser.parse_args([])).transport.codec_spec().params() == {"zstd": False, "zstd_level": 1}


def test_topk_value_bits_buys_precision_with_bytes():
    import torch

    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(0))
    errors, sizes = [], []
    for bits in (2, 4, 8):
        codec = CodecSpec(codec="topk", topk_value_bits=bits).build()
        frame = codec.encode(x)
        back = compress.decode_frame(frame)
        kept = back != 0
        errors.append(float((back[kept] - x[kept]).norm() / x[kept].norm()))
        sizes.append(len(frame))
    assert errors[0] > errors[1] > errors[2] and sizes[0] < sizes[1] < sizes[2]
    assert CodecSpec(codec="topk").build().params == CodecSpec(codec="topk", topk_value_bits=2).build().params


def test_the_last_exchange_codec_is_at_its_own_defaults():
    spec = CodecSpec(codec="topk", topk_value_bits=4, final_codec="int8")
    assert spec.final() == CodecSpec(codec="int8")  # the last exchange's codec at its own defaults


# --topk-mean, --topk-clip-median: how the gather averages topk's contributions (compress.gather_rule)

def test_topk_mean_and_clip_are_flags_toml_keys_in_the_help_and_reach_the_codec():
    import argparse

    from diloco.job.config_parse import add_arguments, from_args, from_dict

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = parser.format_help()
    assert "--topk-mean {all,senders}" in text and "--topk-clip-median" in text
    assert text.index("--topk-value-bits") < text.index("--topk-mean") < text.index("--topk-clip-median")
    cfg = from_args(parser.parse_args(["--codec", "topk", "--topk-mean", "senders", "--topk-clip-median", "true"]))
    codec = cfg.transport.codec_spec().build()
    assert (codec.mean, codec.clip_median) == ("senders", True)
    cfg = from_dict({"transport": {"codec": "topk", "topk_mean": "senders", "topk_clip_median": True}}).validate()
    assert (cfg.transport.topk_mean, cfg.transport.topk_clip_median) == ("senders", True)
    default = CodecSpec(codec="topk").build()
    assert (default.mean, default.clip_median) == ("all", False)  # today's mean stays the default
    with pytest.raises(SystemExit):
        parser.parse_args(["--codec", "topk", "--topk-mean", "peers"])


@pytest.mark.parametrize("change,message", [
    (dict(codec="int8", topk_value_bits=4), "--topk-value-bits applies to --codec topk only, not int8"),
    (dict(codec="topk", topk_value_bits=9), "--topk-value-bits must be in [1, 8], got 9"),
    (dict(codec="auto", topk_value_bits=4), "leave them unset (got --topk-value-bits 4)"),
    (dict(codec="int2", topk_mean="senders"), "--topk-mean applies to --codec topk only, not int2"),
    (dict(codec="sign1", topk_clip_median=True), "--topk-clip-median applies to --codec topk only, not sign1"),
    (dict(codec="fp32", topk_mean="senders"), "--topk-mean applies to --codec topk only, not fp32"),
    (dict(codec="topk", topk_mean="peers"), "--topk-mean must be one of all, senders, got 'peers'"),
    (dict(codec="auto", topk_mean="senders"), "leave them unset (got --topk-mean senders)"),
])
def test_topk_options_are_refused_where_they_do_not_apply(change, message):
    from diloco.job.config import Config, ConfigError

    cfg = Config()
    for key, value in change.items():
        setattr(cfg.transport, key, value)
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert message in str(e.value)
