"""The `Sample`: the unit of work that flows between every role.

A sample is one response to one prompt. Samples that answer the same prompt share a
``group_index`` (GRPO groups). Text, image, video and audio samples are the same type.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class SampleStatus(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # the engine stopped on EOS, a stop token or a stop string
    TRUNCATED = "truncated"  # the response hit the token limit
    ABORTED = "aborted"  # generation was interrupted (weight update, shutdown)
    FAILED = "failed"  # generation or the environment raised; see metadata["error"]


@dataclass
class Sample:
    """One prompt/response pair.

    ``tokens`` holds prompt ids followed by response ids. ``loss_mask``,
    ``rollout_log_probs`` and a per-token ``weight_version`` cover the response tokens only,
    so each has ``response_length`` entries. ``loss_mask`` is 1 for tokens the model produced
    and 0 for tokens that an environment inserted into the response. ``rollout_routed_experts``
    (``--use-rollout-routing-replay``) holds the experts every MoE layer of the engine chose for
    each token but the last, ``[len(tokens) - 1, L, k]`` or flattened (`relax.backends.models.routing_replay`).
    """

    index: int = 0
    group_index: int = 0
    prompt: str | list[dict[str, Any]] = ""
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    reward: float | dict[str, float] | None = None
    status: SampleStatus = SampleStatus.PENDING
    weight_version: int | list[int] | None = None
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    rollout_routed_experts: Any = None  # a torch int tensor (not JSON: left out of dumps)
    # Per-response-token tensors the streaming roles computed before training (``ref_log_probs``, ``advantages``;
    # relax.core.streaming.roles), by field name; not JSON: left out of dumps.
    stage_fields: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view (used for sample dumps); tensors in multimodal fields are dropped."""
        data = asdict(self)
        data["status"] = self.status.value
        data.pop("multimodal_train_inputs", None)
        data.pop("rollout_routed_experts", None)
        data.pop("stage_fields", None)
        return data
