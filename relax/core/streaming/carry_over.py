"""Partial rollout across steps: ``--over-sampling-batch-size N`` above ``--rollout-batch-size B``, in
``--fully-async`` / ``--colocate-async`` with ``--partial-rollout`` (in-process placement).

Without it, each step's rollout is one engine call that ends with its slowest group: on RL-like lengths a few
long responses decode on their own at the end of every step while the batch has thinned out. With it, a step does
not wait for its stragglers:

- the feed keeps N prompt groups outstanding (decoding, or finished and not yet taken), each group its own task
  on the engine's shared running batch (`Rollout.generate_group`);
- step s takes the first B groups to finish, whichever step launched them, writes each into partition
  ``train_{s}`` as it lands, and is complete once it has B;
- the groups still decoding go on: weight pushes land between their decode steps (``--partial-rollout``, each
  token recording its version) and they are taken by step s+1 or later (``rollout/carried_groups``);
- at step s the feed launches new groups to bring the outstanding ones back to N, up to the run's last step: had
  the last steps launched only what they still need, the last one would have to wait for every straggler left,
  the very tail this mode hides. The N - B groups still outstanding when the run ends are cancelled; their
  positions stay pending in the last checkpoint (a longer run continued from it takes them first), as upstream
  puts its over-sampling surplus back in the buffer.

The staleness bound holds as in ``--fully-async``: a group holding a token older than ``--max-staleness`` versions
behind the trained weights when the trainer reads it is dropped as ``stale`` and counted (``data/dropped_stale_
groups``); TIS corrects the rest with the per-token rollout log-probs. A group taken one step after the one that
launched it is one version older when trained, so the producer runs ahead by at most ``--max-staleness`` - 1 steps
(``carry_steps``; the mode needs ``--max-staleness`` >= 2): a group carried one step is never stale, one carried
further may be. This is upstream's ``--partial-rollout`` with
``--over-sampling-batch-size`` (which aborts the stragglers and puts them back in a buffer to be continued by the
next rollout) done without the abort: a straggler keeps its KV cache and its place in the batch.

Exactly once across checkpoints: the data cursor recorded when step s completes (the one a checkpoint after
training step s saves) lists the positions launched and not taken by steps up to s (``pending_prompts``); a run
resumed from it takes them again first (`PromptDataSource.take_positions`), so no prompt is lost or trained twice.
"""

from __future__ import annotations

import asyncio
import time

from relax.core.roles import Roles
from relax.data.sample import Sample
from relax.data_plane import InProcessDataPlane, StalenessGate
from relax.utils.aio import cancel_and_wait


class CarryOverFeed:
    """The in-process `RolloutFeed` of the module doc."""

    failure_grace_s = 0.0
    carry_steps = 1

    def __init__(self, roles: Roles, gate: StalenessGate, over_sampling_batch_size: int) -> None:
        self.rollout = roles.rollout
        self.plane = InProcessDataPlane(gate)
        self.batch_size = self.rollout.data_source.rollout_batch_size
        self.over_sampling_batch_size = over_sampling_batch_size
        self._decoding: set[asyncio.Task] = set()
        self._finished: list[tuple[int, list[Sample]]] = []  # (launching step, group), in the order they finished
        self._untaken: set[int] = set()  # stream positions launched and not taken by a completed step
        self._landed = asyncio.Event()  # set whenever a group finishes (or fails)
        self._failure: BaseException | None = None

    async def generate(self, step: int) -> tuple[dict[str, float], dict]:
        """Take step ``step``'s B groups as they finish into its partition and close it; the rollout metrics and the
        data cursor after it."""
        started = time.perf_counter()
        epoch = self.rollout.data_source.epoch_of_position(self.rollout.data_source.consumed)
        launched = self._launch(step)
        taken: list[Sample] = []
        groups = carried = 0
        while groups < self.batch_size:
            if self._failure is not None:
                raise RuntimeError(f"a group of rollout step {step + 1} failed") from self._failure
            if self._finished:
                launched_at, group = self._finished.pop(0)
                await self.plane.put(step, group)
                self._untaken.discard(group[0].group_index)
                taken.extend(group)
                groups += 1
                carried += launched_at < step
                continue
            if not self._decoding:  # nothing left to wait for (prompts whose media could not be read): short of B
                break
            self._landed.clear()
            await self._landed.wait()
        await self.plane.mark_complete(step)
        metrics = self.rollout.step_metrics(taken, epoch)
        metrics.update({
            "rollout/launched_groups": float(launched),
            "rollout/carried_groups": float(carried),
            "rollout/outstanding_groups": float(len(self._decoding) + len(self._finished)),
            "perf/rollout_take_s": time.perf_counter() - started,
        })
        return metrics, self._cursor()

    def _launch(self, step: int) -> int:
        """Start groups until N are outstanding; how many started."""
        outstanding = len(self._decoding) + len(self._finished)
        prompts = self.rollout.data_source.take_positions(max(self.over_sampling_batch_size - outstanding, 0))
        for position, prompt in prompts:
            self._untaken.add(position)
            task = asyncio.create_task(self._decode(step, position, prompt), name=f"rollout group {position}")
            self._decoding.add(task)
            task.add_done_callback(self._decoding.discard)
        return len(prompts)

    async def _decode(self, step: int, position: int, prompt: Sample) -> None:
        try:
            group = await self.rollout.generate_group(step, position, prompt)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - surfaced by the step that waits for groups
            self._failure = self._failure or error
        else:
            if group is None:  # unreadable media: the prompt is consumed, counted by the rollout
                self._untaken.discard(position)
            else:
                self._finished.append((step, group))
        # Out of the decoding set now, not at the task's done callback (a loop turn later): a group is counted once,
        # as decoding or as finished, by whichever step looks next.
        self._decoding.discard(asyncio.current_task())
        self._landed.set()

    def _cursor(self) -> dict:
        """The data cursor with every position not taken by a completed step listed as pending."""
        state = self.rollout.data_source.state_dict()
        pending = sorted(set(state.pop("pending_prompts", ())) | self._untaken)
        return {**state, "pending_prompts": pending} if pending else state

    async def end_failed_step(self, step: int) -> None:
        await self.plane.mark_complete(step)

    async def close(self) -> None:
        """Cancel the groups still decoding (the run ended; their positions stay pending in its checkpoints)."""
        for task in list(self._decoding):
            await cancel_and_wait(task)
