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


# Names users of other trainers type for a Relax setting; difflib alone finds nothing close for them.
SYNONYMS = {"learning_rate": "lr", "model": "hf_checkpoint", "model_path": "hf_checkpoint",
            "model_name_or_path": "hf_checkpoint", "output": "output_dir", "batch_size": "global_batch_size",
            "max_steps": "num_rollout", "num_train_epochs": "num_epoch", "epochs": "num_epoch",
            "num_generations": "n_samples_per_prompt", "max_completion_length": "rollout_max_response_len",
            "max_prompt_length": "rollout_max_prompt_len", "beta": "kl_loss_coef", "kl_coef": "kl_loss_coef",
            "temperature": "rollout_temperature", "resume": "load", "resume_from_checkpoint": "load"}
# The command-line value that clears an optional setting (one a --config file set).
NONE_VALUES = ("none", "null")


def close_matches(name: str, known: list[str]) -> list[str]:
    """The known names ``name`` (a flag ``--x-y`` or a key ``x_y``) most likely means: the same with dashes and
    underscores swapped, a known synonym (``--learning-rate`` is ``--lr``), else the closest spellings."""
    dashes = name.startswith("-")
    bare = name.lstrip("-").replace("-", "_")
    spell = (lambda field: flag(field)) if dashes else (lambda field: field)
    fields = {entry.lstrip("-").replace("-", "_"): entry for entry in known}
    if bare in fields and fields[bare] != name:
        return [fields[bare]]
    if bare in SYNONYMS and SYNONYMS[bare] in fields:
        return [spell(SYNONYMS[bare])]
    return [fields[m] for m in difflib.get_close_matches(bare, list(fields), n=2, cutoff=0.6)]


class CommandLineParser(argparse.ArgumentParser):
    """argparse for every `relax` command: no abbreviations (an upstream flag that is a prefix of a Relax flag would
    silently set it), and a bad command line is one short error, naming the closest known flag for an unknown one,
    not the whole usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments: "):
            known = [option for action in self._actions for option in action.option_strings]
            problems = []
            for token in message.removeprefix("unrecognized arguments: ").split():
                hints = close_matches(token.split("=", 1)[0], known) if token.startswith("-") else []
                problems.append(f"unknown {'flag' if token.startswith('-') else 'argument'} {token}"
                                + (f"; did you mean {' or '.join(hints)}?" if hints else ""))
            message = "; ".join(problems)
        raise ConfigError(f"{message}\n({self.prog} --help lists every option)")


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


def _or_none(parse: Any) -> Any:
    """``parse``, with ``none`` / ``null`` meaning "unset" (clears a setting of the --config file)."""
    def parse_or_none(text: str) -> Any:
        return None if text.lower() in NONE_VALUES else parse(text)

    parse_or_none.__name__ = getattr(parse, "__name__", "value")
    return parse_or_none


def _add_field_argument(group: argparse._ArgumentGroup, name: str) -> None:
    info = RelaxConfig.model_fields[name]
    optional = _unwrap_optional(info.annotation) is not info.annotation
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
    if optional and "type" in kwargs and kwargs.get("nargs") is None:
        kwargs["type"] = _or_none(kwargs["type"])
        kwargs["help"] += " (none: unset)"
    elif optional and "choices" in kwargs:
        kwargs["type"] = _or_none(str)
        kwargs["choices"] = (*kwargs["choices"], None)
        kwargs["metavar"] = "{" + ",".join(map(str, kwargs["choices"][:-1])) + ",none}"
    group.add_argument(flag(name), **kwargs)


def build_parser(prog: str = "relax train", description: str | None = None) -> argparse.ArgumentParser:
    """A parser whose flags are exactly the config fields; unset flags stay absent."""
    # No abbreviations: an upstream flag that is a prefix of a Relax flag would silently set it.
    parser = CommandLineParser(prog=prog, description=description, argument_default=argparse.SUPPRESS)
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
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError as err:
        raise ConfigError(f"--config: file not found: {path}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"--config: {path} is not UTF-8 text (byte {err.start}: {err.reason})") from err
    except OSError as err:  # a folder, a file without read permission
        raise ConfigError(f"--config: {path}: cannot be read ({err.strerror or err})") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"--config: {path} is not valid YAML: {err}") from err
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of settings, got {type(loaded).__name__}")
    settings = {str(key).replace("-", "_"): value for key, value in loaded.items()}
    known = list(RelaxConfig.model_fields)
    problems = []  # every unknown key at once, not one per try
    for key in settings:
        if key in known:
            continue
        reason = explain("--" + key.replace("_", "-"))
        if reason is not None:
            problems.append(f"{UPSTREAM_PREFIX}setting {key!r}: {reason}")
            continue
        hints = close_matches(key, known)
        problems.append(f"unknown setting {key!r}" + (f"; did you mean {' or '.join(map(repr, hints))}?" if hints
                                                      else ""))
    if problems:
        raise ConfigError(f"--config: {path}: " + ("\n  ".join(["", *problems]) if len(problems) > 1
                                                    else problems[0]))
    return settings


def config_from_settings(settings: dict[str, Any], from_file: bool = False) -> RelaxConfig:
    """Validate settings; every problem is reported with the flag it concerns (and, when a --config file gave
    settings, how to clear one of them from the command line)."""
    try:
        return RelaxConfig(**settings)
    except ValidationError as err:
        lines = []
        for problem in err.errors():
            field_name = problem["loc"][0] if problem["loc"] else None
            message = problem["msg"].removeprefix("Value error, ")
            lines.append(f"{flag(str(field_name))}: {message}" if field_name else message)
        if from_file:
            lines.append("(a setting of the --config file is cleared on the command line with --<flag> none)")
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
            hints = close_matches(name, known)
            problems.append(f"unknown flag {name}" + (f"; did you mean {' or '.join(hints)}?" if hints else ""))
        raise ConfigError("\n  ".join(["flags Relax does not take:", *problems])
                          + f"\n({parser.prog} --help lists every setting)")
    return vars(namespace)


# What `relax eval --load RUN` takes from the run's saved config: everything but where and how the run ran.
NOT_INHERITED_SECTIONS = ("run", "placement", "engines", "mode", "parallel")  # checkpoints reshard across layouts


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
    return config_from_settings(settings, from_file=bool(config_file))


def render_config_reference() -> str:
    """docs/config.md: every setting, its flag, default and description."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `relax/config/` by `relax config-docs`; do not edit by hand.",
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
