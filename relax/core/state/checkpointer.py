"""A run's checkpoints, as the training loops use them: save a step (staged and sealed, or written in the background
with ``--async-save``), wait for a background write, restore the newest intact checkpoint.

The files and their guarantees are `relax.core.state.checkpoint`'s; this class holds what a run adds: which roles
save (the actor, the critic), the model metadata written beside them, one save at a time in step order, and the
newest checkpoint this run saved (``last``). Functions of the checkpoint module are called through the module, so a
test that wraps one (tests/support/fault_injection) lands inside a real save.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax.backends.training import lora
from relax.config import RelaxConfig
from relax.core.roles import Roles
from relax.core.run_settings import lora_settings
from relax.core.state import checkpoint
from relax.distributed.process_group import barrier, rank
from relax.telemetry.phases import PhaseClock
from relax.telemetry.plots import plot_run
from relax.utils.errors import RunFault

logger = logging.getLogger("relax")

# A save redraws the run's curves (so that they survive a crash, not only a clean exit) at most this often: drawing
# them takes a quarter of a second on a CPU, which a run saving every step of a few seconds would pay at every step.
# The run's end draws them whatever the time.
PLOT_INTERVAL_S = 60.0


@dataclass
class Restored:
    """What `Checkpointer.restore` loaded: the step, its folder, and the trainer state saved with it."""

    step: int
    directory: Path
    trainer_state: dict[str, Any]


class Checkpointer:
    """The checkpoints of one run (module docstring). ``phases`` times each save as the ``checkpoint`` phase."""

    def __init__(self, cfg: RelaxConfig, roles: Roles, phases: PhaseClock) -> None:
        self.cfg, self.roles, self.phases = cfg, roles, phases
        self.root = Path(cfg.save_dir)
        self.last: Path | None = None  # the newest checkpoint this run saved
        self._background: threading.Thread | None = None  # --async-save's write of the last checkpoint
        self._background_error: BaseException | None = None
        self._background_step = 0
        self._plotted_at = -math.inf

    # ---- saving --------------------------------------------------------------------------------
    def save(self, step: int, trainer_state: Callable[[], dict]) -> None:
        """A checkpoint of ``step``, staged and sealed (`checkpoint.finish_save`): a kill or an error midway leaves
        the previous one the newest; an error says its cause first (a full disk: the file it was writing).
        ``trainer_state`` is called on rank 0 while the save starts: the RNG states and data cursor of this step."""
        with self.phases.phase("checkpoint", step, "the checkpoint to be written"):
            self._save(step, trainer_state)

    def _save(self, step: int, trainer_state: Callable[[], dict]) -> None:
        self.wait()  # one save at a time: sealing and rotation stay in step order
        root = self.root
        staging = checkpoint.begin_save(root, step) if rank() == 0 else checkpoint.staging_dir(root, step)
        barrier()  # every rank writes into the staging folder only once rank 0 has cleared it
        background = self.cfg.async_save
        try:
            include_optimizer = not self.cfg.no_save_optim
            writing = self.roles.actor.save(staging, include_optimizer=include_optimizer, asynchronous=background)
            if self.roles.critic is not None:
                writing += self.roles.critic.save(staging, include_optimizer=include_optimizer, asynchronous=background)
            if rank() == 0:
                checkpoint.save_trainer_state(staging, trainer_state())
                if not background:
                    self._seal(step)
        except BaseException as err:
            failure = self._failure(step, staging, err)
            if failure is err:
                raise
            raise failure from err
        if background:
            self._background = threading.Thread(target=self._seal_when_written, args=(step, staging, writing),
                                                name="relax-async-save")
            self._background_step = step
            self._background.start()
            return
        barrier()
        self._saved(step)

    def _seal(self, step: int) -> None:
        checkpoint.save_hf_metadata(self.root, self.roles.actor.backend.hf_config, self.roles.tokenizer,
                                    self.cfg.hf_checkpoint)
        if self.cfg.lora_rank:  # the checkpoint holds adapters only: export rebuilds them on the base model
            lora.write_metadata(self.root, lora_settings(self.cfg), self.cfg.hf_checkpoint)
        checkpoint.finish_save(self.root, step, self.cfg.max_checkpoints)

    def _saved(self, step: int, plot: bool = True) -> None:
        directory = checkpoint.iteration_dir(self.root, step)
        if plot:
            self._plot()
        self.last = directory
        logger.info("saved checkpoint %s", directory)

    def _plot(self) -> None:
        """The run's curves from its metrics so far (rank 0), unless drawn less than `PLOT_INTERVAL_S` ago."""
        if rank() != 0 or time.monotonic() - self._plotted_at < PLOT_INTERVAL_S:
            return
        plot_run(Path(self.cfg.output_dir))
        self._plotted_at = time.monotonic()

    def _failure(self, step: int, staging: Path, err: BaseException) -> BaseException:
        """What a failed save raises, its staging folder removed (the previous checkpoint stays the newest)."""
        if rank() == 0:
            checkpoint.abandon_save(self.root, step)
        if isinstance(err, RunFault) or not isinstance(err, checkpoint.IO_ERRORS):
            return err  # a role's process died mid-save: not a checkpoint problem, and a restart can recover
        return checkpoint.CheckpointError(
            f"saving the checkpoint of step {step} failed: {checkpoint.describe_write_error(err, staging)} "
            f"(the previous checkpoint, if any, is intact)")

    def _seal_when_written(self, step: int, staging: Path, writing: list) -> None:
        """--async-save's thread: wait for the files, then seal the checkpoint (rank 0: one process only)."""
        try:
            for future in writing:
                future.result()
            self._seal(step)
            self._saved(step, plot=False)  # the plots are drawn in the loop's thread, at the wait
        except BaseException as err:  # noqa: BLE001 - raised in the loop's thread by `wait`
            failure = self._failure(step, staging, err)
            if failure is not err:
                failure.__cause__ = err
            self._background_error = failure

    def wait(self, raise_error: bool = True) -> None:
        """Until the background write (``--async-save``) is sealed; its error is raised, or only logged when the
        run is ending on another error (``raise_error=False``: the written checkpoint is still sealed for a
        restart)."""
        thread, self._background = self._background, None
        if thread is None:
            return
        with self.phases.phase("checkpoint", self._background_step, "the background checkpoint write (--async-save)"):
            thread.join()
        error, self._background_error = self._background_error, None
        if error is None:
            self._plot()
        elif raise_error:
            raise error
        else:
            logger.error("the background checkpoint write of step %d failed: %s", self._background_step, error)

    # ---- restoring -----------------------------------------------------------------------------
    def restore(self) -> Restored:
        """Load the newest intact checkpoint under ``--load`` into the actor (and the critic); a damaged newer one
        is skipped with a warning naming the problem."""
        root = checkpoint.resolve_checkpoint_root(self.cfg.load)
        if self.cfg.lora_rank:  # the checkpoint holds adapters: they apply to the base model they were trained on
            try:
                lora.read_metadata(root, self.cfg.hf_checkpoint)
            except lora.BaseModelChangedError as error:
                raise checkpoint.CheckpointError(str(error)) from None
        selected = checkpoint.select_checkpoint(root, needs_optimizer=True)
        for problem in selected.skipped:
            logger.warning("skipping a damaged checkpoint (%s); resuming from the older %s", problem,
                           selected.directory)
        try:
            self.roles.actor.load(selected.directory)
            if self.roles.critic is not None:
                self.roles.critic.load(selected.directory)
        except checkpoint.IO_ERRORS as err:  # DCP and torch.load raise many kinds: name the checkpoint
            raise checkpoint.CheckpointError(
                f"{selected.directory}: cannot be loaded ({type(err).__name__}: {err})") from err
        return Restored(selected.step, selected.directory, checkpoint.load_trainer_state(selected.directory))
