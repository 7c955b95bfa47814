"""Reading a ``Config``: TOML or JSON files (sections as tables), then command-line flags.

``add_arguments`` gives every option of ``diloco.job.config`` its flag (help text and default
from the field's metadata), the everyday ones first and the rest in a help group per section;
``from_args`` builds the validated ``Config`` a command line asks for: the ``--config`` file
first, then the flags.
"""

from __future__ import annotations

import argparse
import inspect
import json
from dataclasses import Field, fields
from pathlib import Path
from typing import Any

import tomllib

from diloco.job.auto_choice import AUTO, AUTO_H
from diloco.job.config import EVERYDAY, Config, ConfigError, iter_fields


def _coerce(value: Any, kind: Any, where: str) -> Any:
    kind = {"int": int, "float": float, "str": str, "bool": bool}.get(kind, kind)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def from_dict(data: dict[str, Any], base: Config | None = None) -> Config:
    """Build a Config from nested ``{section: {field: value}}``; unknown keys are errors."""
    cfg = base if base is not None else Config()
    if not isinstance(data, dict):
        raise ConfigError(f"a configuration is a table of sections, got {type(data).__name__}")
    known = {f.name for f in fields(cfg)}
    for section, values in data.items():
        if section not in known:
            raise ConfigError(f"unknown config section [{section}]; known: {', '.join(sorted(known))}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table of settings")
        obj = getattr(cfg, section)
        names = {f.name: f for f in fields(obj)}
        for key, value in values.items():
            if key not in names:
                raise ConfigError(f"unknown setting {section}.{key}; known: {', '.join(sorted(names))}")
            if (section, key) == ("sync", "h"):
                setattr(obj, key, _h_value(value))
                continue
            setattr(obj, key, _coerce(value, names[key].type, f"{section}.{key}"))
    return cfg


def _h_value(value: Any) -> int | str:
    """``sync.h`` as a file gives it: inner steps per sync, or ``"auto"`` (a checkpoint written before
    ``--h auto`` was stored as ``"auto"`` says ``"auto"`` too: ``Config.to_dict`` wrote it so)."""
    if value == AUTO:
        return AUTO_H
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"sync.h: must be >= 1 or \"{AUTO}\", got {value!r}")
    return value


def _read_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {p} is a folder; give a .toml or .json file")
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    if p.suffix.lower() in (".yaml", ".yml"):
        raise ConfigError(f"config file {p}: YAML is not read; config files are TOML (.toml) or JSON (.json), "
                          "with the same [section] tables")
    try:
        text = p.read_text()
        data = json.loads(text) if p.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        kind = "JSON" if p.suffix.lower() == ".json" else "TOML (a file not named .json is read as TOML)"
        raise ConfigError(f"cannot parse config file {p} as {kind}: {e}") from e
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: the top level must be an object of sections ({{\"sync\": {{\"h\": 30}}}}), "
                          f"got {type(data).__name__}")
    return data


def load_file(path: str | Path) -> Config:
    """Load a Config from a ``.toml`` or ``.json`` file (sections as tables/objects)."""
    return from_dict(_read_file(path))


def parse_bool(text: str) -> bool:
    """``true/false``, ``yes/no``, ``on/off``, ``1/0`` (any case) as a bool."""
    value = text.strip().lower()
    if value in ("true", "yes", "on", "1"):
        return True
    if value in ("false", "no", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_h(text: str) -> int | str:
    """``--h``: inner steps per sync, or ``auto`` (stored as ``AUTO_H``, the string ``"auto"``)."""
    if text.strip().lower() == AUTO:
        return AUTO_H
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--h must be >= 1 (inner steps per sync) or auto, got {text!r}") from None
    if value < 0:  # 0 is refused by Config.validate
        raise argparse.ArgumentTypeError(f"--h must be >= 1 (inner steps per sync) or auto, got {text!r}")
    return value


EVERYDAY_TITLE = "everyday options"
EVERYDAY_DESCRIPTION = ("what most runs set; every other option is in its section's group below ([section]: its "
                        "table in a --config file)")


def add_arguments(parser: argparse.ArgumentParser, everyday: argparse._ArgumentGroup | None = None) -> None:
    """Add ``--config`` and one flag per option (defaults shown in --help), grouped: the everyday
    options (``config.EVERYDAY``) and ``--config`` go into ``everyday`` (a group the caller opened
    for its own everyday flags; None: a group of their own), then every section of the config gets
    a group of its own, titled as its table in a ``--config`` file and described by its docstring,
    in the config's order. A new field of a section lands in that section's group by itself."""
    defaults = Config()
    by_key = {f"{section}.{f.name}": (section, f) for section, f in iter_fields(defaults)}
    unknown = [key for key in EVERYDAY if key not in by_key]
    if unknown:
        raise ValueError(f"config.EVERYDAY names no option: {unknown}")
    if everyday is None:
        everyday = parser.add_argument_group(EVERYDAY_TITLE, EVERYDAY_DESCRIPTION)
    for key in EVERYDAY:
        _add_option(everyday, defaults, *by_key[key])
    everyday.add_argument("--config", metavar="FILE", default=None,
                          help="TOML or JSON file with [section] tables; flags override it")
    for section in fields(defaults):
        kind = type(getattr(defaults, section.name))
        above = [by_key[key][1].metadata["flag"] for key in EVERYDAY if by_key[key][0] == section.name]
        description = inspect.getdoc(kind) + (f" ({', '.join(above)}: among the everyday options)" if above else "")
        group = parser.add_argument_group(f"[{section.name}] options", description)
        for f in fields(kind):
            if f"{section.name}.{f.name}" not in EVERYDAY:
                _add_option(group, defaults, section.name, f)


def _add_option(group: argparse._ActionsContainer, defaults: Config, section: str, f: Field) -> None:
    """The flag of option ``section.f``: its type, choices, metavar and help with key and default."""
    default = getattr(getattr(defaults, section), f.name)
    kind = parse_h if (section, f.name) == ("sync", "h") else \
        {"int": int, "float": float, "str": str, "bool": parse_bool}[f.type]
    shown = repr(default) if isinstance(default, str) else default
    group.add_argument(
        f.metadata["flag"], dest=f"{section}.{f.name}", type=kind, default=None,
        choices=f.metadata.get("choices"),
        metavar=None if f.metadata.get("choices") else ("BOOL" if kind is parse_bool else "H" if kind is parse_h else kind.__name__.upper()),
        help=f"{f.metadata['help']} [{section}.{f.name}, default: {shown}]",
    )


def explicit_settings(args: argparse.Namespace) -> dict[tuple[str, str], Any]:
    """The settings a command line names itself: ``(section, field) -> value`` for every key of
    its ``--config`` file and every flag given (later wins), without the defaults."""
    out: dict[tuple[str, str], Any] = {}
    if getattr(args, "config", None):
        raw = _read_file(args.config)
        parsed = from_dict(raw)
        for section, values in raw.items():
            for key in values:
                out[(section, key)] = getattr(getattr(parsed, section), key)
    for section, f in iter_fields(Config()):
        value = getattr(args, f"{section}.{f.name}", None)
        if value is not None:
            out[(section, f.name)] = value
    return out


def from_args(args: argparse.Namespace) -> Config:
    """The Config a parsed command line asks for: file first, then flags; validated."""
    cfg = load_file(args.config) if getattr(args, "config", None) else Config()
    for section, f in iter_fields(cfg):
        value = getattr(args, f"{section}.{f.name}", None)
        if value is not None:
            setattr(getattr(cfg, section), f.name, value)
    return cfg.validate()
