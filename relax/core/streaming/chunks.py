"""Training a step chunk by chunk as its groups arrive (``--fully-async``, `AsyncController`): what a chunk's
loss needs and what the controller keeps of it.

A chunk is whole groups of one step. Its per-sample fields are the reference's log-probs (streamed by the reference
role, or computed for the chunk), the engine's log-probs with TIS, and group-local advantages (streamed, or computed
for the chunk: a group's advantages depend on that group alone). The actor adds the chunk to the step's one optimizer
step (`relax.components.actor.Actor.train_chunk`). Under ``--placement ray`` the controller passes the chunk's rows
in TransferQueue, not its samples, and the actor's process reads them (`relax.core.placement.ray.workers.RoleWorker`): the
`ChunkReport` is all that comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from relax.components.advantages import advantage_abs_means
from relax.core.streaming.roles import ADVANTAGES, REF_LOG_PROBS, streamed_field
from relax.data.sample import Sample


@dataclass
class ChunkReport:
    """What the controller keeps of a trained chunk: counts for the step's metrics, and its first samples for
    ``--dump-samples``."""

    samples: int = 0
    tokens: int = 0
    streamed: int = 0  # samples that carried every streamed field (all of them when nothing streams)
    by_key: int = 0  # samples the trainer's processes read from the store themselves (the controller passed keys)
    advantage_abs_means: list[float] = field(default_factory=list)
    dump: list[Sample] = field(default_factory=list)

    def add(self, other: ChunkReport, dump_limit: int) -> None:
        self.samples += other.samples
        self.tokens += other.tokens
        self.streamed += other.streamed
        self.by_key += other.by_key
        self.advantage_abs_means += other.advantage_abs_means
        self.dump += other.dump[:max(dump_limit - len(self.dump), 0)]


def rollout_log_probs(sample: Sample) -> torch.Tensor:
    """The engine's per-token log-probs of a sample's response, ``[response_length]`` (for TIS)."""
    if sample.rollout_log_probs is None or len(sample.rollout_log_probs) != sample.response_length:
        raise ValueError(f"sample {sample.index} has no rollout log-probs for its {sample.response_length} "
                         "response tokens; --use-tis needs them from the engine")
    return torch.tensor(sample.rollout_log_probs, dtype=torch.float32)


async def per_sample_fields(samples: list[Sample], use_tis: bool, reference=None) -> dict[str, list[torch.Tensor]]:
    """The loss's fields that each sample has on its own: the reference's log-probs (streamed, or computed by
    ``reference``) and, with TIS, the engine's log-probs."""
    fields: dict[str, list[torch.Tensor]] = {}
    reference_log_probs = streamed_field(samples, REF_LOG_PROBS)
    if reference_log_probs is None and reference is not None:
        reference_log_probs = await reference.compute_log_probs(samples)
    if reference_log_probs is not None:
        fields[REF_LOG_PROBS] = reference_log_probs
    if use_tis:
        fields["rollout_log_probs"] = [rollout_log_probs(s) for s in samples]
    return fields


async def chunk_fields(samples: list[Sample], advantages, use_tis: bool,
                       reference=None) -> dict[str, list[torch.Tensor]]:
    """The loss's fields of chunk ``samples``: `per_sample_fields` and the group-local advantages (streamed, or
    computed here by ``advantages``)."""
    fields = await per_sample_fields(samples, use_tis, reference)
    streamed = streamed_field(samples, ADVANTAGES)
    fields[ADVANTAGES] = streamed if streamed is not None else (await advantages.compute(samples)).advantages
    return fields


def chunk_report(samples: list[Sample], fields: dict[str, list[torch.Tensor]], streamed_fields: tuple[str, ...],
                 dump_limit: int, by_key: int = 0) -> ChunkReport:
    """The report of a trained chunk; ``by_key``: how many of ``samples`` the trainer's process read itself."""
    return ChunkReport(
        samples=len(samples), tokens=sum(len(s.tokens) for s in samples),
        streamed=sum(all(name in s.stage_fields for name in streamed_fields) for s in samples), by_key=by_key,
        advantage_abs_means=advantage_abs_means(samples, fields[ADVANTAGES]), dump=samples[:dump_limit])


def concat_fields(first: dict[str, list[torch.Tensor]], second: dict[str, list[torch.Tensor]]):
    """The fields of two lists of samples, one after the other (a list without samples may have no fields)."""
    if not first or not second:
        return dict(first or second)
    if set(first) != set(second):
        raise ValueError(f"chunk fields differ: {sorted(first)} vs {sorted(second)}")
    return {name: first[name] + second[name] for name in first}
