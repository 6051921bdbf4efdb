"""Device memory handed between the phases of a colocated step (``--offload-train``, ``--offload-rollout``).

A colocated step rolls out, then trains, on one device. With ``--offload-rollout`` the engine frees its KV pool,
CUDA graphs and weights once generation ends; with ``--offload-train`` the trainers (actor, reference, critic, a
trainer-side teacher) move their weights and optimizer state to host memory before generation starts. The order
around the weight sync keeps the peak low: the engine's weights come back (as unloaded storage), the actor sends
its weights into them, the trainers leave, and only then does the KV pool return.

On CUDA each phase's peak allocation is recorded (``perf/gpu_peak_gib_rollout``, ``perf/gpu_peak_gib_train``; the async
modes, whose phases overlap, record ``perf/gpu_peak_gib_step``), and
what stays allocated between steps (``perf/gpu_allocated_gib``) shows whether anything grows from step to step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from relax.backends.inference.base import InferenceEngine
from relax.backends.training.fsdp import FSDPTrainBackend
from relax.config import ConfigError, flag
from relax.core.loops.memory_plan import (
    DeviceMemory,
    MemoryPlan,
    StepFootprint,
    largest_micro_batch_tokens,
    plan_memory,
)

logger = logging.getLogger("relax")

GIB = 1024 ** 3


class PhaseMemory:
    def __init__(self, trainers: list[FSDPTrainBackend], engine: InferenceEngine | None, device: torch.device,
                 offload_train: bool, offload_rollout: bool, release_kv_while_training: bool = False,
                 plan: MemoryPlan | None = None):
        self.trainers = trainers
        self.plan = plan  # the run's memory plan (CUDA with the embedded engine), for the record
        self.engine = engine
        self.device = device
        self.offload_train = offload_train and bool(trainers)
        self.offload_rollout = offload_rollout and engine is not None
        # The memory plan's choice (`relax.core.loops.memory_plan`): the KV pool alone leaves while training.
        self.release_kv_while_training = release_kv_while_training and engine is not None and not self.offload_rollout
        self.engine_weights_released = False  # their storage is freed
        self._engine_kv_released = False
        self._metrics: dict[str, float] = {}
        if self.moves_memory:
            logger.info("offloading between phases: %s", ", ".join(
                name for name, on in (("trainers while rolling out", self.offload_train),
                                      ("engine while training", self.offload_rollout)) if on))

    @property
    def moves_memory(self) -> bool:
        return self.offload_train or self.offload_rollout or self.release_kv_while_training

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def _start_peak(self) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _record_peak(self, phase: str) -> None:
        if self._cuda:
            peak = torch.cuda.max_memory_allocated(self.device) / GIB
            key = f"perf/gpu_peak_gib_{phase}"
            self._metrics[key] = max(self._metrics.get(key, 0.0), peak)

    def _timed(self, key: str, started: float) -> None:
        self._metrics[key] = self._metrics.get(key, 0.0) + time.perf_counter() - started

    async def enter_rollout(self) -> None:
        """Before generation: the trainers leave the device, the engine's KV pool comes back."""
        started = time.perf_counter()
        if self.offload_train:
            for trainer in self.trainers:
                trainer.offload()
        if (self.offload_rollout or self.release_kv_while_training) and self._engine_kv_released:
            await self.engine.resume_memory_occupation(["kv_cache"])
            self._engine_kv_released = False
        self._timed("perf/offload_s", started)
        self._start_peak()

    async def enter_training(self) -> None:
        """After generation: the engine frees its memory (the trainers come back as they are used)."""
        self._record_peak("rollout")
        started = time.perf_counter()
        if self.offload_rollout:
            await self.engine.release_memory_occupation(["weights", "kv_cache"])
            self.engine_weights_released = self._engine_kv_released = True
        elif self.release_kv_while_training:
            await self.engine.release_memory_occupation(["kv_cache"])
            self._engine_kv_released = True
        if self.offload_train:  # back at once rather than on first use, so that the time is counted here
            for trainer in self.trainers:
                trainer.reload()
        self._timed("perf/offload_s", started)
        self._start_peak()

    async def before_weight_sync(self) -> bool:
        """The engine's weight storage comes back for the actor to send into (its KV pool stays away); True when
        the engine's weights must be sent whether or not the policy changed."""
        self._record_peak("train")
        if not self.engine_weights_released:
            return False
        await self.engine.resume_memory_occupation(["weights"])
        self.engine_weights_released = False
        return True

    def overlapped_step_metrics(self) -> dict[str, float]:
        """`step_metrics` of the async modes, whose rollout and training overlap: one peak per step
        (``perf/gpu_peak_gib_step``) instead of one per phase."""
        self._record_peak("step")
        self._start_peak()
        return self.step_metrics()

    def step_metrics(self) -> dict[str, float]:
        """This step's figures (once): peaks per phase, time spent moving memory, and what is allocated now."""
        metrics, self._metrics = self._metrics, {}
        if self._cuda:
            metrics["perf/gpu_allocated_gib"] = torch.cuda.memory_allocated(self.device) / GIB
            metrics["perf/gpu_reserved_gib"] = torch.cuda.memory_reserved(self.device) / GIB
        if not self.moves_memory:
            metrics.pop("perf/offload_s", None)
        return metrics


def trainer_backends(roles) -> list[FSDPTrainBackend]:
    """The in-process trainers of a run's roles, each once."""
    backends = [roles.actor.backend]
    if roles.reference is not None:
        backends.append(roles.reference.backend)
    if roles.critic is not None:
        backends.append(roles.critic.backend)
    teacher = getattr(roles.distillation, "teacher", None)
    if teacher is not None and hasattr(teacher, "backend"):
        backends.append(teacher.backend)
    return [backend for backend in backends if isinstance(backend, FSDPTrainBackend)]


def build_phase_memory(cfg, roles) -> PhaseMemory:
    """From the resolved flags and, on CUDA with the embedded engine, the memory plan; inert (only the per-phase
    figures) in the modes that do not offload."""
    offload_train, offload_rollout = cfg.resolved_offload_train, cfg.resolved_offload_rollout
    asynchronous = cfg.fully_async or cfg.hybrid
    if cfg.trains_on_dataset or asynchronous or cfg.placement != "in_process":
        offload_train = offload_rollout = False
    plan = plan_for_run(cfg, roles, can_release_kv=not asynchronous, engine_released=offload_rollout)
    release_kv = plan is not None and plan.release_kv_while_training
    engine = roles.rollout.engine if offload_rollout or release_kv else None
    trainers = trainer_backends(roles) if offload_train else []
    return PhaseMemory(trainers, engine, roles.device, offload_train, offload_rollout, release_kv, plan)


def plan_for_run(cfg, roles, can_release_kv: bool, engine_released: bool) -> MemoryPlan | None:
    """The memory plan of a run whose trainer and embedded engine share this process's GPU (None elsewhere: on
    CPU, with engines or roles in other processes, for SFT). ``engine_released``: --offload-rollout frees the
    engine's weights and pool while training already. With `--log-probs-keep-logits auto` the trainers keep their
    LM-head logits for the backward where the plan has room for them: the step is measured with them first, and
    without them only when that plan does not fit."""
    engine = getattr(roles.rollout, "engine", None) if roles.rollout is not None else None
    if roles.device.type != "cuda" or cfg.placement != "in_process" or cfg.trains_on_dataset \
            or not hasattr(engine, "kv_pool_bytes"):
        return None
    trainers = trainer_backends(roles)
    trainable = [trainer for trainer in trainers if trainer.trainable]
    tokens = largest_micro_batch_tokens(cfg)
    auto = cfg.log_probs_keep_logits == "auto" and cfg.log_probs_chunk_size > 0 and bool(trainable)
    kept = cfg.log_probs_keep_logits == "on" or auto
    for trainer in trainable if auto else ():
        trainer.keep_logits(True)
    try:
        plan, fits = _measured_plan(cfg, roles, engine, trainers, tokens, can_release_kv, engine_released, kept), True
    except ConfigError:
        if not auto:
            raise
        plan, fits = None, False
    if auto:
        # every rank decides alike: a rank that measured again alone would run its probe's collectives alone
        fits = _on_every_rank(fits, roles.device)
        if not fits or plan is None:  # no room for them, or no plan at all: the logits are recomputed
            for trainer in trainable:
                trainer.keep_logits(False)
            kept = False
        if not fits:
            plan = _measured_plan(cfg, roles, engine, trainers, tokens, can_release_kv, engine_released, False)
    if auto and plan is not None:
        logger.info("%s auto: the LM head's logits are %s", flag("log_probs_keep_logits"),
                    "kept for the backward (the plan has room for them)" if kept else
                    "recomputed in the backward (no room for them beside the rest)")
    return plan


def _on_every_rank(value: bool, device: torch.device) -> bool:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    flag_tensor = torch.tensor([int(value)], device=device)
    dist.all_reduce(flag_tensor, op=dist.ReduceOp.MIN)
    return bool(flag_tensor.item())


def _measured_plan(cfg, roles, engine, trainers, tokens: int, can_release_kv: bool, engine_released: bool,
                   kept_logits: bool) -> MemoryPlan | None:
    """`plan_memory` over the trainers' step as the probe measures it now; None where it cannot be measured."""
    probe = (max(64, tokens // 8), max(128, tokens // 4))
    try:
        peaks = [trainer.measure_step_memory(probe) for trainer in trainers if trainer.trainable]
    except torch.cuda.OutOfMemoryError:
        raise ConfigError(f"the training step does not fit on the device: even a micro-batch of {probe[1]} tokens "
                          f"(a quarter of the largest the flags allow, {tokens}) ran out of memory beside the engine; "
                          f"lower {flag('max_tokens_per_gpu')} or the KV pool ({flag('mem_fraction_static')}), or "
                          f"use {flag('gradient_checkpointing')}") from None
    except Exception as error:  # noqa: BLE001 - the plan guards the run; a probe it cannot make must not stop it
        # The record gets text, not the exception: its traceback holds this frame, and with it the engine and its
        # KV pool, for as long as a handler keeps the record (pytest's log capture kept 31 GiB after a GPU test).
        where = traceback.extract_tb(error.__traceback__)[-1]
        logger.warning("memory plan skipped: the trainer's probe failed (%s: %s, at %s:%d); the run goes on "
                       "unplanned", type(error).__name__, str(error), where.filename, where.lineno)
        for trainer in trainers:
            if trainer.model is not None:
                trainer.model.zero_grad(set_to_none=True)
        return None
    finally:
        torch.cuda.empty_cache()  # the probe's blocks, cached for this thread's stream, go back to the device
    peaks = [p for p in peaks if p is not None]
    if not peaks:
        return None
    step = max((StepFootprint.from_two_points(probe, tuple(p)) for p in peaks), key=lambda s: s.peak_bytes(tokens))
    releasable = engine.kv_pool_bytes + (engine_weight_bytes(engine) if engine_released else 0)
    device = DeviceMemory(total_bytes=torch.cuda.get_device_properties(roles.device).total_memory,
                          held_bytes=torch.cuda.memory_allocated(roles.device),
                          pending_bytes=sum(optimizer_state_bytes(t) for t in trainers), kv_pool_bytes=releasable)
    plan = plan_memory(device, step, tokens, can_release_kv=can_release_kv or engine_released,
                       kept_logits=kept_logits)
    if engine_released:  # --offload-rollout frees it all anyway
        plan = dataclasses.replace(plan, release_kv_while_training=False, engine_offloaded=True)
    logger.info("%s (micro-batches up to %d tokens: %.0f KiB per token%s%s)", plan.describe(), tokens,
                step.bytes_per_token / 1024, ", the LM head's logits kept" if kept_logits else "",
                "" if cfg.rollout_max_prompt_len or cfg.rollout_max_context_len else
                "; prompts counted as empty: set --rollout-max-prompt-len for a bound on them")
    return plan


def engine_weight_bytes(engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.model.parameters())


def optimizer_state_bytes(trainer: FSDPTrainBackend) -> int:
    """What AdamW's two float32 moments will take at the first optimizer step, if not allocated yet."""
    if trainer.optimizer is None or trainer.optimizer.state:
        return 0
    local = (p.to_local() if isinstance(p, DTensor) else p for p in trainer.model.parameters() if p.requires_grad)
    return sum(2 * 4 * t.numel() for t in local)
