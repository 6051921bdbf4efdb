"""The forward of the text decoders the core runs, over the Hugging Face model's own modules and weights.

Qwen3, Qwen2 and Llama (and their fine-tunes) share one layer shape: RMSNorm, q/k/v projections (Qwen3 also
normalises q and k per head), rotary positions, attention, o projection, a gated MLP. The core calls the
model's norms, projections and MLP as they are and replaces only the attention with the paged one
(`attention.attend`), over packed tokens ``[T, hidden]`` with no padding. Using the model's parameters in place
means a weight update (an in-place copy) reaches the core, and CUDA graphs captured on them stay valid.

Rotary embeddings come from the model's own rotary module, evaluated once for every position up to
``max_position_embeddings`` (position-only rope types: a type whose frequencies depend on the sequence
length is not supported). The vision-language and omni families whose language model is such a decoder with
multimodal rope (Qwen2-VL, Qwen2.5-VL, the Qwen2.5-Omni thinker) run here too: their prompts' embeddings (media
features merged in) and 3D rope come from `media.MediaEncoder` and reach `forward` as ``embeds`` and ``rope``;
their decode positions are plain ones shifted by the prompt's rope delta, where the three rope axes agree and
multimodal rope is ordinary rope. Other families (mixture-of-experts, sliding windows, Qwen3-VL's deepstack
features) run on the core's other runner, `cache_runner`, over the model's own forward.
"""

from __future__ import annotations

import torch
from torch import nn

from relax.backends.inference.engine_core import weight_layouts
from relax.backends.inference.engine_core.attention import StepMetadata, attend
from relax.backends.inference.engine_core.kv_cache import LayerKV
from relax.backends.inference.engine_core.merged_projections import LayerGroups, layer_groups
from relax.backends.models.registry import ENGINE_CORE_MODEL_TYPES, ENGINE_CORE_MULTIMODAL_TYPES

POSITION_ONLY_ROPE_TYPES = ("default", "linear", "llama3")
DECODER_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


def text_model(model: nn.Module) -> nn.Module | None:
    """The decoder stack of ``model`` (``model.model``, or a multimodal model's ``model.model.language_model``)."""
    inner = getattr(model, "model", None)
    for candidate in (inner, getattr(inner, "language_model", None)):
        if candidate is not None and all(hasattr(candidate, name) for name in DECODER_PARTS):
            return candidate
    return None


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the core cannot run ``model`` (None: it can)."""
    if model.config.model_type not in ENGINE_CORE_MODEL_TYPES:
        return f"model type {model.config.model_type!r} (the core runs {', '.join(ENGINE_CORE_MODEL_TYPES)})"
    if text_model(model) is None or not hasattr(model, "lm_head"):
        return "the model does not have the usual decoder layout (embed_tokens/layers/norm/rotary_emb, lm_head)"
    config = model.config.get_text_config()
    multimodal = model.config.model_type in ENGINE_CORE_MULTIMODAL_TYPES
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in POSITION_ONLY_ROPE_TYPES + (("mrope",) if multimodal else ()):
        return f"rope type {rope_type!r}"
    if multimodal and isinstance(rope, dict) and rope.get("mrope_interleaved"):
        return "interleaved multimodal rope"
    return None


def _fusable(model: nn.Module) -> bool:
    config, inner = model.config.get_text_config(), text_model(model)
    layer = inner.layers[0]
    return (getattr(config, "hidden_act", None) == "silu"
            and all(hasattr(layer.mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))
            and all(getattr(norm, "variance_epsilon", None) == config.rms_norm_eps
                    for norm in (layer.input_layernorm, layer.post_attention_layernorm, inner.norm)))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class LayerProducts:
    """One decoder layer's products for the fused forward, in the model's dtype: q/k/v and gate/up one product
    each over stacked weights (`merged_projections`; one by one through the linears' own forwards where those
    were replaced). `engine_core.fp8.Fp8LayerProducts` is the FP8 counterpart."""

    quantized = False  # the RMSNorm kernel hands `qkv` and `mlp` rows in the model's dtype

    def __init__(self, layer: nn.Module, groups: LayerGroups) -> None:
        self.layer, self.qkv, self.gate_up = layer, groups.qkv, groups.gate_up

    def o(self, attended: torch.Tensor) -> torch.Tensor:
        return self.layer.self_attn.o_proj(attended)  # looked up each call, as the model's forward does

    def mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        from relax.backends.inference.engine_core.triton_ops import silu_mul

        return self.layer.mlp.down_proj(silu_mul(*self.gate_up(hidden)))


class TextDecoder:
    """``forward(input_ids [T], positions [T], pools, metadata) -> hidden [T, hidden]`` after the final norm;
    `logits` applies the LM head (in the model dtype, then float32, as the training forward does) and masks
    ``suppressed_ids`` (media placeholders, which a model must never write) to -inf, as the cache runner does."""

    def __init__(self, model: nn.Module, max_positions: int, fused: bool = False,
                 suppressed_ids: torch.Tensor | None = None) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the engine core cannot run this model: {reason}")
        inner = text_model(model)
        self.model = model
        self.text_model = inner
        self.embed_tokens = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = model.lm_head
        attention = self.layers[0].self_attn
        config = model.config.get_text_config()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(attention, "head_dim", config.hidden_size // config.num_attention_heads)
        self.scale = getattr(attention, "scaling", self.head_dim ** -0.5)
        self.has_qk_norm = hasattr(attention, "q_norm")
        self.eps = float(config.rms_norm_eps)
        # The fused kernels (CUDA) assume the layer shape below: gated SiLU MLP, RMSNorms with one epsilon.
        self.fused = fused and _fusable(model)
        parameter = next(model.parameters())
        with torch.no_grad():
            positions = torch.arange(max_positions, device=parameter.device)[None]
            if model.config.model_type in ENGINE_CORE_MULTIMODAL_TYPES:  # multimodal rope takes [3, batch, positions]
                positions = positions.expand(3, 1, -1)
            cos, sin = inner.rotary_emb(parameter[:1].to(parameter.dtype), positions)
        self.cos, self.sin = cos[0], sin[0]  # [max_positions, head_dim], in the model dtype as in its forward
        self.suppressed_ids = suppressed_ids if suppressed_ids is not None and suppressed_ids.numel() else None
        # each layer's products by the input they read: q/k/v (and, on the fused path, gate/up) one product over
        # stacked weights; each group owns its weights' layout (`choose_weight_layouts`)
        self.groups = [layer_groups(layer) for layer in self.layers]
        # the fused forward's products, a strategy: the model dtype's, or FP8 ones (`use_products`)
        self.products = [LayerProducts(layer, groups) for layer, groups in zip(self.layers, self.groups)] \
            if self.fused else []
        self.weight_layouts: dict = {}  # kind -> `weight_layouts.LayoutTiming`, once chosen

    def use_products(self, products: list) -> None:
        """Each layer's products in the fused forward from now on (`engine_core.fp8.Fp8LayerProducts`); before
        CUDA graphs are captured."""
        if not self.fused or len(products) != len(self.layers):
            raise ValueError("products replace the fused forward's, one per layer")
        self.products = products

    def choose_weight_layouts(self, rows: int) -> dict:
        """Lay each kind of the fused forward's bf16 products out as it runs fastest at ``rows`` rows on this card
        (`weight_layouts.choose`); the timings by kind. Nothing to choose for FP8 products or the unfused forward."""
        if not self.fused or self.products[0].quantized:
            return {}
        self.weight_layouts = weight_layouts.choose(self.groups, rows)
        return self.weight_layouts

    def merge_projections(self) -> None:
        """Stack each layer's projection groups again where the weights were given storage of their own
        (`MergedLinears.merge`): before decode graphs are captured on them."""
        for group in (group for groups in self.groups for group in groups if group is not None):
            group.merge()

    def release_projections(self) -> None:
        for group in (group for groups in self.groups for group in groups if group is not None):
            group.release()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerKV],
                metadata: StepMetadata, embeds: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``embeds [T, hidden]`` (a fresh tensor) replaces the token embeddings and ``rope`` (cos, sin ``[T, D]``)
        the rotary tables at ``positions``: a multimodal prefill's merged media features and 3D rope."""
        if self.fused:
            return self._fused_forward(input_ids, positions, caches, metadata, embeds, rope)
        hidden = self.embed_tokens(input_ids) if embeds is None else embeds
        cos, sin = (self.cos[positions], self.sin[positions]) if rope is None else rope
        cos, sin = cos[:, None], sin[:, None]  # [T, 1, D]
        tokens = hidden.shape[0]
        for layer, groups, cache in zip(self.layers, self.groups, caches):
            attention = layer.self_attn
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            query, key, value = groups.qkv(hidden)
            query = query.reshape(tokens, self.num_heads, self.head_dim)
            key = key.reshape(tokens, self.num_kv_heads, self.head_dim)
            value = value.reshape(tokens, self.num_kv_heads, self.head_dim)
            if self.has_qk_norm:
                query, key = attention.q_norm(query), attention.k_norm(key)
            query = query * cos + _rotate_half(query) * sin
            key = key * cos + _rotate_half(key) * sin
            cache.write(metadata.slot_mapping, key, value)
            hidden = residual + attention.o_proj(attend(query, cache, metadata, self.scale))
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.norm(hidden)

    def _fused_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerKV],
                       metadata: StepMetadata, embeds: torch.Tensor | None,
                       rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The same forward with the pointwise stages fused (`triton_ops`): a residual add and the next RMSNorm
        in one kernel; q/k norms, rotary positions and the K/V store in one. The products are the layers'
        `products`; FP8 ones take their inputs quantised by the kernels before them and hand back products whose
        scales the kernels after them apply (`engine_core.fp8`)."""
        from relax.backends.inference.engine_core.triton_ops import add_rms_norm, qk_norm_rope_store

        residual = self.embed_tokens(input_ids) if embeds is None else embeds  # updated in place below
        cos, sin = self.cos, self.sin
        if rope is not None:  # per-token tables: token i reads row i
            (cos, sin), positions = rope, torch.arange(input_ids.shape[0], device=input_ids.device)
        quantized = self.products[0].quantized
        hidden = add_rms_norm(residual, self.layers[0].input_layernorm.weight, self.eps, quantize=quantized)
        for index, (layer, products, cache) in enumerate(zip(self.layers, self.products, caches)):
            attention = layer.self_attn
            query = qk_norm_rope_store(
                *products.qkv(hidden),
                attention.q_norm.weight if self.has_qk_norm else None,
                attention.k_norm.weight if self.has_qk_norm else None, self.eps, cos, sin, positions,
                metadata.slot_mapping, cache)
            out = products.o(attend(query, cache, metadata, self.scale))
            hidden = add_rms_norm(out, layer.post_attention_layernorm.weight, self.eps, residual=residual,
                                  quantize=quantized)
            out = products.mlp(hidden)
            last = index + 1 == len(self.layers)
            following = self.norm if last else self.layers[index + 1].input_layernorm
            hidden = add_rms_norm(out, following.weight, self.eps, residual=residual, quantize=quantized and not last)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.suppressed_ids is not None:
            logits.index_fill_(-1, self.suppressed_ids, float("-inf"))
        return logits

    def logits_into(self, hidden: torch.Tensor, out: torch.Tensor) -> None:
        """`logits` written into ``out [T, V]`` in the model dtype, for samplers that read it as float32 (each
        value the same: float32 holds every bf16 value). At batch 256 a float32 copy of the logits is 155 MB
        written and read again per decode step, a twentieth of a 0.6B step's time."""
        head = self.lm_head
        # a head with a forward of its own (a subclass, a wrapper, a patched instance) is called as it is
        if head.bias is None and type(head) is nn.Linear and "forward" not in head.__dict__:
            torch.mm(hidden, head.weight.t(), out=out)
        else:
            out.copy_(head(hidden))
        if self.suppressed_ids is not None:
            out.index_fill_(-1, self.suppressed_ids, float("-inf"))
