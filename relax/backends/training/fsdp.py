"""Training backend on FSDP2 (`torch.distributed.fsdp.fully_shard`).

Every rank receives the whole global batch and trains on its strided share; loss denominators
count the whole batch, so the gradient equals the single-process one at any world size. The
model's response logits are computed only at response positions, which keeps the fp32 logits of
long prompts out of memory.

With a single process there is nothing to shard: the model stays a plain module (bf16 compute
through autocast), which saves FSDP's per-layer hooks and DTensor dispatch (~10% of a CPU step on
the quickstart model, benchmarks/README.md). The training code is the same at every size.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from relax.algorithms.loss import LossFn, MicroBatchTensors
from relax.backends.model_family import MediaTokens, concat_inputs, forward_inputs, freeze_towers, load_model
from relax.backends.training.base import LogProbs, PerTokenOutputs, TrainBackend, TrainBatch
from relax.distributed.process_group import ensure_process_group, release_before_shutdown
from relax.distributed.weight_sync import bucketize

logger = logging.getLogger("relax")

# Logit of tokens the engine never samples (media placeholders): finite, so that 0·logit stays 0 in the entropy.
SUPPRESSED_LOGIT = -1e9


@dataclass(frozen=True)
class TrainSettings:
    device: torch.device
    compute_dtype: torch.dtype  # dtype of the forward; master weights stay float32
    micro_batch_size: int
    temperature: float  # logits are divided by it so log-probs match the sampling distribution
    pad_token_id: int
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    total_optimizer_steps: int = 1
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    gradient_checkpointing: bool = False
    entropy_grad: bool = False  # backpropagate through the entropy (only an entropy bonus needs it)
    freeze_vision_tower: bool = False
    freeze_audio_tower: bool = False


def _hidden_at(base_model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               predict_positions: torch.Tensor) -> torch.Tensor:
    """Last hidden states ``[B, R, H]`` at ``predict_positions`` ``[B, R]``, the positions whose
    next token is a response token."""
    hidden = base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    index = predict_positions.unsqueeze(-1).expand(-1, -1, hidden.size(-1))
    return hidden.gather(1, index)


class ResponseLogitsModel(nn.Module):
    """A causal LM that returns logits ``[B, R, V]`` only at the positions that predict response
    tokens, which keeps the float32 logits of long prompts out of memory.

    With media the whole model's forward runs (the families merge image and audio features in
    their top-level forward) and its LM head is applied from the first response position on."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model
        # Omni thinkers compute the logits of every position (their forward has no logits_to_keep).
        self._keeps_logits = "logits_to_keep" in inspect.signature(hf_model.forward).parameters

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, predict_positions: torch.Tensor,
                media: dict[str, torch.Tensor] | None = None):
        if not media:
            hidden = _hidden_at(self.hf_model.base_model, input_ids, attention_mask, predict_positions)
            return self.hf_model.get_output_embeddings()(hidden)
        # Padding entries of predict_positions are 0; they are clamped into range and masked later.
        first = int(predict_positions[:, 0].min()) if self._keeps_logits else 0
        keep = {"logits_to_keep": torch.arange(first, input_ids.shape[1], device=input_ids.device)} \
            if self._keeps_logits else {}
        logits = self.hf_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **keep,
                               **media).logits
        index = (predict_positions - first).clamp(min=0).unsqueeze(-1).expand(-1, -1, logits.size(-1))
        return logits.gather(1, index)


class ResponseValueModel(nn.Module):
    """PPO's critic: the policy's transformer body with a scalar value head, returning ``V_t``
    ``[B, R]`` at the positions that predict response tokens (the state before token t).

    The body starts from the policy checkpoint (its LM head is dropped); the head starts at zero,
    so every value starts at 0 and ``--num-critic-only-steps`` can fit it before the policy moves.
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model.base_model
        self.value_head = nn.Linear(self.hf_model.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, predict_positions: torch.Tensor):
        hidden = _hidden_at(self.hf_model, input_ids, attention_mask, predict_positions)
        return self.value_head(hidden).squeeze(-1)


def lr_lambda(step: int, warmup: int, total: int, style: str, min_ratio: float) -> float:
    """LR multiplier at optimizer step ``step`` (0-based): linear warmup, then constant or cosine."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if style == "constant":
        return 1.0
    progress = min(max(step - warmup, 0) / max(total - warmup, 1), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _shard_model(model: nn.Module, compute_dtype: torch.dtype) -> None:
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layer_classes = set(getattr(model.hf_model, "_no_split_modules", None) or [])
    for module in model.hf_model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


class FSDPTrainBackend(TrainBackend):
    """Policy (``trainable=True``), frozen reference or teacher (``trainable=False``), or PPO
    critic (``value_head=True``)."""

    def __init__(self, model_path: str | Path, settings: TrainSettings, trainable: bool = True,
                 value_head: bool = False):
        ensure_process_group(settings.device)
        self.settings = settings
        self.trainable = trainable
        self.value_head = value_head
        hf_model = load_model(model_path, torch.float32)
        if settings.gradient_checkpointing and trainable:
            hf_model.gradient_checkpointing_enable()
        media_ids = MediaTokens.of(hf_model.config).ids
        self._suppressed_ids = torch.tensor(media_ids, device=settings.device) if media_ids else None
        self.model = ResponseValueModel(hf_model) if value_head else ResponseLogitsModel(hf_model)
        self.model.to(settings.device)
        self.world_size = dist.get_world_size()
        self.sharded = self.world_size > 1
        if self.sharded:
            _shard_model(self.model, settings.compute_dtype)
        self.model.train(trainable)
        self.model.requires_grad_(trainable)
        if trainable:
            frozen = freeze_towers(hf_model, settings.freeze_vision_tower, settings.freeze_audio_tower)
            if frozen:
                logger.info("froze %d encoder parameters (--freeze-vision-tower / --freeze-audio-tower)", frozen)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if trainable:
            self.optimizer = torch.optim.AdamW(
                [p for p in self.model.parameters() if p.requires_grad], lr=settings.lr, betas=settings.adam_betas, eps=settings.adam_eps,
                weight_decay=settings.weight_decay, foreach=True,
            )
            min_ratio = settings.min_lr / settings.lr
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer,
                lambda step: lr_lambda(
                    step, settings.lr_warmup_steps, settings.total_optimizer_steps, settings.lr_decay_style, min_ratio
                ),
            )
        release_before_shutdown(self.release)

    def release(self) -> None:
        """Drop the model and optimizer (before the process group goes; `shutdown_process_group`). The backend
        cannot be used after it."""
        self.model = self.optimizer = self.scheduler = None

    @property
    def hf_config(self):
        return self.model.hf_model.config

    # ---- forward -------------------------------------------------------------------------
    def _pack(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ``input_ids``/``attention_mask`` ``[B, T]``, ``predict_positions`` and
        ``targets`` ``[B, R]``, and ``response_mask`` ``[B, R]`` (1 on real response tokens)."""
        device = self.settings.device
        lengths = [len(t) for t in batch.tokens]
        max_len, max_resp = max(lengths), max(max(batch.response_lengths), 1)
        input_ids = torch.full((len(batch), max_len), self.settings.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), max_len), dtype=torch.long)
        positions = torch.zeros((len(batch), max_resp), dtype=torch.long)
        response_mask = torch.zeros((len(batch), max_resp))
        for row, (tokens, resp_len) in enumerate(zip(batch.tokens, batch.response_lengths)):
            input_ids[row, : len(tokens)] = torch.tensor(tokens)
            attention_mask[row, : len(tokens)] = 1
            prompt_len = len(tokens) - resp_len
            positions[row, :resp_len] = torch.arange(prompt_len - 1, len(tokens) - 1)
            response_mask[row, :resp_len] = 1
        targets = input_ids.gather(1, (positions + 1).clamp(max=max_len - 1))
        return (input_ids.to(device), attention_mask.to(device), positions.to(device), targets.to(device),
                response_mask.to(device))

    def _autocast(self):
        """Unsharded models compute in ``compute_dtype`` through autocast (FSDP casts by itself)."""
        enabled = not self.sharded and self.settings.compute_dtype != torch.float32
        return torch.autocast(self.settings.device.type, dtype=self.settings.compute_dtype, enabled=enabled)


    def _per_token_outputs(self, batch: TrainBatch, entropy_grad: bool, top_k: int = 0) -> PerTokenOutputs:
        input_ids, attention_mask, positions, targets, response_mask = self._pack(batch)
        media = self._media_inputs(batch, input_ids)
        with self._autocast():
            outputs = self.model(input_ids, attention_mask, positions, media) if media else \
                self.model(input_ids, attention_mask, positions)
        if self.value_head:
            return PerTokenOutputs(outputs.float(), None, response_mask)
        logits = outputs.float() / self.settings.temperature
        if self._suppressed_ids is not None:  # the engine never samples media placeholders: same distribution here
            logits = logits.index_fill(-1, self._suppressed_ids, SUPPRESSED_LOGIT)
        log_norm = logits.logsumexp(dim=-1)
        log_probs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
        gathered = None
        if batch.gather_ids is not None:
            ids = self._pad_gather_ids(batch, response_mask)
            gathered = logits.gather(-1, ids) - log_norm.unsqueeze(-1)
        top_log_probs = top_ids = None
        if top_k:
            top_logits, top_ids = logits.detach().topk(top_k, dim=-1)
            top_log_probs = top_logits - log_norm.detach().unsqueeze(-1)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = torch.softmax(logits, dim=-1)
            entropy = log_norm - (probs * logits).sum(dim=-1)
        return PerTokenOutputs(log_probs, entropy, response_mask, gathered, top_log_probs, top_ids)

    def _media_inputs(self, batch: TrainBatch, input_ids: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if not batch.multimodal or not any(batch.multimodal):
            return None
        if self.value_head:
            raise NotImplementedError("a critic on multimodal samples is not supported yet")
        hf_model = self.model.hf_model
        # float32 in; each family casts pixel values to its vision tower's dtype itself
        return forward_inputs(hf_model, concat_inputs(batch.multimodal), input_ids, self.settings.device, torch.float32)

    def _pad_gather_ids(self, batch: TrainBatch, response_mask: torch.Tensor) -> torch.Tensor:
        """``batch.gather_ids`` (``[T_i, k]`` per sample) right-padded to ``[B, R, k]`` with id 0."""
        k = batch.gather_ids[0].shape[-1]
        ids = torch.zeros((*response_mask.shape, k), dtype=torch.long)
        for row, sample_ids in enumerate(batch.gather_ids):
            ids[row, : sample_ids.shape[0]] = sample_ids
        return ids.to(self.settings.device)

    def _rank_share(self, batch: TrainBatch) -> TrainBatch:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return batch
        return batch.select(range(dist.get_rank(), len(batch), dist.get_world_size()))

    def _micro_batches(self, batch: TrainBatch) -> Iterator[TrainBatch]:
        size = self.settings.micro_batch_size
        for start in range(0, len(batch), size):
            yield batch.select(range(start, min(start + size, len(batch))))

    @torch.no_grad()
    def _forward_without_grad(self, batch: TrainBatch, top_k: int = 0) -> Iterator[tuple[int, int, PerTokenOutputs]]:
        """``(row, response_length, outputs)`` per sample, micro-batch by micro-batch, in eval mode."""
        was_training = self.model.training
        self.model.eval()
        try:
            for mb in self._micro_batches(batch):
                outputs = self._per_token_outputs(mb, entropy_grad=False, top_k=top_k)
                for row, resp_len in enumerate(mb.response_lengths):
                    yield row, resp_len, outputs
        finally:
            self.model.train(was_training)

    def compute_log_probs(self, batch: TrainBatch, top_k: int = 0) -> LogProbs:
        """Per-sample log-probs and entropies (and log-probs at ``batch.gather_ids``, and the
        ``top_k`` most likely tokens); every rank computes the whole batch so that all ranks hold
        the same values without a gather."""
        if self.value_head:
            raise TypeError("a critic has no log-probs; use compute_values")
        result = LogProbs([], [], [] if batch.gather_ids is not None else None,
                          [] if top_k else None, [] if top_k else None)
        for row, resp_len, outputs in self._forward_without_grad(batch, top_k):
            result.log_probs.append(outputs.primary[row, :resp_len].cpu())
            result.entropy.append(outputs.entropy[row, :resp_len].cpu())
            if result.gathered is not None:
                result.gathered.append(outputs.gathered[row, :resp_len].cpu())
            if top_k:
                result.top_log_probs.append(outputs.top_log_probs[row, :resp_len].cpu())
                result.top_ids.append(outputs.top_ids[row, :resp_len].cpu())
        return result

    def compute_values(self, batch: TrainBatch) -> list[torch.Tensor]:
        """The critic's per-sample values ``[T_i]`` of the response tokens."""
        if not self.value_head:
            raise TypeError("this backend has no value head")
        return [outputs.primary[row, :resp_len].cpu() for row, resp_len, outputs in self._forward_without_grad(batch)]

    # ---- training ------------------------------------------------------------------------
    def _micro_batch_tensors(self, mb: TrainBatch, response_mask: torch.Tensor, num_samples: int, num_tokens: int):
        device = self.settings.device
        mask = torch.zeros_like(response_mask)
        for row, loss_mask in enumerate(mb.loss_masks):
            mask[row, : len(loss_mask)] = torch.tensor(loss_mask, dtype=mask.dtype, device=device)
        fields = {}
        for name, values in mb.fields.items():  # [T_i, ...] per sample -> [B, R, ...]
            padded = response_mask.new_zeros((*response_mask.shape, *values[0].shape[1:]))
            for row, value in enumerate(values):
                padded[row, : value.shape[0]] = value.to(device=device, dtype=padded.dtype)
            fields[name] = padded
        return MicroBatchTensors(mask=mask, fields=fields, global_num_samples=num_samples, global_num_tokens=num_tokens)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        assert self.optimizer is not None and self.scheduler is not None, "a frozen backend cannot train"
        num_samples, num_tokens = len(batch), batch.num_loss_tokens()
        micro_batches = list(self._micro_batches(self._rank_share(batch)))
        entropy_grad = self.settings.entropy_grad
        totals: dict[str, torch.Tensor] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for index, mb in enumerate(micro_batches):
            if self.sharded:  # reduce gradients across ranks once, on the last micro-batch
                self.model.set_requires_gradient_sync(index == len(micro_batches) - 1)
            outputs = self._per_token_outputs(mb, entropy_grad)
            tensors = self._micro_batch_tensors(mb, outputs.response_mask, num_samples, num_tokens)
            if outputs.gathered is not None:
                tensors.fields["gathered_log_probs"] = outputs.gathered
            loss, metrics = loss_fn(tensors, outputs.primary, outputs.entropy)
            # Each rank's loss is its share of the global mean (global denominators): the gradient
            # must be the sum over ranks, and FSDP's reduction averages, hence the factor.
            (loss * self.world_size).backward()
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + value.detach().float()
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.scheduler.step()
        result = self._all_reduce_sum(totals)
        result["grad_norm"] = grad_norm
        result["lr"] = self.scheduler.get_last_lr()[0]
        return result

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.settings.clip_grad if self.settings.clip_grad > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def _all_reduce_sum(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        if not totals:
            return {}
        names = sorted(totals)
        stacked = torch.stack([torch.as_tensor(totals[n], dtype=torch.float32) for n in names]).to(self.settings.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stacked)
        return dict(zip(names, stacked.tolist()))

    # ---- weights -------------------------------------------------------------------------
    def named_parameters_for_sync(self, dtype: torch.dtype, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        if self.value_head:
            raise TypeError("a critic's weights are not synced to inference engines")
        # Lazily gathered: with FSDP each parameter is unsharded only when its bucket is built.
        full = ((name, param.full_tensor() if hasattr(param, "full_tensor") else param)
                for name, param in self.model.hf_model.named_parameters())
        yield from bucketize(full, bucket_bytes, dtype)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the unsharded HF state dict on CPU (every rank gets it)."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # At world size 1 on CPU the "gathered" tensors can alias the live parameters: copy them.
        return {name.removeprefix("hf_model."): tensor.clone() for name, tensor in state.items()}

    # ---- checkpoints ---------------------------------------------------------------------
    def save(self, directory: Path, include_optimizer: bool = True) -> None:
        directory = Path(directory)
        if include_optimizer and self.optimizer is not None:
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory / "model_optim")
            if dist.get_rank() == 0:
                torch.save(self.scheduler.state_dict(), directory / "lr_scheduler.pt")
        else:
            dcp.save({"model": get_model_state_dict(self.model)}, checkpoint_id=directory / "model_optim")

    def load(self, directory: Path, include_optimizer: bool = True) -> None:
        directory = Path(directory)
        if include_optimizer and self.optimizer is not None:
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=directory / "model_optim")
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            self.scheduler.load_state_dict(torch.load(directory / "lr_scheduler.pt", weights_only=True))
        else:
            state = {"model": get_model_state_dict(self.model)}
            dcp.load(state, checkpoint_id=directory / "model_optim")
            set_model_state_dict(self.model, state["model"])
