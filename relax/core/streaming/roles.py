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
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from relax.config import RelaxConfig
from relax.data.sample import Sample, SampleStatus
from relax.data_plane import DataPlane, Group, InProcessDataPlane

REF_LOG_PROBS = "ref_log_probs"
ADVANTAGES = "advantages"


FIELD_OF_ROLE = {"reference": REF_LOG_PROBS, "advantages": ADVANTAGES}


@dataclass
class StreamingRole:
    """A role that gives field ``gives`` (one tensor per sample) to the groups of a partition; ``run_step`` processes
    one step's partition to its end, here (`stream_role`) or, for a role in its own Ray process, there."""

    name: str
    gives: str
    run_step: Callable[[int], Awaitable[int]]


def _computation(name: str, role) -> Callable[[list[Sample]], Awaitable[list[torch.Tensor]]]:
    """How role ``name`` computes its field from samples."""
    if name == "reference":
        return role.compute_log_probs

    async def advantages(samples: list[Sample]) -> list[torch.Tensor]:
        return (await role.compute(samples)).advantages

    return advantages


async def stream_role(plane: DataPlane, name: str, role, step: int) -> int:
    """Give role ``name``'s field to every group of partition ``step`` as it arrives; how many groups it saw."""
    gives, compute = FIELD_OF_ROLE[name], _computation(name, role)
    seen = 0
    async for groups in plane.stage_stream(step, name, (), (gives,)):
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
    return spec.group_local and not (spec.whiten_advantages or spec.needs_critic or roles.advantages.needs_kl
                                     or roles.critic is not None or roles.distillation is not None
                                     or cfg.mask_offpolicy_in_partial_rollout)


def streaming_roles(cfg: RelaxConfig, roles, plane: DataPlane) -> list[StreamingRole]:
    """The roles that stream in this run: none but in ``--fully-async``."""
    if not cfg.fully_async:
        return []
    candidates = []
    # A reference over several ranks stays in the step: its ranks' forwards are collectives over one batch, and
    # each rank reading the partition on its own would give them different groups.
    if roles.reference is not None and len(getattr(roles.reference, "handles", ())) <= 1:
        candidates.append(("reference", roles.reference))
    # In the controller's process under Ray placement, streaming the advantages would read every group from
    # TransferQueue a second time to save cheap math: there they are computed in the step, unless they have a process.
    if streams_advantages(cfg, roles) and (hasattr(roles.advantages, "stream_role_step")
                                           or isinstance(plane, InProcessDataPlane)):
        candidates.append(("advantages", roles.advantages))
    # A role in its own Ray process streams there (its ``stream_role_step``); the others in this process.
    return [StreamingRole(name, FIELD_OF_ROLE[name],
                          getattr(role, "stream_role_step", None) or functools.partial(stream_role, plane, name, role))
            for name, role in candidates]


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
