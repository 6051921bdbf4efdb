"""What every settings module of `relax.config` shares: the error, the flag spelling, the sections of --help and
`setting` (a field with its help text and section)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

KLType = Literal["k1", "k2", "k3", "low_var_kl"]
# How tool calls are read from the model's text (`relax.rollout.agentic.tool_parser` has a parser for each name).
ToolCallParserName = Literal["hermes", "qwen", "qwen25", "qwen3"]


class ConfigError(ValueError):
    """A setting is invalid; the message names the flag and the rule it broke."""


def flag(field_name: str) -> str:
    """The command-line spelling of a config field: ``rollout_batch_size`` → ``--rollout-batch-size``."""
    return "--" + field_name.replace("_", "-")


# Sections group the fields in --help and docs/config.md; the order here is the order shown.
SECTIONS = ("model", "data", "multimodal", "batch", "mode", "rollout", "engines", "algorithm", "critic", "distillation", "optimizer", "parallel", "lora", "reward",
            "eval",
            "run", "placement")
CRITIC_FIELDS = ("critic_lr", "num_critic_only_steps", "value_clip", "lambd")
OPD_FIELDS = ("opd_type", "teacher_hf_checkpoint", "opd_kl_type", "opd_kl_coef", "opd_loss_coef",
              "opd_log_prob_top_k", "opd_norm_mode")
OPD_TYPE_ALIASES = {"sglang": "engine", "megatron": "trainer"}  # upstream's names for the same placements


def setting(default: Any, help: str, section: str, *, secret: bool = False, path: bool = False, **kwargs: Any) -> Any:
    """A setting. ``secret`` marks a value that never leaves the process: it is logged as set or unset, and the saved
    config leaves it out (`RelaxConfig.shareable_settings`). ``path`` marks a file or folder (each value of a list
    or mapping one): a blank one is refused (`RelaxConfig`), where it would have meant the working directory."""
    return Field(default, description=help, json_schema_extra={"section": section, "secret": secret, "path": path},
                 **kwargs)
