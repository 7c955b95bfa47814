"""The codec family's spec: ``--codec`` and its options, each spelled once, here.

``CodecOptions`` holds the options as a job configures them (its fields are the ``[transport]``
keys and the flags of ``diloco run``: ``diloco.job.config.TransportConfig`` inherits them);
``CodecSpec`` adds their checks and ``build()``. ``CODECS`` names every codec with the
constructor parameters it takes, torch-free, so help text, checks and the configuration read
without importing the codecs (``tests/compress/test_codec_spec.py`` holds it to the classes).

A new option is one field of ``CodecOptions`` (``option(...)``: default, flag, help and the
constructor parameter it sets); its flag, TOML key, help, the check that the codec takes it and
its way into the codec follow from that field.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable

from .gather_rule import MEANS, check_mean

if TYPE_CHECKING:
    from .codec import Codec

#: ``--codec auto``: chosen by the job from the measured link (not a codec; never built)
AUTO = "auto"


@dataclass(frozen=True)
class CodecTraits:
    """What the options need to know of a codec without importing it."""

    params: frozenset[str]  # its constructor keywords besides zstd, zstd_level
    error_feedback: bool = False  # biased: only run through ErrorFeedback
    summary: str = ""


_BLOCK4 = frozenset({"block_size", "search", "stochastic", "seed"})
#: every codec by name, in wire-id order (the registry of ``compress.codec_table`` once imported)
CODECS: dict[str, CodecTraits] = {
    "fp32": CodecTraits(frozenset()),
    "bf16": CodecTraits(frozenset({"stochastic", "seed"})),
    "fp16": CodecTraits(frozenset()),
    "int8": CodecTraits(frozenset({"block_size", "stochastic", "seed"})),
    "int4": CodecTraits(_BLOCK4, summary="4-bit"),
    "fp4-e2m1": CodecTraits(_BLOCK4, summary="4-bit"),
    "fp4-e3m0": CodecTraits(_BLOCK4, summary="4-bit"),
    "sign1": CodecTraits(frozenset({"block_size"}), error_feedback=True),
    "topk": CodecTraits(frozenset({"chunk", "k", "density", "value_bits", "indices", "mean", "clip_median"}),
                        error_feedback=True),
    "lloyd4": CodecTraits(_BLOCK4, summary="4-bit"),
    "int2": CodecTraits(frozenset({"block_size"}), error_feedback=True),
}


def codec_names(*, error_feedback: bool | None = None) -> list[str]:
    """The codecs' names (those with or without error feedback when asked), in wire-id order."""
    return [n for n, t in CODECS.items() if error_feedback is None or t.error_feedback == error_feedback]


def traits(name: str) -> CodecTraits:
    """A codec's traits; ValueError naming the known codecs for an unknown name."""
    if name == AUTO:
        raise ValueError("auto is not a codec: the worker chooses one from the measured link (auto_choice.apply_choice)")
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(CODECS)}")
    return CODECS[name]


@dataclass(frozen=True)
class Knob:
    """How an option reaches a codec: ``param(codec)`` is the constructor keyword it sets (None: no
    codec takes it under that name), ``convert(value)`` its value there; ``unset`` is the option's
    value that leaves the codec at its own default."""

    param: Callable[[str], str | None]
    unset: Any
    convert: Callable[[Any], Any] = lambda v: v
    #: whether ``--final-codec`` takes it too (else the final codec is built at its default)
    final: bool = False
    #: the codecs that take it, in words, for the message to a codec that does not ("": their names)
    takers: str = ""


#: what ``--codec auto`` does with an option: the study's setting sets it (``diloco.job.auto_choice.Setting``
#: has a field of its name), it must be left at its default, or the user's value is kept
AUTO_SETS, AUTO_REFUSES, AUTO_KEEPS = "set", "default", "kept"


def option(default: Any, flag: str, help: str, knob: Knob | None = None, *, auto: str = AUTO_REFUSES,
           check: Callable[[Any], str | None] | None = None, choices: tuple[str, ...] | None = None):
    """A codec option: its default, flag, help text, the constructor parameter it sets (``knob``),
    what ``--codec auto`` does with it (``auto``), its own check (``check(value)``: the problem
    in one sentence, or None) and its values when they are names (``choices``)."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices, "knob": knob,
                                            "auto": auto, "check": check})


def _named(name: str) -> Callable[[str], str | None]:
    return lambda codec: name if name in CODECS[codec].params else None


def _codec_help() -> str:
    ef = codec_names(error_feedback=True)
    return (f"wire codec for pseudo-gradients ({', '.join(codec_names(error_feedback=False))}; "
            f"{', '.join(ef[:-1])} and {ef[-1]} with error feedback: each group's own frames are all-gathered; "
            f"{AUTO}: codec, density, outer rule, H and mode chosen from the measured link and the convergence study, "
            "diloco/job/auto_choice.py)")


@dataclass
class CodecOptions:
    """The codec options of a job (``[transport]`` keys, ``diloco run`` flags)."""

    codec: str = option("fp32", "--codec", _codec_help(), auto=AUTO_SETS)
    codec_block: int = option(
        0, "--codec-block", "values per scale block of a blockwise codec, int2 or sign1, values per chunk of topk "
        "(0 = the codec's default)",
        Knob(lambda c: "chunk" if "chunk" in CODECS[c].params else "block_size" if "block_size" in CODECS[c].params
             else None, unset=0, takers="the codecs with scale blocks or chunks"), auto=AUTO_SETS)
    topk_density: float = option(
        0.0, "--topk-density", "topk: fraction of each chunk's values sent, k = round(density * chunk) "
        "(0 = the codec's default, k = 64 of 4096)", Knob(_named("density"), unset=0.0), auto=AUTO_SETS)
    final_codec: str = option(
        "", "--final-codec", "codec of each fragment's last exchange (e.g. int8 after --codec int2 or sign1): the "
        "error-feedback residuals go out with it, so the final model keeps what the low-bit frames held back; at its "
        "own defaults (--codec-block, --topk-density and --codec-fast apply to --codec only; --zstd to both) "
        "('' = --codec to the end)", auto=AUTO_SETS)
    codec_fast: bool = option(
        False, "--codec-fast", "4-bit codecs: take each block's nearest scale instead of searching its neighbours "
        "(2-5x faster encode, for links faster than a core encodes; a little more error: bench/pages/codecs.md)",
        Knob(_named("search"), unset=False, convert=lambda fast: not fast, takers="the 4-bit codecs"),
        auto=AUTO_KEEPS)
    zstd: bool = option(False, "--zstd", "zstd entropy stage on every frame",
                        Knob(lambda c: "zstd", unset=None, final=True), auto=AUTO_SETS)
    zstd_level: int = option(1, "--zstd-level", "zstd level", Knob(lambda c: "zstd_level", unset=None, final=True),
                            auto=AUTO_KEEPS)
    topk_value_bits: int = option(
        2, "--topk-value-bits", "topk: bits of each value sent, its sign and its level among 2^(bits-1) between the "
        "chunk's smallest and largest kept magnitude (2 = SparseLoCo's; up to 8: finer values, more bytes)",
        Knob(_named("value_bits"), unset=2), check=lambda bits: None if 1 <= bits <= 8 else f"must be in [1, 8], got {bits}")
    topk_mean: str = option(
        MEANS[0], "--topk-mean", "topk: how the groups' decoded contributions are averaged: all = each index's sum "
        "over all G groups / G (SparseLoCo's paper notation); senders = each index's mean over the groups that "
        "sent it (the SparseLoCo authors' code); compress/gather_rule.py", Knob(_named("mean"), unset=MEANS[0]),
        auto=AUTO_SETS, check=check_mean, choices=MEANS)
    topk_clip_median: bool = option(
        False, "--topk-clip-median", "topk: before averaging, scale each group's decoded contribution down to the "
        "median of the groups' L2 norms where its norm is above it (the lower middle one for an even count; norms "
        "per exchanged chunk of --chunk-bytes), as the SparseLoCo authors' production code does",
        Knob(_named("clip_median"), unset=False), auto=AUTO_SETS)


def codec_options() -> list[Any]:
    """The fields of ``CodecOptions`` (each with its flag, help and knob in ``metadata``)."""
    return list(fields(CodecOptions))


@dataclass
class CodecSpec(CodecOptions):
    """A codec to build: ``CodecOptions`` checked (``problems``) and built (``build``)."""

    @classmethod
    def of(cls, options: CodecOptions) -> "CodecSpec":
        """The spec of any object holding the codec options (a ``TransportConfig``)."""
        return cls(**{f.name: getattr(options, f.name) for f in fields(CodecOptions)})

    def final(self) -> "CodecSpec | None":
        """The spec of ``--final-codec`` (its options at their defaults but those it shares), or None."""
        if not self.final_codec:
            return None
        kept = {f.name: getattr(self, f.name) for f in fields(CodecOptions) if f.metadata["knob"] and f.metadata["knob"].final}
        return replace(CodecSpec(), **kept, codec=self.final_codec)

    @property
    def plain(self) -> bool:
        """Every option at its default (plain fp32 unless ``codec`` says otherwise): nothing to check."""
        return all(getattr(self, f.name) == f.default for f in fields(CodecOptions) if f.name != "codec")

    @property
    def error_feedback(self) -> bool:
        """Whether the codec needs error feedback (False for ``auto``: not decided)."""
        return self.codec != AUTO and traits(self.codec).error_feedback

    def params(self) -> dict[str, Any]:
        """The constructor keywords of the codec (ValueError naming the option a codec does not take)."""
        traits(self.codec)  # an unknown name, or auto
        out: dict[str, Any] = {}
        for f in fields(CodecOptions):
            knob, value = f.metadata["knob"], getattr(self, f.name)
            if knob is None or (knob.unset is not None and value == knob.unset):
                continue
            param = knob.param(self.codec)
            if param is None:
                takers = [n for n in CODECS if knob.param(n)]
                where = f"{knob.takers} ({', '.join(takers)})" if knob.takers else f"--codec {' or '.join(takers)} only"
                raise ValueError(f"{f.metadata['flag']} applies to {where}, not {self.codec}")
            out[param] = knob.convert(value)
        return out

    def problems(self) -> list[str]:
        """What keeps this spec from building, one sentence each (empty: it builds). Builds the codec
        (imports torch) to check the values' ranges unless every option is at its default."""
        out = []
        for check in (_option_checks, _known_and_taken, _final_codec, _builds):
            try:
                check(self)
            except ValueError as e:
                out.append(str(e))
            if out:
                break
        return out

    def build(self) -> Codec:
        """The codec (ValueError if it cannot be made); imports ``compress``'s codecs (torch)."""
        from .registry import get_codec

        return get_codec(self.codec, **self.params())


def _option_checks(s: CodecSpec) -> None:
    for f in fields(CodecOptions):
        check = f.metadata["check"]
        problem = check(getattr(s, f.name)) if check else None
        if problem:
            raise ValueError(f"{f.metadata['flag']} {problem}")


def _known_and_taken(s: CodecSpec) -> None:
    if s.codec != AUTO:
        try:
            s.params()
        except ValueError as e:
            raise ValueError(f"--codec {s.codec}: {e}") from None


def _final_codec(s: CodecSpec) -> None:
    if s.final_codec:
        try:
            feedback = traits(s.final_codec).error_feedback
        except ValueError as e:
            raise ValueError(f"--final-codec {s.final_codec}: {e}") from None
        if feedback:
            raise ValueError(f"--final-codec {s.final_codec} keeps a residual itself: the last exchange would leave "
                             f"one behind; use one without error feedback ({', '.join(codec_names(error_feedback=False))})")


def _builds(s: CodecSpec) -> None:
    """The values in range (the codec's constructor checks them): plain fp32 needs no codec object."""
    for spec, flag in ((s, "--codec"), (s.final(), "--final-codec")):
        if spec is not None and spec.codec != AUTO and not (spec.codec == "fp32" and spec.plain):
            try:
                spec.build()
            except ValueError as e:
                raise ValueError(f"{flag} {spec.codec}: {e}") from None
