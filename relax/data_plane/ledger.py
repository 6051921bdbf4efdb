"""Exactly-once accounting of GRPO groups, per rollout step.

Every group a step produces ends in exactly one of: consumed (handed to training once) or
dropped with a reason. Until then it is outstanding: still in its partition or in the carry-over
buffer. Counts are in groups and are kept against the step that *produced* the group, so a group
carried to a later step and read there still counts as consumed for its own step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

DROP_REASONS = ("filtered", "failed", "stale")


@dataclass
class StepCounts:
    produced: int = 0
    consumed: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    carried_over: int = 0  # groups of this step moved to the carry-over buffer (surplus or unread at clear)
    served_from_carry: int = 0  # groups of earlier steps this step's stream read from that buffer

    @property
    def outstanding(self) -> int:
        """Groups produced but neither consumed nor dropped yet."""
        return self.produced - self.consumed - sum(self.dropped.values())

    def as_dict(self) -> dict:
        return {"produced": self.produced, "consumed": self.consumed, "dropped": dict(self.dropped),
                "carried_over": self.carried_over, "served_from_carry": self.served_from_carry,
                "outstanding": self.outstanding}


class GroupLedger:
    def __init__(self) -> None:
        self._steps: dict[int, StepCounts] = defaultdict(StepCounts)

    def produced(self, step: int, groups: int) -> None:
        self._steps[step].produced += groups

    def produced_at_least(self, step: int, groups: int) -> None:
        """A reader in another process learns the produced count from the end-of-step marker."""
        counts = self._steps[step]
        counts.produced = max(counts.produced, groups)

    def consumed(self, step: int, groups: int = 1) -> None:
        self._steps[step].consumed += groups

    def dropped(self, step: int, reason: str, groups: int = 1) -> None:
        if reason not in DROP_REASONS:
            raise ValueError(f"unknown drop reason {reason!r}; expected one of {DROP_REASONS}")
        self._steps[step].dropped[reason] += groups

    def carried_over(self, step: int, groups: int = 1) -> None:
        self._steps[step].carried_over += groups

    def served_from_carry(self, step: int, groups: int = 1) -> None:
        self._steps[step].served_from_carry += groups

    def report(self) -> dict[int, dict]:
        return {step: counts.as_dict() for step, counts in sorted(self._steps.items())}
