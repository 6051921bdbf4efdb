"""The device-memory plan of a run whose trainer and embedded engine share one GPU, made before the first step.

Without a plan the two take memory independently: the engine sizes its KV pool from what is free when it starts
(`--mem-fraction-static`), and the trainer's activations grow with the largest micro-batch the token budget allows
(`--max-tokens-per-gpu`), so a budget that does not fit beside the pool fails only when a step's longest responses
first fill a micro-batch, minutes or hours in (measured on the H200: the second or fourth step of a run with
2,048-token responses, 118.8 GiB allocated beside the resident pool).

The plan measures instead of guessing: the trainer runs one forward and backward at two token counts
(`FSDPTrainBackend.measure_step_memory`), with the gradients already made, as a step's second and later
micro-batches run; the line through the two peaks gives the step's fixed cost (the gradients, the weights' low-
precision copies) and its cost per token (activations, the log-prob head's chunks). AdamW's moments, allocated at
the first optimizer step, are added. Then, for the largest micro-batch the flags allow:

- it fits beside everything resident now (the engine's weights, KV pool and CUDA graphs, the trainers' weights):
  nothing changes;
- it fits only without the KV pool, and the mode has a training phase apart from rollout (the synchronous loop):
  the pool is released while training and comes back for the next rollout (`PhaseMemory`), said in the log;
- it does not fit: the run stops before any work, naming the budget that would fit and the flags that change it.

A share of the device (`HEADROOM`) is kept for what the allocator cannot use (fragmentation between block sizes,
the CUDA context, collective buffers). The allocator's expandable segments (``PYTORCH_CUDA_ALLOC_CONF``, set by
`relax train` unless given) keep fragmentation itself low.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from relax.config import ConfigError, flag

logger = logging.getLogger("relax")

GIB = 1024 ** 3
HEADROOM = 0.06


@dataclass(frozen=True)
class StepFootprint:
    """What a training step allocates beyond what the trainer holds between steps: ``fixed_bytes`` whatever the
    micro-batch (the gradients), and ``bytes_per_token`` of the largest micro-batch (its activations)."""

    fixed_bytes: int
    bytes_per_token: float

    def peak_bytes(self, tokens: int) -> int:
        return int(self.fixed_bytes + self.bytes_per_token * tokens)

    @classmethod
    def from_two_points(cls, tokens: tuple[int, int], peaks: tuple[int, int]) -> StepFootprint:
        """The line through two measured (tokens, peak bytes) points; a slope below zero (noise) counts as none."""
        slope = max(0.0, (peaks[1] - peaks[0]) / (tokens[1] - tokens[0]))
        return cls(fixed_bytes=max(0, int(peaks[0] - slope * tokens[0])), bytes_per_token=slope)


@dataclass(frozen=True)
class DeviceMemory:
    """The device as the plan sees it: its size, what is allocated now (every role), what the first optimizer step
    will add (AdamW's moments), and how much of ``held_bytes`` is the engine's KV pool (0: none that can go)."""

    total_bytes: int
    held_bytes: int
    pending_bytes: int
    kv_pool_bytes: int


@dataclass(frozen=True)
class MemoryPlan:
    release_kv_while_training: bool
    peak_bytes: int  # at the training peak, with the plan applied
    usable_bytes: int
    engine_offloaded: bool = False  # --offload-rollout frees the engine's weights and pool while training anyway

    def describe(self) -> str:
        if self.engine_offloaded:
            action = "the engine's weights and KV pool leave the device while training (--offload-rollout)"
        elif self.release_kv_while_training:
            action = "the engine's KV pool is released while training"
        else:
            action = "the trainer and the engine stay resident"
        return (f"memory plan: {action}; training peak {self.peak_bytes / GIB:.1f} GiB of "
                f"{self.usable_bytes / GIB:.1f} GiB usable")


def plan_memory(device: DeviceMemory, step: StepFootprint, tokens: int, can_release_kv: bool,
                kept_logits: bool = False) -> MemoryPlan:
    """The plan for a largest micro-batch of ``tokens`` tokens (module doc); raises `ConfigError` when none fits.
    ``kept_logits``: the trainer keeps its LM-head chunks' logits for the backward (a remedy is to stop)."""
    usable = int(device.total_bytes * (1 - HEADROOM))
    resident = device.held_bytes + device.pending_bytes
    peak = resident + step.peak_bytes(tokens)
    if peak <= usable:
        return MemoryPlan(False, peak, usable)
    if can_release_kv and device.kv_pool_bytes and peak - device.kv_pool_bytes <= usable:
        return MemoryPlan(True, peak - device.kv_pool_bytes, usable)
    room = usable - resident - step.fixed_bytes + (device.kv_pool_bytes if can_release_kv else 0)
    fitting = max(0, math.floor(room / step.bytes_per_token)) if step.bytes_per_token else 0
    remedies = [f"{flag('max_tokens_per_gpu')} {fitting} or less (with {flag('use_dynamic_batch_size')})"
                if fitting else f"a smaller model or more devices ({flag('tensor_model_parallel_size')})"]
    if device.kv_pool_bytes and not can_release_kv:  # (a pool released while training costs the step nothing)
        remedies.append(f"a smaller KV pool ({flag('mem_fraction_static')} or {flag('max_total_tokens')}; it holds "
                        f"{device.kv_pool_bytes / GIB:.1f} GiB)")
        remedies.append(f"the synchronous mode, which can release the pool while training (drop "
                        f"{flag('colocate_async')} / {flag('fully_async')})")
    remedies.append(f"{flag('gradient_checkpointing')} (activations recomputed in the backward)")
    if kept_logits:
        remedies.append(f"{flag('log_probs_keep_logits')} off or auto (the LM head's logits recomputed in the "
                        "backward)")
    raise ConfigError(
        f"the training step does not fit on the device: micro-batches of up to {tokens} tokens need "
        f"{step.peak_bytes(tokens) / GIB:.1f} GiB ({step.bytes_per_token / 1024:.0f} KiB per token + "
        f"{step.fixed_bytes / GIB:.1f} GiB) beside {resident / GIB:.1f} GiB resident (engine and trainers, optimizer "
        f"state included), and {usable / GIB:.1f} GiB of the {device.total_bytes / GIB:.1f} GiB device are usable. "
        f"Use {'; or '.join(remedies)}")


def largest_micro_batch_tokens(cfg) -> int:
    """The most tokens one training micro-batch can hold under the flags: the token budget (a longer sample runs
    alone), or a fixed number of the longest samples."""
    # (a multi-turn episode's context bound holds its prompt; an unbounded prompt counts as none: the plan is then
    # a lower bound, said by the caller)
    longest = cfg.rollout_max_context_len or (cfg.rollout_max_prompt_len or 0) + cfg.rollout_max_response_len
    if cfg.use_dynamic_batch_size and cfg.max_tokens_per_gpu:
        return max(cfg.max_tokens_per_gpu, longest)
    return cfg.micro_batch_size * longest
