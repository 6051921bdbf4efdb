"""A trained reward model as the reward (``--rm-path``): a sequence-classification model with one label scores each
sample's prompt and response, and the score is the sample's reward.

The model is what `relax export` writes for a ``--loss-type rm`` run (or any ``AutoModelForSequenceClassification``
with one label). It reads the sample's token ids (the rendered prompt and the response as the engine produced
them), so it must share the policy's tokenizer: a reward model trained from the same base does; another is refused
at load, naming ``--rm-path``. A sequence is scored where the model pools it (its last token that is not padding),
the position the trainer scored it at.

It loads at the first score, in the process that scores (the rollout's: beside the engine), on the run's device and
dtype. Concurrent scores are batched: the calls that wait while a forward runs go into the next one (right-padded, at
most `MAX_BATCH_TOKENS` padded tokens), so a step's samples cost a few forwards, not one each. Each call is bounded
by ``--reward-timeout`` like every reward (`RewardComputer`); a sequence longer than the model's positions, or a
forward that fails on one sample, fails that sample's reward alone (0, counted in ``reward/num_errors``; a failed
batch is scored again sample by sample). ``reward/rm_scores`` counts the scores given.

Several folders make an ensemble (`RewardModelEnsemble`): a Bradley-Terry model's scores are defined up to a shift
(and, trained apart, differ in scale), so each member's score is standardised by the running mean and standard
deviation of that member's scores so far in the run (as OpenRLHF's ``--normalize_reward`` does for one model), and
the standardised scores are reduced: their mean, their minimum, or their mean minus a multiple of their standard
deviation, the uncertainty penalty of reward-model ensembles against over-optimisation (Coste et al., 2023, "Reward
Model Ensembles Help Mitigate Overoptimization"). ``reward/rm_disagreement`` is the mean standard deviation of the
members' standardised scores.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from relax.backends.models.family import load_reward_model, model_folder_problem, read_tokenizer

# Padded tokens of one scoring forward (rows x longest row): bounds its activation memory.
MAX_BATCH_TOKENS = 16384


@dataclass
class _Pending:
    tokens: list[int]
    future: asyncio.Future = field(repr=False)


class RewardModelScorer:
    """``await scorer(args, sample) -> float``: the reward model's score of the sample (module doc)."""

    gives_verdicts = False  # a score, not a verdict: no accuracy is computed from it

    def __init__(self, path: str | Path, device: torch.device | str, dtype: torch.dtype,
                 policy_tokenizer: Any | None = None) -> None:
        self.path = Path(path)
        # its tokenizer is read below, once; its score head must be in its files (a random one scores noise)
        problem = model_folder_problem(self.path, needs_tokenizer=False, load_as="reward_model")
        if problem is not None:
            raise ValueError(f"--rm-path {problem}")
        config = AutoConfig.from_pretrained(self.path)
        if getattr(config, "num_labels", None) != 1:
            raise ValueError(f"--rm-path {path}: a reward model has one label (a scalar score); this config has "
                             f"{getattr(config, 'num_labels', None)}")
        if policy_tokenizer is not None:
            try:
                own = read_tokenizer(self.path)
            except ValueError as error:
                raise ValueError(f"--rm-path {error}") from None
            if own.get_vocab() != policy_tokenizer.get_vocab():
                raise ValueError(f"--rm-path {path}: its tokenizer is not the policy's; the reward model reads the "
                                 "samples' token ids, so it must share the policy's tokenizer (train it from the "
                                 "same base)")
        self.device, self.dtype = torch.device(device), dtype
        self.model = None  # loaded at the first score
        self.max_positions = getattr(config.get_text_config(), "max_position_embeddings", None)
        self.vocab_size = config.get_text_config().vocab_size
        self._load_lock = threading.Lock()
        self._forward_lock = threading.Lock()  # one forward at a time (scores may come from several event loops)
        self._queues: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> list of _Pending
        self._workers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> its batching task
        self.scores = 0

    def pop_metrics(self) -> dict[str, int]:
        scores, self.scores = self.scores, 0
        return {"reward/rm_scores": scores}

    async def __call__(self, args: Any, sample: Any) -> float:
        tokens = list(sample.tokens)
        if not tokens:
            raise ValueError("the sample has no tokens to score")
        if self.max_positions is not None and len(tokens) > self.max_positions:
            raise ValueError(f"{len(tokens)} tokens, more than the reward model's {self.max_positions} positions")
        if not all(0 <= token < self.vocab_size for token in tokens):
            raise ValueError(f"a token id outside the reward model's vocabulary of {self.vocab_size}")
        loop = asyncio.get_running_loop()
        pending = _Pending(tokens, loop.create_future())
        self._queues.setdefault(loop, []).append(pending)
        worker = self._workers.get(loop)
        if worker is None or worker.done():
            self._workers[loop] = loop.create_task(self._drain(loop))
        score = await pending.future
        self.scores += 1
        return score

    async def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """Score what waits on ``loop``'s queue, a batch per forward, until it is empty."""
        queue = self._queues[loop]
        while queue:
            batch, longest = [], 0
            while queue:
                if queue[0].future.done():  # its caller gave up (--reward-timeout)
                    queue.pop(0)
                    continue
                width = max(longest, len(queue[0].tokens))
                if batch and width * (len(batch) + 1) > MAX_BATCH_TOKENS:
                    break
                batch.append(queue.pop(0))
                longest = width
            if not batch:
                break
            await self._score_batch(batch)

    async def _score_batch(self, batch: list[_Pending]) -> None:
        """One forward for ``batch``; if it fails, each sample alone, so that only the one that fails by itself
        gets the error (its reward 0, counted) and the others their scores."""
        try:
            scores = await asyncio.to_thread(self._score, [item.tokens for item in batch])
        except Exception as err:
            if len(batch) > 1:
                for item in batch:
                    await self._score_batch([item])
                return
            if not batch[0].future.done():
                batch[0].future.set_exception(err)
            return
        for item, score in zip(batch, scores):
            if not item.future.done():
                item.future.set_result(score)

    def _load(self) -> None:
        with self._load_lock:
            if self.model is None:
                model = load_reward_model(self.path, self.dtype)  # (in a worker thread: it takes the models' lock)
                self.model = model.to(self.device).eval()

    @torch.no_grad()
    def _score(self, sequences: list[list[int]]) -> list[float]:
        self._load()
        pad = self.model.config.pad_token_id
        if pad is None and len(sequences) > 1:  # the model pools at the last non-pad token: it needs one
            return [score for tokens in sequences for score in self._score([tokens])]
        longest = max(map(len, sequences))
        ids = torch.full((len(sequences), longest), pad if pad is not None else 0, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, tokens in enumerate(sequences):
            ids[row, :len(tokens)] = torch.tensor(tokens)
            mask[row, :len(tokens)] = 1
        with self._forward_lock:
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        return logits[:, 0].float().cpu().tolist()


class RunningMoments:
    """Mean and standard deviation of the values seen so far (Welford's update)."""

    def __init__(self) -> None:
        self.count, self.mean, self._squares = 0, 0.0, 0.0

    def add(self, value: float) -> None:
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self._squares += delta * (value - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self._squares / (self.count - 1)) if self.count > 1 else 0.0

    def standardise(self, value: float) -> float:
        """``value`` centred on the mean, and scaled by the standard deviation once there is one."""
        return (value - self.mean) / self.std if self.std > 0 else value - self.mean


ENSEMBLE_REDUCTIONS = ("mean", "min", "mean_minus_std")


def reduce_scores(scores: list[float], how: str, std_coef: float = 1.0) -> float:
    """The ensemble's reward from its members' standardised scores (``--rm-ensemble-reduce``): their mean, their
    minimum, or their mean less ``std_coef`` times their (population) standard deviation."""
    if how == "min":
        return min(scores)
    mean = statistics.fmean(scores)
    return mean - std_coef * statistics.pstdev(scores) if how == "mean_minus_std" else mean


class RewardModelEnsemble:
    """``await ensemble(args, sample) -> float``: several reward models' scores, each standardised by its running
    moments, reduced to one (module doc). A member that cannot score the sample fails the sample's reward."""

    gives_verdicts = False

    def __init__(self, members: list[RewardModelScorer], reduce: str, std_coef: float = 1.0) -> None:
        if len(members) < 2:
            raise ValueError(f"an ensemble needs two reward models or more, got {len(members)}")
        if reduce not in ENSEMBLE_REDUCTIONS:
            raise ValueError(f"--rm-ensemble-reduce {reduce}: one of {', '.join(ENSEMBLE_REDUCTIONS)}")
        self.members = members
        self.reduce = reduce
        self.std_coef = std_coef
        self.moments = [RunningMoments() for _ in members]
        self._disagreement: list[float] = []

    async def __call__(self, args: Any, sample: Any) -> float:
        scores = await asyncio.gather(*(member(args, sample) for member in self.members))
        standardised = []
        for moments, score in zip(self.moments, scores):
            moments.add(score)
            standardised.append(moments.standardise(score))
        self._disagreement.append(statistics.pstdev(standardised))
        return reduce_scores(standardised, self.reduce, self.std_coef)

    def pop_metrics(self) -> dict[str, float]:
        for member in self.members:
            member.pop_metrics()  # each scored every sample the ensemble did
        metrics: dict[str, float] = {"reward/rm_scores": len(self._disagreement)}
        if self._disagreement:
            metrics["reward/rm_disagreement"] = statistics.fmean(self._disagreement)
            self._disagreement = []
        return metrics
