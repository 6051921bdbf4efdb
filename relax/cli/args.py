"""Build `RelaxConfig` from a YAML file and command-line flags (flags win)."""

from __future__ import annotations

import argparse
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from relax.cli.upstream_flags import explain
from relax.config import SECTIONS, ConfigError, RelaxConfig, fields_by_section, flag

UPSTREAM_PREFIX = "upstream Relax's "


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err.msg}): {text!r}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expects a JSON object, got {text!r}")
    return value


def _add_field_argument(group: argparse._ArgumentGroup, name: str) -> None:
    info = RelaxConfig.model_fields[name]
    annotation = _unwrap_optional(info.annotation)
    origin = typing.get_origin(annotation)
    kwargs: dict[str, Any] = {"dest": name, "help": f"{info.description} (default: {info.default!r})"}
    if annotation is bool and name.startswith("no_"):
        kwargs["action"] = "store_true"  # --no-save-optim, not also --no-no-save-optim
    elif annotation is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif origin is typing.Literal:
        kwargs["choices"] = typing.get_args(annotation)
    elif origin is list:
        kwargs["nargs"] = "*"
        kwargs["type"] = typing.get_args(annotation)[0]
    elif origin is dict and name == "eval_prompt_data":
        kwargs["nargs"] = "+"
        kwargs["metavar"] = "NAME PATH"
    elif origin is dict:
        kwargs["type"] = _json_object
        kwargs["metavar"] = "JSON"
    elif annotation in (int, float, str):
        kwargs["type"] = annotation
    else:  # pragma: no cover - guards new field types
        raise TypeError(f"no command-line form for field {name!r} of type {annotation!r}")
    group.add_argument(flag(name), **kwargs)


def build_parser(prog: str = "relax train", description: str | None = None) -> argparse.ArgumentParser:
    """A parser whose flags are exactly the config fields; unset flags stay absent."""
    # No abbreviations: an upstream flag that is a prefix of a Relax flag would silently set it.
    parser = argparse.ArgumentParser(prog=prog, description=description, argument_default=argparse.SUPPRESS,
                                     allow_abbrev=False)
    parser.add_argument("--config", dest="config_file", help="YAML file of settings; flags override it.")
    for section, names in fields_by_section().items():
        group = parser.add_argument_group(f"{section} settings")
        for name in names:
            _add_field_argument(group, name)
    return parser


def read_yaml_settings(path: str | Path) -> dict[str, Any]:
    """Settings from a YAML file, keys normalised to field names; unknown keys are errors."""
    path = Path(path)
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as err:
        raise ConfigError(f"--config: file not found: {path}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"--config: {path} is not valid YAML: {err}") from err
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of settings, got {type(loaded).__name__}")
    settings = {str(key).replace("-", "_"): value for key, value in loaded.items()}
    known = set(RelaxConfig.model_fields)
    for key in settings:
        if key not in known:
            reason = explain("--" + key.replace("_", "-"))
            if reason is not None:
                raise ConfigError(f"--config: {path}: {UPSTREAM_PREFIX}setting {key!r}: {reason}")
            hint = difflib.get_close_matches(key, known, n=1)
            suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ConfigError(f"--config: {path}: unknown setting {key!r}{suggestion}")
    return settings


def config_from_settings(settings: dict[str, Any]) -> RelaxConfig:
    """Validate settings; every problem is reported with the flag it concerns."""
    try:
        return RelaxConfig(**settings)
    except ValidationError as err:
        lines = []
        for problem in err.errors():
            field_name = problem["loc"][0] if problem["loc"] else None
            message = problem["msg"].removeprefix("Value error, ")
            lines.append(f"{flag(str(field_name))}: {message}" if field_name else message)
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


def parse_flags(parser: argparse.ArgumentParser, argv: list[str] | None) -> dict[str, Any]:
    """The flags given; an unknown one is refused naming the closest known flags (argparse names none)."""
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        known = [option for action in parser._actions for option in action.option_strings]
        problems = []
        for token in unknown:
            name = token.split("=", 1)[0]
            if not name.startswith("-"):
                if not (problems and problems[-1].startswith(UPSTREAM_PREFIX)):  # an upstream flag's value
                    problems.append(f"unexpected argument {token!r}")
                continue
            reason = explain(name)
            if reason is not None:
                problems.append(f"{UPSTREAM_PREFIX}{name}: {reason}")
                continue
            hints = difflib.get_close_matches(name, known, n=2, cutoff=0.6)
            problems.append(f"unknown flag {name}" + (f"; did you mean {' or '.join(hints)}?" if hints else ""))
        raise ConfigError("\n  ".join(["flags Relax does not take:", *problems])
                          + f"\n({parser.prog} --help lists every setting)")
    return vars(namespace)


# What `relax eval --load RUN` takes from the run's saved config: everything but where and how the run ran.
NOT_INHERITED_SECTIONS = ("run", "placement", "engines", "mode")


def saved_run_settings(load: str | Path) -> dict[str, Any]:
    """The settings of the run whose checkpoints ``load`` names (its config.yaml), minus the sections of
    `NOT_INHERITED_SECTIONS`; {} when there is no saved config."""
    path = Path(load)
    for candidate in (path / "config.yaml", path.parent / "config.yaml"):
        if candidate.is_file():
            inherited = {name for section, names in fields_by_section().items()
                         if section not in NOT_INHERITED_SECTIONS for name in names}
            return {k: v for k, v in read_yaml_settings(candidate).items() if k in inherited}
    return {}


def parse_config(argv: list[str] | None = None, prog: str = "relax train", inherit_from_load: bool = False
                 ) -> RelaxConfig:
    """Defaults, then (with ``inherit_from_load``) the saved settings of the ``--load`` run, then the YAML file of
    --config, then flags."""
    parser = build_parser(prog)
    namespace = parse_flags(parser, argv)
    config_file = namespace.pop("config_file", None)
    settings = read_yaml_settings(config_file) if config_file else {}
    settings.update(namespace)
    if inherit_from_load and settings.get("load"):
        settings = {**saved_run_settings(settings["load"]), **settings}
    return config_from_settings(settings)


def render_config_reference() -> str:
    """docs/config.md: every setting, its flag, default and description."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `relax/config.py` by `relax config-docs`; do not edit by hand.",
        "Every setting can be given in the YAML file of `--config` (as `name: value`) or as a flag;",
        "flags override the file.",
        "",
    ]
    for section in SECTIONS:
        lines += [f"## {section.capitalize()}", "", "| flag | default | description |", "|---|---|---|"]
        for name in fields_by_section()[section]:
            info = RelaxConfig.model_fields[name]
            description = (info.description or "").replace("|", "\\|")
            lines.append(f"| `{flag(name)}` | `{info.default!r}` | {description} |")
        lines.append("")
    return "\n".join(lines)
