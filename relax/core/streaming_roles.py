"""Streaming roles of ``--fully-async``: the reference and the advantages work on rollout groups as they arrive.

In ``--fully-async`` (upstream's placement), the reference's log-probs and group-local advantages are not computed
inside the trainer's step over the whole batch: each runs as a role that reads the groups of partition
``train_{s}`` from the data plane as soon as rollout writes them (`DataPlane.stage_stream`, a consumer of its own
beside the trainer's) and writes its per-token field back to the same rows (`DataPlane.write_fields`). The trainer
reads groups once they carry every streamed field (``stream(needs=...)``), so by the time the last group of a step
lands, the reference forwards of the others are done, overlapped with the generation of the rest.

- ``reference`` gives ``ref_log_probs`` (the reference is frozen, so a group's field stays valid whenever it is
  trained, also after a carry-over). Under ``--placement ray`` it runs in the reference's own process, reading and
  writing TransferQueue there: its samples never pass through the controller.
- ``advantages`` gives ``advantages`` when they are group-local (the GRPO family, RLOO, Dr.GRPO, ...): a group's
  advantages depend on its rewards alone. Under ``--placement ray`` they stream only in a process of their own
  (``--resource``); in the controller they would read every group a second time to save cheap math, so there they
  are computed in the step. Estimators over the whole step (REINFORCE++'s global whitening, PPO's
  critic and whitening, a KL in the reward, on-policy distillation's shaping, ``--mask-offpolicy-in-partial-rollout``
  which edits loss masks after rollout) stay in the trainer's step, as upstream's hybrid mode computes them.
- Old-policy log-probs (upstream's ``actor_fwd``) stay in the trainer: they must come from the weights the update
  starts from, which exist only once the previous step's update ended (docs/modes.md).

A group the trainer reads without a field (carried from a partition cleared before a role reached it) gets it
computed in the step, so no group waits for a role that has moved on. Failed groups get empty fields (the trainer
drops them and counts them).

``--hybrid`` streams nothing: everything after generation runs in the trainer's step over whole steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from relax.config import RelaxConfig
from relax.data.sample import Sample, SampleStatus
from relax.data_plane import DataPlane, Group, InProcessDataPlane

REF_LOG_PROBS = "ref_log_probs"
ADVANTAGES = "advantages"


@dataclass
class StreamingRole:
    """A role that turns the groups of a partition into field ``gives`` (one tensor per sample), reading groups once
    they carry ``needs``. ``run_step`` processes one step's partition to its end; a role in another process has
    its own ``run_step`` (a remote call that runs the same `stream_role` there)."""

    name: str
    gives: str
    needs: tuple[str, ...] = ()
    compute: Callable[[list[Sample]], Awaitable[list[torch.Tensor]]] | None = None
    run_step: Callable[[int], Awaitable[int]] | None = None


async def stream_role(plane: DataPlane, name: str, gives: str, needs: tuple[str, ...],
                      compute: Callable[[list[Sample]], Awaitable[list[torch.Tensor]]], step: int) -> int:
    """Give field ``gives`` to every group of partition ``step`` as it arrives; returns how many groups it saw."""
    seen = 0
    async for groups in plane.stage_stream(step, name, needs, (gives,)):
        seen += len(groups)
        usable = [group for group in groups if _usable(group)]
        values = iter(await compute([s for group in usable for s in group]) if usable else [])
        written = [next(values) if _usable(group) else torch.zeros(0) for group in groups for _ in group]
        await plane.write_fields(step, groups, {gives: written})
    return seen


async def generate_group_by_group(rollout, plane: DataPlane, step: int) -> dict[str, float]:
    """Generate step ``step`` into its partition, each group written as soon as it is scored (the streaming roles
    and the trainer start on it while the rest decode); groups the rollout hands over only at the end (dynamic
    sampling, per-sample generate functions) are written then. Returns the rollout metrics."""
    written: set[int] = set()

    async def write(groups: list[list[Sample]]) -> None:
        await plane.put(step, [sample for group in groups for sample in group])
        written.update(group[0].group_index for group in groups)

    samples, metrics = await rollout.generate(step, on_group=write)
    await plane.put(step, [s for s in samples if s.group_index not in written])
    return metrics


def _usable(group: Group) -> bool:
    return all(sample.status != SampleStatus.FAILED for sample in group)


def streams_advantages(cfg: RelaxConfig, roles) -> bool:
    """Whether the advantages of a group depend on that group alone, so that they can be computed as it arrives."""
    spec = roles.advantages.spec
    return not (spec.whiten_advantages or spec.needs_critic or roles.advantages.needs_kl or roles.critic is not None
                or roles.distillation is not None or cfg.mask_offpolicy_in_partial_rollout)


def streaming_roles(cfg: RelaxConfig, roles, plane: DataPlane) -> list[StreamingRole]:
    """The roles that stream in this run: none but in ``--fully-async``."""
    if not cfg.fully_async:
        return []
    streamed = []
    # A reference over several ranks stays in the step: its ranks' forwards are collectives over one batch, and
    # each rank reading the partition on its own would give them different groups.
    if roles.reference is not None and len(getattr(roles.reference, "handles", ())) <= 1:
        reference = roles.reference
        remote = getattr(reference, "stream_role_step", None)  # the reference in its own Ray process
        streamed.append(StreamingRole("reference", REF_LOG_PROBS, compute=None if remote else reference.compute_log_probs,
                                      run_step=remote))
    advantages = roles.advantages
    remote = getattr(advantages, "stream_role_step", None)  # the advantages in their own Ray process
    # In the controller's process under Ray placement, streaming them would read every group from TransferQueue a
    # second time to save cheap math: there they are computed in the step, from the samples the trainer reads.
    if streams_advantages(cfg, roles) and (remote is not None or isinstance(plane, InProcessDataPlane)):

        async def compute_advantages(samples: list[Sample]) -> list[torch.Tensor]:
            return (await advantages.compute(samples)).advantages

        streamed.append(StreamingRole("advantages", ADVANTAGES, compute=None if remote else compute_advantages,
                                      run_step=remote))
    for role in streamed:
        if role.run_step is None:
            role.run_step = _local_runner(plane, role)
    return streamed


def _local_runner(plane: DataPlane, role: StreamingRole) -> Callable[[int], Awaitable[int]]:
    async def run_step(step: int) -> int:
        return await stream_role(plane, role.name, role.gives, role.needs, role.compute, step)
    return run_step


async def run_roles(streamed: list[StreamingRole], start: int, total: int) -> None:
    """Every streaming role over steps ``start .. total - 1``, each role one step after the other."""
    async def run(role: StreamingRole) -> None:
        for step in range(start, total):
            await role.run_step(step)
    await asyncio.gather(*(run(role) for role in streamed))


def streamed_field(samples: list[Sample], name: str) -> list[torch.Tensor] | None:
    """Field ``name`` of every sample when a streaming role gave it to all of them, else None (compute it)."""
    if samples and all(name in sample.stage_fields for sample in samples):
        return [sample.stage_fields[name] for sample in samples]
    return None
