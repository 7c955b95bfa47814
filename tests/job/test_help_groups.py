"""``diloco run --help`` (and ``diloco worker --help``): the everyday options first, then one group
per config section; every flag parses as before."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from diloco.cli import build_parser
from diloco.job import config_parse
from diloco.job.auto_choice import AUTO_H
from diloco.job.config import EVERYDAY, Config, SyncConfig, iter_fields, opt


def _command(name: str) -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices[name]


def _groups(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Group title -> its flags, in the order --help shows them (groups with none are not shown)."""
    return {g.title: [a.option_strings[0] for a in g._group_actions] for g in parser._action_groups
            if g._group_actions}


def _flag(key: str) -> str:
    section, name = key.split(".")
    return next(f.metadata["flag"] for s, f in iter_fields(Config()) if (s, f.name) == (section, name))


EVERYDAY_FLAGS = [_flag(key) for key in EVERYDAY]
SECTIONS = [f.name for f in dataclasses.fields(Config)]


def test_run_help_shows_the_everyday_options_first_then_a_group_per_section():
    groups = _groups(_command("run"))
    assert list(groups) == ["options", "everyday options", "diloco run", *(f"[{s}] options" for s in SECTIONS)]
    assert groups["everyday options"] == [*EVERYDAY_FLAGS, "--config", "--run-dir", "--resume"]
    assert {"--groups", "--ranks-per-group", "--steps", "--h", "--codec", "--mode", "--link", "--spares"} <= set(
        groups["everyday options"])
    text = _command("run").format_help()
    body = text[text.index("\neveryday options:"):]  # the usage line above lists every flag
    first_section = body.index("\n[model] options:")
    for flag in groups["everyday options"]:
        assert body.index(f"\n  {flag} ") < first_section, flag
    assert body.index("\n  --codec ") < body.index("\n  --spares ") < body.index("\n  --n-layer ")


def test_every_option_is_in_its_own_sections_group_once():
    groups = _groups(_command("run"))
    for section in SECTIONS:
        expected = [f.metadata["flag"] for s, f in iter_fields(Config())
                    if s == section and f"{s}.{f.name}" not in EVERYDAY]
        assert groups[f"[{section}] options"] == expected
    flags = [flag for flags in groups.values() for flag in flags]
    assert len(flags) == len(set(flags))
    assert set(flags) >= {f.metadata["flag"] for _, f in iter_fields(Config())}


def test_each_section_group_says_what_the_section_holds():
    sections = [g for g in _command("run")._action_groups if g.title.startswith("[")]
    assert len(sections) == len(SECTIONS)
    for group in sections:
        section = re.fullmatch(r"\[(\w+)\] options", group.title).group(1)
        kind = type(getattr(Config(), section))
        assert not group.description.startswith(kind.__name__ + "("), f"{kind.__name__} needs a docstring"
        assert group.description.startswith(kind.__doc__)
        for key in EVERYDAY:
            if key.startswith(section + "."):
                assert _flag(key) in group.description  # "(--h, --mode: among the everyday options)"


def test_worker_help_puts_its_own_required_flags_first():
    groups = _groups(_command("worker"))
    assert groups["everyday options"][:2] == ["--coordinator", "--group-id"]
    assert groups["everyday options"][2:] == [*EVERYDAY_FLAGS, "--config", "--resume"]
    assert groups["diloco worker"] == ["--json"]


def _sample(section: str, f: dataclasses.Field) -> tuple[str, object]:
    """A command-line value for option ``section.f`` other than its default, and what it parses to."""
    default = getattr(getattr(Config(), section), f.name)
    if f.metadata.get("choices"):
        choice = next(c for c in f.metadata["choices"] if c != default)
        return choice, choice
    if f.type == "bool":
        return ("yes", True) if not default else ("off", False)
    if f.type == "str":
        return "x,y", "x,y"
    if f.type == "int | str":  # --h: a number or 'auto'
        return ("auto", "auto") if default != "auto" else ("7", 7)
    step = {"int": 3, "float": 0.5}[f.type]
    return str(default + step), default + step


@pytest.mark.parametrize("command", ["run", "worker"])
def test_every_flag_parses_into_its_section_and_field(command):
    parser = build_parser()
    required = ["--coordinator", "h:1", "--group-id", "0"] if command == "worker" else []
    for section, f in iter_fields(Config()):
        text, value = _sample(section, f)
        args = parser.parse_args([command, *required, f.metadata["flag"], text])
        assert getattr(args, f"{section}.{f.name}") == value, f.metadata["flag"]
        assert config_parse.explicit_settings(args) == {(section, f.name): value}
    assert getattr(parser.parse_args(["run", "--h", "auto"]), "sync.h") == AUTO_H
    args = parser.parse_args(["run", "--groups", "3", "--codec", "int8", "--run-dir", "/tmp/x", "--json", "/tmp/j"])
    cfg = config_parse.from_args(args)
    assert (cfg.topology.groups, cfg.transport.codec, args.run_dir, args.json) == (3, "int8", "/tmp/x", "/tmp/j")


def test_a_new_option_lands_in_its_sections_group(monkeypatch):
    @dataclasses.dataclass
    class NewSync(SyncConfig):
        """When the groups exchange (with a new option)."""

        brand_new: int = opt(5, "an option added to [sync]", flag="--brand-new")

    @dataclasses.dataclass
    class NewConfig(Config):
        sync: NewSync = dataclasses.field(default_factory=NewSync)

    monkeypatch.setattr(config_parse, "Config", NewConfig)
    parser = argparse.ArgumentParser()
    config_parse.add_arguments(parser)
    groups = _groups(parser)
    assert groups["[sync] options"][-1] == "--brand-new"
    assert "--brand-new" not in groups["everyday options"]


def test_an_everyday_name_that_is_no_option_is_refused(monkeypatch):
    monkeypatch.setattr(config_parse, "EVERYDAY", (*EVERYDAY, "sync.no_such_option"))
    with pytest.raises(ValueError, match="sync.no_such_option"):
        config_parse.add_arguments(argparse.ArgumentParser())
