"""The model a training backend runs: a Hugging Face model whose forward returns what the losses need at the
positions that predict response tokens only: log-probs and entropies through the LM head chunk by chunk
(`ResponseLogitsModel`, no full logits), PPO's values (`ResponseValueModel`), or a reward model's scores
(`ResponseScoreModel`). Packed rows attend apart (`varlen_attention`)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from relax.backends.training.log_probs import TokenLogProbs, token_log_probs
from relax.backends.training.master_weights import MasterWeightCasts
from relax.backends.training.varlen_attention import PACKING_KWARG, PackedAttention, use_packed_attention
from relax.backends.training.vocab_parallel import vocab_parallel_token_log_probs


@dataclass(frozen=True)
class HeadRequest:
    """What the LM head computes at the response positions (`token_log_probs`)."""

    ids: torch.Tensor  # [M, K]: the next token, then any extra ids (a teacher's top-k)
    temperature: float
    suppressed_ids: torch.Tensor | None
    chunk_size: int
    entropy_grad: bool
    top_k: int
    compute_dtype: torch.dtype
    weight_casts: MasterWeightCasts | None = None  # the head weight's casts and float32 gradient path
    keep_logits: bool = False  # the chunks' logits kept for the backward (`token_log_probs`)

    def apply(self, hidden: torch.Tensor, head_weight: torch.Tensor) -> TokenLogProbs:
        """The LM head ``head_weight`` on the response positions' last hidden states ``[M, H]``; a head split by
        vocabulary over a tensor-parallel group (a DTensor ``Shard(0)``) computes its slice there
        (`vocab_parallel`)."""
        if isinstance(head_weight, DTensor):
            mesh = head_weight.device_mesh
            if mesh.ndim != 1 or head_weight.placements != (Shard(0),):
                raise ValueError(f"an LM head laid out as {head_weight.placements} on {mesh} (expected Shard(0) over "
                                 "the tensor-parallel ranks)")
            return vocab_parallel_token_log_probs(
                hidden, head_weight.to_local(), self.ids, head_weight.shape[0], mesh.get_group(),
                temperature=self.temperature, suppressed_ids=self.suppressed_ids, chunk_size=self.chunk_size,
                entropy_grad=self.entropy_grad, top_k=self.top_k, compute_dtype=self.compute_dtype,
                keep_logits=self.keep_logits)
        return token_log_probs(
            hidden, head_weight, self.ids, temperature=self.temperature, suppressed_ids=self.suppressed_ids,
            chunk_size=self.chunk_size, entropy_grad=self.entropy_grad, top_k=self.top_k,
            compute_dtype=self.compute_dtype, weight_casts=self.weight_casts, keep_logits=self.keep_logits,
        )


@contextmanager
def _head_bypassed(hf_model: nn.Module):
    """The model's forward returns its last hidden states as "logits". The multimodal families merge media
    features in their top-level forward, and some (the omni thinkers) cannot skip their LM head there."""
    head = hf_model.get_output_embeddings()
    hf_model.set_output_embeddings(nn.Identity())
    try:
        yield
    finally:
        hf_model.set_output_embeddings(head)


def language_model(hf_model: nn.Module) -> nn.Module:
    """The text decoder (whose attention is packed); vision and audio towers keep their own attention."""
    decoder = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else None
    return decoder if decoder is not None else hf_model.base_model


def ties_embeddings(hf_model: nn.Module) -> bool:
    """Whether the LM head's weight is the token embedding's."""
    head, embedding = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    return head is not None and embedding is not None and head.weight is embedding.weight


def packed_mask_placeholder(device: torch.device) -> torch.Tensor:
    """The attention mask a decoder is given for a packed row. A 4-D mask is taken as prepared, so the decoder builds
    none (every family's mask builder returns it as it is). Building one from packed positions reads a device value
    on the host (transformers' packed-sequence check), a synchronization per forward; the packed attention keeps the
    sequences apart itself and never reads this placeholder."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)


def _has_head(module: nn.Module) -> bool:
    get_head = getattr(module, "get_output_embeddings", None)
    return get_head is not None and get_head() is not None


def _response_hidden(hf_model: nn.Module, body: nn.Module, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                     predict_index: torch.Tensor, packing: PackedAttention | None,
                     media: dict[str, torch.Tensor] | None,
                     router_logits: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Last hidden states ``[M, H]`` at ``predict_index`` (flat positions into ``input_ids``), the
    positions whose next token is a response token; with ``router_logits``, a mixture-of-experts model's router
    logits of every layer too (for its auxiliary loss), else None."""
    extra = {PACKING_KWARG: packing} if packing is not None else {}
    if position_ids is not None:
        extra["position_ids"] = position_ids
    if router_logits:
        extra["output_router_logits"] = True
    # A body that is the whole model (`base_model` falls back to the model itself where its `base_model_prefix`
    # names no attribute: Qwen2.5-Omni's thinker under transformers 5.17) returns the head's output, not hidden states
    if media or _has_head(body):
        with _head_bypassed(hf_model):
            output = hf_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra,
                              **(media or {}))
        hidden = output.logits
    else:
        if packing is not None and attention_mask is None:
            attention_mask = packed_mask_placeholder(input_ids.device)
        output = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
        hidden = output.last_hidden_state
    routing = getattr(output, "router_logits", None) if router_logits else None
    return hidden.flatten(0, 1).index_select(0, predict_index), routing


class ResponseLogitsModel(nn.Module):
    """A causal LM that returns log-probs and entropies at the positions that predict response tokens, its
    head applied chunk by chunk (`token_log_probs`): no logits of prompt tokens, nor full logits of any."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model
        use_packed_attention(language_model(hf_model))
        # A mixture-of-experts model with an auxiliary loss: a forward with gradients keeps its router logits
        # (and its padding mask: None when packed) for the loss, until the next one.
        self.record_router_logits = False
        self.router_logits: tuple[tuple[torch.Tensor, ...], torch.Tensor | None] | None = None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                predict_index: torch.Tensor, head: HeadRequest, packing: PackedAttention | None = None,
                media: dict[str, torch.Tensor] | None = None) -> TokenLogProbs:
        record = self.record_router_logits and torch.is_grad_enabled()
        hidden, routing = _response_hidden(self.hf_model, self.hf_model.base_model, input_ids, attention_mask,
                                           position_ids, predict_index, packing, media, router_logits=record)
        self.router_logits = (routing, attention_mask) if routing is not None else None
        return head.apply(hidden, self.hf_model.get_output_embeddings().weight)


class ResponseValueModel(nn.Module):
    """PPO's critic: the policy's transformer body with a scalar value head, returning ``V_t``
    ``[M]`` at the positions that predict response tokens (the state before token t).

    The body starts from the policy checkpoint (its LM head is dropped); the head starts at zero,
    so every value starts at 0 and ``--num-critic-only-steps`` can fit it before the policy moves.
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model.base_model
        # (a multimodal family's top-level config holds no hidden size: its text config does)
        self.value_head = nn.Linear(self.hf_model.config.get_text_config().hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        use_packed_attention(self.hf_model)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                predict_index: torch.Tensor, packing: PackedAttention | None = None) -> torch.Tensor:
        hidden, _ = _response_hidden(self.hf_model, self.hf_model, input_ids, attention_mask, position_ids,
                                     predict_index, packing, None)
        return self.value_head(hidden).squeeze(-1)


class ResponseScoreModel(nn.Module):
    """A reward model: a Hugging Face sequence-classification model with one label
    (``AutoModelForSequenceClassification``, the causal LM's body with a scalar ``score`` head), returning the score
    ``[M]`` after each response token (the hidden state *of* the token, where the model pools a sequence, not the one
    before it as the critic's values). The trainer appends one token to each sequence
    (`FSDPTrainBackend._model_inputs`), so ``predict_index`` holds the response tokens' own positions.

    Its state dict is the Hugging Face model's under ``hf_model.``, so a checkpoint exports as a folder that
    ``AutoModelForSequenceClassification.from_pretrained`` loads and scores as the trainer did."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model  # (its body is reached through it: a second attribute would save it twice)
        use_packed_attention(hf_model.base_model)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                predict_index: torch.Tensor, packing: PackedAttention | None = None) -> torch.Tensor:
        # (``predict_index``: the response tokens' own positions, each sequence having one token appended)
        hidden, _ = _response_hidden(self.hf_model, self.hf_model.base_model, input_ids, attention_mask, position_ids,
                                     predict_index, packing, None)
        return self.hf_model.score(hidden).squeeze(-1)
