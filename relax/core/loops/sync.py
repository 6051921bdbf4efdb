"""The colocated (sync) training loop.

Each step: the rollout role samples and scores responses; the reference (with a KL loss) and,
when the batch is split into several optimizer steps, the actor compute log-probs; advantages
are computed; the actor trains; the new weights are pushed to the engine as the next version.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

from tqdm import tqdm

from relax.config import ConfigError, RelaxConfig, flag
from relax.core.loops.graceful_stop import GracefulStop
from relax.core.loops.phase_memory import build_phase_memory
from relax.core.placement import Placement
from relax.core.state.checkpointer import Checkpointer
from relax.core.state.run_dir import loads_a_run_without_checkpoints
from relax.core.streaming.chunks import per_sample_fields
from relax.core.streaming.roles import ADVANTAGES, streamed_field
from relax.data.sample import Sample
from relax.distributed.process_group import rank, world_size
from relax.telemetry.phases import PhaseClock
from relax.telemetry.tracking import Tracker

logger = logging.getLogger("relax")


class SyncController:
    """The colocated loop of the module doc. ``placement`` gives the roles and how weights reach the engines
    (`relax.core.placement`): the loop is the same whatever process each role lives in."""

    def __init__(self, cfg: RelaxConfig, placement: Placement, tracker: Tracker):
        if cfg.async_save and world_size() > 1:
            raise ConfigError(f"{flag('async_save')} seals a checkpoint from one process; under torchrun every "
                              "rank writes its shard and the seal would need a collective outside the loop's order")
        self.cfg = cfg
        self.roles = placement.roles
        self.weights = placement.weights
        self.tracker = tracker
        self.graceful_stop = GracefulStop()  # the entrypoint routes SIGTERM/SIGINT to it
        self.memory = build_phase_memory(cfg, self.roles)  # --offload-train / --offload-rollout
        self.phases = PhaseClock(cfg.timeline_dump_dir, cfg.stall_warning_s)  # the entrypoint sets its notifier
        self.checkpointer = Checkpointer(cfg, self.roles, self.phases)
        self.logged_step = 0  # the last step whose row is in the trackers
        self.training_began = time.perf_counter()  # reset when the steps begin: perf/elapsed_s counts from there

    # ---- one step ------------------------------------------------------------------------
    async def train_step(self, rollout_id: int) -> dict[str, float]:
        started, step = time.perf_counter(), rollout_id + 1
        with self._memory_phase(step, "the trainers to leave the device"):
            await self.memory.enter_rollout()
        with self.phases.phase("rollout", step, "generation and rewards"):
            samples, metrics = await self.roles.rollout.generate(rollout_id)
        metrics["perf/rollout_s"] = time.perf_counter() - started
        with self._memory_phase(step, "the engine to release its memory"):
            await self.memory.enter_training()
        metrics.update(await self.train_on(rollout_id, samples))
        with self._memory_phase(step, "the engine's KV cache to come back"):
            await self.memory.enter_rollout()  # the evaluation after this step, and the next step, generate
        metrics.update(self.memory.step_metrics())
        metrics["perf/step_s"] = time.perf_counter() - started
        metrics["perf/tokens_per_s"] = sum(len(s.tokens) for s in samples) / metrics["perf/step_s"]
        return metrics

    def _memory_phase(self, step: int, detail: str):
        """A timeline phase for moving memory, when anything moves (--offload-train / --offload-rollout)."""
        return self.phases.phase("memory", step, detail) if self.memory.moves_memory else contextlib.nullcontext()

    async def train_on(self, rollout_id: int, samples: list[Sample]) -> dict[str, float]:
        """Everything after generation: log-probs, advantages, the critic's and the actor's
        updates, and the weight push to the engine as version ``rollout_id + 1``."""
        with self.phases.phase("train", rollout_id + 1, "log-probs, advantages and the updates"):
            metrics = await self._train(rollout_id, samples)
        metrics.update(await self._after_training(rollout_id, samples))
        return metrics

    async def _after_training(self, rollout_id: int, samples: list[Sample]) -> dict[str, float]:
        """The weight push to the engines as version ``rollout_id + 1``, and the sample dump."""
        metrics: dict[str, float] = {}
        engine_needs_weights = await self.memory.before_weight_sync()
        with self.phases.phase("weight_sync", rollout_id + 1, "the weights to reach the engines"):
            if self._policy_trains(rollout_id):
                metrics.update(await self.sync_weights(version=rollout_id + 1))
            elif engine_needs_weights:  # --offload-rollout dropped them: the unchanged ones go back as the same
                metrics.update(await self.sync_weights(version=self.roles.rollout.engine.weight_version))
        if self.cfg.dump_samples:
            self.tracker.dump_samples(rollout_id + 1, samples, self.cfg.dump_samples)
        return metrics

    def _policy_trains(self, rollout_id: int) -> bool:
        """During --num-critic-only-steps the critic fits the initial policy's values; policy and engine wait."""
        return rollout_id >= self.cfg.num_critic_only_steps

    async def _train(self, rollout_id: int, samples: list[Sample]) -> dict[str, float]:
        roles = self.roles
        prepare_started = time.perf_counter()
        metrics: dict[str, float] = {}
        fields = await per_sample_fields(samples, self.cfg.use_tis, roles.reference)
        gather_ids = None
        if roles.distillation is not None:
            teacher_fields, gather_ids = await roles.distillation.teacher_fields(samples)
            fields.update(teacher_fields)
        policy = None  # the sampling policy's log-probs, computed once if anything needs them
        if roles.actor.needs_old_log_probs(len(samples)):
            policy = await roles.actor.compute_log_probs(samples, gather_ids)
            fields["old_log_probs"] = policy.log_probs
        distill_advantages = roles.distillation is not None and roles.distillation.advantage_mode
        if policy is None and (roles.advantages.needs_kl or distill_advantages):
            policy = await roles.actor.compute_log_probs(samples, gather_ids)
        values = await roles.critic.compute_values(samples) if roles.critic is not None else None
        streamed_advantages = streamed_field(samples, ADVANTAGES)
        if streamed_advantages is not None:  # group-local advantages, streamed (relax.core.streaming.roles)
            result = roles.advantages.result_of(samples, streamed_advantages)
        else:
            result = await roles.advantages.compute(
                samples, policy.log_probs if policy is not None else None, fields.get("ref_log_probs"), values
            )
        metrics.update(result.metrics)
        fields["advantages"] = result.advantages
        if distill_advantages:
            fields["advantages"], distill_metrics = roles.distillation.shape_advantages(
                samples, result.advantages, policy.log_probs, policy.gathered, fields
            )
            metrics.update(distill_metrics)

        train_started = time.perf_counter()
        # what the step spent before the updates: log-probs, values, advantages (less when roles streamed them)
        metrics["perf/prepare_s"] = train_started - prepare_started
        if roles.critic is not None:
            metrics.update(await roles.critic.train(samples, result.returns, values))
        if self._policy_trains(rollout_id):
            metrics.update(await roles.actor.train(samples, fields, gather_ids))
        metrics["perf/train_s"] = time.perf_counter() - train_started
        return metrics

    async def sync_weights(self, version: int) -> dict[str, float]:
        """The engines serve ``version`` of the actor's weights (the placement's `WeightSync`)."""
        return await self.weights.push(version)

    async def evaluate(self, step: int) -> dict[str, float]:
        started = time.perf_counter()
        with self.phases.phase("eval", step, "the held-out generations and rewards"):
            metrics, _ = await self.roles.rollout.evaluate(step)
        metrics["perf/eval_s"] = time.perf_counter() - started
        metrics["eval/weight_version"] = float(step)  # the engine holds the weights the step published
        return metrics

    # ---- the loop ------------------------------------------------------------------------
    progress_label = "relax train"

    async def run(self) -> dict[str, float]:
        """Train from the start or the loaded checkpoint to the last step; returns the last metrics."""
        self.phases.start()  # the stall watchdog
        try:
            last = await self._run()
        except BaseException:
            self.checkpointer.wait(raise_error=False)  # a written checkpoint is still sealed for a restart
            raise
        else:
            self.checkpointer.wait()  # the last checkpoint is sealed before the run reports it
            return last
        finally:
            self.phases.stop()

    async def _run(self) -> dict[str, float]:
        start, last = await self._begin()
        return await self._train_steps(start, last)

    async def _begin(self) -> tuple[int, dict[str, float]]:
        """Resume if asked, and evaluate before the first step; returns the first step and its metrics."""
        start = await self.resume() if self.cfg.load else 0
        if start == 0 and self.cfg.rollout_external:
            # External servers hold whatever they last loaded (another run's weights, say): every engine serves the
            # trainer's initial weights before the first evaluation or rollout
            await self.sync_weights(version=0)
            logger.info("sent the initial weights (version 0) to the rollout engines")
        last: dict[str, float] = {}
        if start == 0 and self.roles.rollout.eval_sets and not self.cfg.skip_eval_before_train:
            last = await self.evaluate(step=0)
            self.tracker.log(0, last)
            logger.info("step 0: eval accuracy %.3f", last.get("eval/accuracy", float("nan")))
        return start, last

    async def _train_steps(self, start: int, last: dict[str, float]) -> dict[str, float]:
        cfg, total = self.cfg, self.roles.total_steps
        progress = tqdm(range(start, total), initial=start, total=total, desc=self.progress_label, unit="step",
                        disable=rank() != 0, dynamic_ncols=True)
        self.training_began = time.perf_counter()
        for rollout_id in progress:
            step = rollout_id + 1
            metrics = await self.train_step(rollout_id)
            if self._due(step, cfg.eval_interval) and self.roles.rollout.eval_sets:
                metrics.update(await self._evaluate_between_steps(step))
            # The wall-clock of this process's training so far (evaluations and saves included; their own times are
            # perf/eval_s and the checkpointer's): what a curve against time is drawn on, in every mode alike.
            metrics["perf/elapsed_s"] = time.perf_counter() - self.training_began
            self.tracker.log(step, metrics)
            self.logged_step = step
            progress.set_postfix(self._postfix(metrics), refresh=False)
            logger.info("step %d: %s", step, self._postfix(metrics))
            if self._due(step, cfg.save_interval):
                self.save(step)
            last = metrics
            if step < total and self.graceful_stop.agreed():
                if not self._due(step, cfg.save_interval):
                    self.save(step)
                self.graceful_stop.stopped_after_step = step
                logger.warning("stopped after step %d of %d; resume with --load %s", step, total, cfg.save_dir)
                break
        return last

    async def _evaluate_between_steps(self, step: int) -> dict[str, float]:
        return await self.evaluate(step)

    def _due(self, step: int, interval: int | None) -> bool:
        """Every ``interval`` steps, and always at the last step (a run ends with a checkpoint and, with eval
        sets, an evaluation, whether or not an interval was asked for)."""
        return step == self.roles.total_steps or (interval is not None and step % interval == 0)

    @staticmethod
    def _postfix(metrics: dict[str, float]) -> dict[str, str]:
        shown = {"reward": "rollout/reward_mean", "acc": "rollout/accuracy", "eval_acc": "eval/accuracy",
                 "loss": "train/loss"}
        return {short: f"{metrics[key]:.3f}" for short, key in shown.items() if key in metrics}

    # ---- checkpoints ---------------------------------------------------------------------
    def save(self, step: int) -> None:
        self.checkpointer.save(step, lambda: self.trainer_state(step))

    @property
    def last_checkpoint(self) -> Path | None:
        return self.checkpointer.last

    def trainer_state(self, step: int) -> dict:
        """What a checkpoint records besides the weights: the step and the data cursor."""
        return {"step": step, "weight_version": step, **self.roles.rollout.data_source.state_dict()}

    async def resume(self) -> int:
        """Continue ``--load``: the newest intact checkpoint's weights, data cursor and metrics; the first step."""
        if loads_a_run_without_checkpoints(self.cfg):
            logger.warning("%s holds no checkpoint yet (the run ended before its first save): training it again "
                           "from its first step", self.cfg.load)
            self.tracker.truncate_after(-1)  # what it recorded, step 0's evaluation included, is re-done
            return 0
        restored = self.checkpointer.restore()
        step = restored.step
        # Dynamic sampling may take more prompts than rollout_batch_size per step: continue at the saved cursor
        # (with the positions taken and not trained, under --over-sampling-batch-size).
        cursor = {"consumed_prompts": restored.trainer_state.get("consumed_prompts", step * self.cfg.rollout_batch_size)}
        pending = restored.trainer_state.get("pending_prompts")
        if pending and self.cfg.carries_groups_over:
            cursor["pending_prompts"] = pending
        elif pending:  # only the carry-over feed takes positions out of order
            logger.warning("%d prompts were launched and not trained when %s was saved (--over-sampling-batch-size); "
                           "this run does not carry groups over, so it continues at the cursor without them",
                           len(pending), restored.directory)
        self.roles.rollout.data_source.load_state_dict(cursor)
        await self.sync_weights(version=step)
        self.tracker.truncate_after(step)
        logger.info("resumed from %s at step %d", restored.directory, step)
        return step


class SFTController(SyncController):
    """Supervised fine-tuning (``--loss-type sft``) on the same trainer, checkpoints and eval.

    Each step trains on the next ``--rollout-batch-size`` rows of the data stream; the inference
    engine, used only for evaluation, gets the new weights just before it evaluates.
    """

    def __init__(self, cfg: RelaxConfig, placement: Placement, tracker: Tracker):
        super().__init__(cfg, placement, tracker)
        self._engine_version = 0
        self._trained_version = 0

    async def train_step(self, rollout_id: int) -> dict[str, float]:
        started = time.perf_counter()
        _, samples = self.roles.rollout.data_source.take(self.cfg.rollout_batch_size)
        metrics = await self.roles.actor.train(samples, {})
        self._trained_version = rollout_id + 1
        metrics["perf/train_s"] = metrics["perf/step_s"] = time.perf_counter() - started
        metrics["perf/tokens_per_s"] = sum(len(s.tokens) for s in samples) / metrics["perf/step_s"]
        return metrics

    async def evaluate(self, step: int) -> dict[str, float]:
        if self._engine_version != self._trained_version:
            await self.sync_weights(version=self._trained_version)
        return await super().evaluate(step)

    async def sync_weights(self, version: int) -> dict[str, float]:
        self._engine_version = self._trained_version = version
        return await super().sync_weights(version)
