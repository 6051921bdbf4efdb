"""The typed run configuration.

One pydantic model, `RelaxConfig`, holds every setting; it is composed of one settings class per group of
sections (a module each: model, data, training, rollout, engines, algorithm, placement, operations) and the
rules that span sections (`rules`). Flag names and YAML keys are the flat field names (`--rollout-batch-size` is
`rollout_batch_size`), following upstream Relax wherever the concept is the same. YAML files (`--config`) and
command-line flags both fill it; `relax train --help` and `docs/config.md` are generated from the field
descriptions, so the reference cannot drift from the code.

This package sits beside the layers (like `relax.data`): every layer reads the config, so it may not live in the
entrypoint layer that fills it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ConfigDict, model_validator

from relax.algorithms.aggregation import LossAggregation
from relax.config.algorithm import AlgorithmSettings
from relax.config.base import SECTIONS, ConfigError, KLType, ToolCallParserName, flag, setting
from relax.config.data import DataSettings
from relax.config.engines import EngineSettings
from relax.config.model import ModelSettings
from relax.config.operations import OperationsSettings
from relax.config.placement import PlacementSettings
from relax.config.rollout import RolloutSettings
from relax.config.rules import CrossSectionRules
from relax.config.training import TrainingSettings

__all__ = ["SECTIONS", "ConfigError", "KLType", "RelaxConfig", "ToolCallParserName", "fields_by_section", "flag",
           "setting"]


# pydantic takes the fields of the last base first: the sections are listed backwards, so that config.yaml lists
# them from the model to the placement.
class RelaxConfig(CrossSectionRules, OperationsSettings, PlacementSettings, AlgorithmSettings, EngineSettings,
                  RolloutSettings, TrainingSettings, DataSettings, ModelSettings):
    """Every setting of a run (the sections' classes), checked by their own rules and then by the cross-section
    rules."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _paths_are_not_blank(cls, settings: Any) -> Any:
        """A file or folder setting given an empty or blank string (an unset shell variable, a stray quote) meant the
        working directory or a folder named by spaces: refused, naming the flag, before the rules that read it."""
        if not isinstance(settings, dict):
            return settings
        for name, value in settings.items():
            info = cls.model_fields.get(name)
            if info is None or not info.json_schema_extra.get("path"):
                continue
            values = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
            if any(isinstance(item, str) and not item.strip() for item in values):
                unset = f" (or `{flag(name)} none`: unset)" if info.default is None else ""
                raise ValueError(f"{flag(name)}: an empty path; give a file or folder{unset}")
        return settings

    @property
    def _embedded_rollout(self) -> bool:
        """The embedded engine shares the trainer's device and process: what offloading between phases needs."""
        return self.placement == "in_process" and not self.rollout_external and self.rollout_api_port is None

    @property
    def builds_an_engine(self) -> bool:
        """Whether the run builds an engine of its own from the engine settings (--engine-core, the KV pool's):
        the embedded rollout, the `relax serve` processes of --rollout-engine-protocol relax, an engine teacher."""
        return (not self.rollout_external or self.rollout_engine_protocol == "relax"
                or (self.use_opd and self.opd_type == "engine"))

    @property
    def resolved_offload_train(self) -> bool:
        if self.offload_train is not None:
            return self.offload_train
        return self.offload or (self.colocate and self.placement == "in_process")

    @property
    def resolved_offload_rollout(self) -> bool:
        if self.offload_rollout is not None:
            return self.offload_rollout
        return self.offload or (self.colocate and self._embedded_rollout)

    # Settings as given ---------------------------------------------------------------------
    def changed(self, name: str) -> bool:
        """Whether setting ``name`` was given a value other than its default. A rule that a setting needs some
        feature asks this, not whether it was named: a saved config spells out every default, and re-running it
        must not count the defaults of switched-off features as set."""
        return name in self.model_fields_set and getattr(self, name) != type(self).model_fields[name].default

    @classmethod
    def secret_fields(cls) -> tuple[str, ...]:
        return tuple(name for name, info in cls.model_fields.items() if info.json_schema_extra.get("secret"))

    def shareable_settings(self) -> tuple[dict[str, Any], list[str]]:
        """Every setting with the secret ones emptied (None), and the names of the secrets that were set: what
        config.yaml, the console and the trackers get. Only the fields marked secret are hidden, so the dump
        keeps every other setting and re-runs as it is."""
        settings = self.model_dump()
        set_secrets = [name for name in self.secret_fields() if settings[name] is not None]
        for name in set_secrets:
            settings[name] = None
        return settings, set_secrets

    # Derived values ------------------------------------------------------------------------
    @property
    def trains_on_dataset(self) -> bool:
        """SFT, DPO and reward-model training train on the dataset's responses: no rollout phase (the engine only
        evaluates; a reward model's run has no engine)."""
        return self.loss_type in ("sft", "dpo", "rm")

    @property
    def trains_on_pairs(self) -> bool:
        """DPO and reward-model training take preference pairs (--chosen-key, --rejected-key)."""
        return self.loss_type in ("dpo", "rm")

    @property
    def samples_per_step(self) -> int:
        """Samples trained on per step: every response of the step's prompts, one per SFT row, two per pair."""
        if self.loss_type == "sft":
            return self.rollout_batch_size
        if self.trains_on_pairs:
            return 2 * self.rollout_batch_size
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def train_batch_size(self) -> int:
        """Samples per optimizer step."""
        return self.global_batch_size or self.samples_per_step

    @property
    def loss_aggregation(self) -> LossAggregation:
        """--loss-agg-mode, or what --calculate-per-token-loss implies when it is unset."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return "token-mean" if self.calculate_per_token_loss else "seq-mean-token-mean"

    @property
    def carries_groups_over(self) -> bool:
        """Whether groups still decoding at the end of a step go on into the next (--over-sampling-batch-size)."""
        return (self.over_sampling_batch_size or 0) > self.rollout_batch_size

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps taken on each rollout batch."""
        return self.samples_per_step // self.train_batch_size

    @property
    def resolved_weight_sync_transport(self) -> str:
        """--weight-sync-transport, or its default: disk for external servers, broadcast for Ray processes."""
        if self.weight_sync_transport is not None:
            return self.weight_sync_transport
        return "disk" if self.rollout_external else "broadcast"

    @property
    def save_dir(self) -> Path:
        return Path(self.save) if self.save else Path(self.output_dir) / "checkpoints"

    def total_rollout_steps(self, num_prompts: int) -> int:
        """Rollout steps of the run: --num-rollout, --num-epoch over `num_prompts`, or the smaller of both."""
        steps_per_epoch = max(num_prompts // self.rollout_batch_size, 1)
        candidates = [n for n in (self.num_rollout, self.num_epoch and self.num_epoch * steps_per_epoch) if n]
        if not candidates:
            raise ConfigError(f"set {flag('num_rollout')} or {flag('num_epoch')}")
        return min(candidates)


def fields_by_section() -> dict[str, list[str]]:
    """Field names grouped by the section shown in --help and docs/config.md."""
    grouped: dict[str, list[str]] = {section: [] for section in SECTIONS}
    for name, info in RelaxConfig.model_fields.items():
        grouped[info.json_schema_extra["section"]].append(name)  # type: ignore[index]
    return grouped
