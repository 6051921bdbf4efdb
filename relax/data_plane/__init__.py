"""The data plane between rollout and training for the asynchronous modes.

Contract (both implementations):

- Partitions: one per rollout step, named ``train_{step}``. ``await put(step, samples)`` writes
  samples; a step may take several puts, each holding whole GRPO groups (every sample of one
  ``group_index`` in the same put; a group index written twice for a step is refused).
  ``await mark_complete(step)`` says no more puts will come.
- Reading: ``stream(step, batch_size, max_groups=None)`` is an async iterator of batches
  (``list[Sample]``) made of whole groups. It yields as soon as ``batch_size`` samples of complete
  groups are written, so training starts while rollout is still writing, and ends when the
  partition is complete and drained (flushing a short tail batch). A batch is the shortest run of
  groups holding at least ``batch_size`` samples. ``await clear(step)`` frees the partition after
  training; ``pending_steps()`` lists steps written and not cleared.
- Carry-over: with ``max_groups``, groups beyond that many (over-sampling surplus) go to a buffer
  and are served first by the next ``stream`` call; so are groups not read when a stream is
  closed early or a partition is cleared. The ledger records each move (``carried_over``,
  ``served_from_carry``).
- Exactly-once: every group produced is consumed once or dropped with a reason: ``filtered``
  or ``failed`` (recorded by rollout with ``await drop(step, samples, reason)``, e.g. a dynamic
  filter), ``failed`` (a written group holding a FAILED sample) or ``stale``. ``accounting()``
  gives, per producing step, produced / consumed / dropped-by-reason / carried / outstanding
  groups; counts stay with the step that produced a group even when a later step reads it.
- Staleness: `StalenessGate(max_staleness)` (upstream ``--max-staleness``, default 0 =
  synchronous). Rollout of step ``s`` starts only when ``s - trained_version <= max_staleness``
  (``await gate.wait_for_slot(step, trained_version)``; the trainer calls ``await
  gate.publish(version)``). On read, a group holding a sample whose ``weight_version`` (an int, or
  per-token versions: the minimum) is below ``trained_version - max_staleness`` is dropped as
  ``stale`` (the whole group: GRPO advantages need all of it).

Implementations:

- `InProcessDataPlane`: asyncio conditions over in-memory lists; no Ray. For one process on one
  machine and for the GPU box, which has no Ray.
- `TransferQueueDataPlane`: the PyPI ``TransferQueue`` package (0.1.11, extra ``ray``) on Ray
  2.60. `start_local_transfer_queue()` starts a local Ray bound to 127.0.0.1 without dashboard or
  telemetry, and a controller with `WholeGroupSampler` in polling mode. Imported lazily, so this
  package needs neither Ray nor TransferQueue unless that implementation is used.
"""

from relax.data_plane.base import DataPlane, Group, partition_id, split_into_groups
from relax.data_plane.in_process import InProcessDataPlane
from relax.data_plane.ledger import DROP_REASONS
from relax.data_plane.staleness import StalenessGate, oldest_weight_version

__all__ = [
    "DROP_REASONS",
    "DataPlane",
    "Group",
    "InProcessDataPlane",
    "StalenessGate",
    "oldest_weight_version",
    "partition_id",
    "split_into_groups",
]
