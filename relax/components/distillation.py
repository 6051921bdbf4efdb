"""On-policy distillation: the teacher role and how its scores reach the advantages or the loss.

The teacher scores the student's samples, either in the trainer (a frozen forward sharded like
the policy; upstream's ``--opd-type megatron``) or behind an inference engine that implements
``InferenceEngine.score`` (upstream's ``--opd-type sglang``). Its per-token log-probs (and, for
forward KL, its top-k tokens) travel as training fields: ``teacher_log_probs`` ``[T_i]``,
``teacher_top_log_probs`` ``[T_i, k]``, with the top-k ids as the batch's ``gather_ids`` so that
the trainer also returns the student's log-probs at those ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax.algorithms.distillation import opd_token_kl, penalize_advantages
from relax.backends.inference.base import InferenceEngine, ScoreRequest
from relax.backends.training.fsdp import FSDPTrainBackend
from relax.components.actor import to_train_batch
from relax.data.sample import Sample


@dataclass
class TeacherScores:
    log_probs: list[torch.Tensor]  # [T_i]
    top_ids: list[torch.Tensor] | None = None  # [T_i, k]
    top_log_probs: list[torch.Tensor] | None = None  # [T_i, k]


class TrainerTeacher:
    """The teacher as a frozen model in the trainer's processes."""

    def __init__(self, backend: FSDPTrainBackend):
        self.backend = backend

    async def score(self, samples: list[Sample], top_k: int) -> TeacherScores:
        result = self.backend.compute_log_probs(to_train_batch(samples), top_k=top_k)
        return TeacherScores(result.log_probs, result.top_ids, result.top_log_probs)


class EngineTeacher:
    """The teacher behind an inference engine (embedded, or an HTTP engine that can score)."""

    def __init__(self, engine: InferenceEngine, temperature: float):
        self.engine = engine
        self.temperature = temperature

    async def score(self, samples: list[Sample], top_k: int) -> TeacherScores:
        outputs = await self.engine.score([
            ScoreRequest(s.tokens, s.response_length, temperature=self.temperature, top_k=top_k) for s in samples
        ])
        scores = TeacherScores([torch.tensor(o.log_probs, dtype=torch.float32) for o in outputs])
        if top_k:
            scores.top_ids = [torch.tensor(o.top_ids, dtype=torch.long) for o in outputs]
            scores.top_log_probs = [torch.tensor(o.top_log_probs, dtype=torch.float32) for o in outputs]
        return scores


class OnPolicyDistillation:
    """Collects the teacher's view of each rollout batch; in advantage mode also applies it."""

    def __init__(self, teacher: TrainerTeacher | EngineTeacher, kl_type: str, norm_mode: str, top_k: int,
                 advantage_coef: float):
        self.teacher = teacher
        self.kl_type = kl_type
        self.norm_mode = norm_mode
        self.top_k = top_k if kl_type == "forward_kl" else 0
        self.advantage_coef = advantage_coef

    @property
    def advantage_mode(self) -> bool:
        return self.advantage_coef > 0

    async def teacher_fields(self, samples: list[Sample]) -> tuple[dict[str, list[torch.Tensor]], list | None]:
        """Training fields from the teacher, and the token ids (``gather_ids``) at which the
        student's log-probs are also needed (forward KL), else None."""
        scores = await self.teacher.score(samples, self.top_k)
        for sample, log_probs in zip(samples, scores.log_probs):
            if log_probs.shape[0] != sample.response_length:
                raise ValueError(f"the teacher scored {log_probs.shape[0]} tokens of sample {sample.index}, "
                                 f"which has {sample.response_length} response tokens")
        fields = {"teacher_log_probs": scores.log_probs}
        if self.top_k:
            fields["teacher_top_log_probs"] = scores.top_log_probs
        return fields, scores.top_ids

    def shape_advantages(self, samples: list[Sample], advantages: list[torch.Tensor],
                         student_log_probs: list[torch.Tensor], student_top_log_probs: list[torch.Tensor] | None,
                         fields: dict[str, list[torch.Tensor]]) -> tuple[list[torch.Tensor], dict[str, float]]:
        """Advantage mode: ``A_t − coef·KL_t`` with the KL of the sampling policy (detached)."""
        shaped, kl_means = [], []
        for i, (sample, advantage) in enumerate(zip(samples, advantages)):
            kl = opd_token_kl(
                self.kl_type, self.norm_mode, student_log_probs[i], fields["teacher_log_probs"][i],
                student_top_log_probs[i] if student_top_log_probs is not None else None,
                fields["teacher_top_log_probs"][i] if "teacher_top_log_probs" in fields else None,
            )
            mask = torch.tensor(sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length,
                                dtype=torch.float32)
            shaped.append(penalize_advantages(advantage, kl * mask, self.advantage_coef))
            kl_means.append(float((kl * mask).sum() / mask.sum().clamp(min=1)))
        return shaped, {"train/opd_kl": sum(kl_means) / max(len(kl_means), 1)}
