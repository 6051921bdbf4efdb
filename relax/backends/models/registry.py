"""The model families Relax trains: one registry, from which docs/models.md is generated (`relax model-docs`) and
against which a checkpoint is checked before a run loads it (`check_supported`).

A family is recognised by its config's ``model_type``. Each supported row is shown end to end on a tiny random
model of that architecture by `tests/backends/models/test_model_families.py` (rollout, reward, training step, weight sync,
checkpoint and resume, `relax export` loaded back by transformers, engine log-probs equal to the trainer's). A
row that cannot work yet carries its reason, and a run on such a checkpoint is refused with it.

What differs between families at run time is read from the config (`traits`): mixture-of-experts layers,
linear-attention layers (their recurrent state would run across the sequences of a packed row, so they train on
padded micro-batches), sliding windows (the same, until the packed attention masks windows), and which of the
engine core's runners serves the family: the paged one (`ENGINE_CORE_MODEL_TYPES`) or the one over the model's own
forward and cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.backends.models.parallel_plans import PLANS


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_types: tuple[str, ...]  # config.model_type values (a multimodal wrapper and its text model)
    inputs: tuple[str, ...]  # text, image, video, audio
    examples: str  # checkpoints of the family on the Hub
    not_supported: str | None = None  # why a run on it is refused (None: supported and tested)
    test_id: str | None = None  # the tiny model tests/backends/models/test_model_families.py builds for the row
    parallel_plan: str = "none"  # its tensor-parallel plan (`parallel_plans.PLANS`)


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("Llama 3", ("llama",), ("text",), "meta-llama/Llama-3.1-8B-Instruct", test_id="llama",
                parallel_plan="dense"),
    ModelFamily("Qwen2.5", ("qwen2",), ("text",), "Qwen/Qwen2.5-7B-Instruct", test_id="qwen2",
                parallel_plan="dense"),
    ModelFamily("Qwen3", ("qwen3",), ("text",), "Qwen/Qwen3-0.6B, Qwen/Qwen3-8B", test_id="qwen3",
                parallel_plan="dense_qk_norm"),
    ModelFamily("Qwen3 MoE", ("qwen3_moe",), ("text",), "Qwen/Qwen3-30B-A3B", test_id="qwen3_moe",
                parallel_plan="moe"),
    ModelFamily("Qwen3-Next", ("qwen3_next",), ("text",), "Qwen/Qwen3-Next-80B-A3B-Instruct", test_id="qwen3_next",
                parallel_plan="hybrid_linear"),
    ModelFamily("Qwen3.5 (text)", ("qwen3_5_text",), ("text",), "Qwen/Qwen3.5 language models",
                test_id="qwen3_5_text",
                parallel_plan="hybrid_linear"),
    ModelFamily("Qwen3.5 MoE (text)", ("qwen3_5_moe_text",), ("text",), "Qwen/Qwen3.5 MoE language models",
                test_id="qwen3_5_moe_text",
                parallel_plan="hybrid_linear"),
    ModelFamily("Qwen3.5 / Qwen3.6 (vision-language)", ("qwen3_5", "qwen3_5_moe"), ("text", "image", "video"),
                "Qwen/Qwen3.5-*", test_id="qwen3_5",
                parallel_plan="hybrid_linear"),
    ModelFamily("Qwen2-VL / Qwen2.5-VL", ("qwen2_vl", "qwen2_5_vl"), ("text", "image", "video"),
                "Qwen/Qwen2.5-VL-3B-Instruct", test_id="qwen2_5_vl",
                parallel_plan="dense"),
    ModelFamily("Qwen3-VL", ("qwen3_vl",), ("text", "image", "video"), "Qwen/Qwen3-VL-8B-Instruct",
                test_id="qwen3_vl",
                parallel_plan="dense_qk_norm"),
    ModelFamily("Qwen3-VL MoE", ("qwen3_vl_moe",), ("text", "image", "video"), "Qwen/Qwen3-VL-30B-A3B-Instruct",
                test_id="qwen3_vl_moe",
                parallel_plan="moe"),
    ModelFamily("Qwen2.5-Omni thinker", ("qwen2_5_omni", "qwen2_5_omni_thinker"), ("text", "image", "video", "audio"),
                "Qwen/Qwen2.5-Omni-7B", test_id="qwen2_5_omni",
                parallel_plan="dense"),
    ModelFamily("Qwen3-Omni MoE thinker", ("qwen3_omni_moe", "qwen3_omni_moe_thinker"),
                ("text", "image", "video", "audio"), "Qwen/Qwen3-Omni-30B-A3B-Instruct", test_id="qwen3_omni_moe",
                parallel_plan="moe"),
    ModelFamily("GLM-4.5 / 4.6 / 4.7 (MoE)", ("glm4_moe",), ("text",), "zai-org/GLM-4.5-Air", test_id="glm4_moe",
                parallel_plan="moe"),
    ModelFamily("GLM-5 (DSA)", ("glm_moe_dsa",), ("text",), "zai-org/GLM-5",
                not_supported="its sparse-attention indexer gives other log-probs in a full forward than in cached "
                "decoding in transformers 5.24 (gaps up to 0.15 nats on a tiny model), so the trainer's policy "
                "would not be the rollout's"),
    ModelFamily("DeepSeek-V3 / Kimi K2 (MLA, MoE)", ("deepseek_v3",), ("text",),
                "deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct", test_id="deepseek_v3",
                parallel_plan="mla_moe"),
    ModelFamily("Kimi K2.5 (vision-language)", ("kimi_k25",), ("text", "image", "video"), "moonshotai/Kimi-K2.5",
                not_supported="its MoonViT image layout (NaViT resize, padding to the merge kernel, its own patch "
                "order) exists only as transformers' torchvision processor, which does not load beside Relax's torch; "
                "Relax's numpy media path lays out the Qwen-VL families only (its language model is DeepSeek-V3's, "
                "which is supported)"),
    ModelFamily("Gemma 3 (text)", ("gemma3_text",), ("text",), "google/gemma-3-1b-it", test_id="gemma3_text",
                parallel_plan="dense_qk_norm"),
)


def family_of(model_type: str) -> ModelFamily | None:
    return next((family for family in FAMILIES if model_type in family.model_types), None)


@dataclass(frozen=True)
class Traits:
    experts: bool
    linear_attention: bool
    sliding_window: bool
    engine_core: bool  # the core's paged runner runs it (else its runner over the model's own forward and cache)

    @property
    def packing_unsupported(self) -> str | None:
        """Why micro-batches of this model cannot be packed rows (None: they can)."""
        if self.linear_attention:
            return "linear-attention layers would carry their state from one packed sequence into the next"
        if self.sliding_window:
            return "the packed attention does not mask sliding windows yet"
        return None


def _layer_types(config: Any) -> set[str]:
    return set(getattr(config, "layer_types", None) or [])


# The families the engine core decodes (`relax.backends.inference.engine_core.decoder`): dense text decoders, and the
# multimodal ones whose language model is a Qwen2 decoder with multimodal rope (mrope sections, not interleaved)
# merging media features into the input embeddings only. The others run on the core's model-cache runner.
ENGINE_CORE_TEXT_TYPES = ("qwen3", "qwen2", "llama")
ENGINE_CORE_MULTIMODAL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni_thinker")
ENGINE_CORE_MODEL_TYPES = ENGINE_CORE_TEXT_TYPES + ENGINE_CORE_MULTIMODAL_TYPES


def traits(config: Any) -> Traits:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = any((getattr(text, name, 0) or 0) > 0 for name in ("num_experts", "n_routed_experts",
                                                                  "num_local_experts"))
    layers = _layer_types(text)
    sliding = bool({"sliding_attention", "chunked_attention"} & layers) or bool(getattr(text, "use_sliding_window",
                                                                                         False))
    return Traits(experts=experts, linear_attention="linear_attention" in layers, sliding_window=sliding,
                  engine_core=config.model_type in ENGINE_CORE_MODEL_TYPES)


class UnsupportedModelError(ValueError):
    pass


def check_supported(config: Any, where: str) -> ModelFamily | None:
    """Refuse a checkpoint of a family that cannot work yet, with the reason; an unknown family passes (the
    Hugging Face path may well run it) and is named in a warning by the caller."""
    family = family_of(config.model_type)
    if family is not None and family.not_supported:
        raise UnsupportedModelError(f"{where}: {family.name} (model_type {config.model_type!r}) is not supported "
                                    f"yet: {family.not_supported} (docs/models.md)")
    return family


def models_markdown() -> str:
    """docs/models.md."""
    lines = [
        "# Supported models",
        "",
        "Generated from `relax/backends/models/registry.py` by `relax model-docs > docs/models.md`; do not edit.",
        "Each supported row runs end to end on a tiny random model of its architecture in",
        "`tests/backends/models/test_model_families.py` (rollout on the embedded engine, reward, training step, weight sync, checkpoint",
        "and resume, `relax export` loaded back by transformers) and its engine log-probs equal the trainer's forward.",
        "The same loop runs in bf16 on CUDA for every supported row (`pytest -m gpu tests/backends/models/test_model_families.py`;",
        "passed on one H200 on 2026-12-02).",
        "A run on a checkpoint of a family that is not supported yet is refused with the reason given here; a",
        "family not listed is tried on the Hugging Face paths with a warning.",
        "",
        "Engine: every family runs on the engine core (continuous batching, per-request sampling streams); `paged` =",
        "its paged runner (the core's decoder over a paged KV pool, CUDA graphs), `model cache` = its runner over the",
        "family's own forward and cache (linear-attention state, MLA latents, sliding windows, deepstack features",
        "included). Packed: training micro-batches",
        "are packed rows of whole samples (else padded, for the reason in the notes).",
        "",
        "Mixture-of-experts models train with their family's auxiliary load-balancing loss where the family defines",
        "one, at its own coefficient when its config turns the loss on, or at `--moe-aux-loss-coef` (0: off;",
        "refused for families without such a loss, e.g. DeepSeek-V3, which balances with routing biases). Expert",
        "weights are synced to the engines with the rest. `--use-rollout-routing-replay` (R3) has the engine record",
        "each token's experts and the policy's forwards take them (docs/training.md; tested on the text MoE rows).",
        "",
        "Tensor parallel: the family's plan (`--tensor-model-parallel-size`; docs/parallelism.md); mixture-of-experts",
        "families also split their experts over data ranks (`--expert-model-parallel-size`).",
        "",
        "| family | model_type | inputs | experts | attention | engine | packed | tensor parallel | status | examples |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for family in FAMILIES:
        row = _row_traits(family)
        status = "supported" if family.not_supported is None else f"not yet: {family.not_supported}"
        lines.append(f"| {family.name} | {', '.join(f'`{t}`' for t in family.model_types)} | "
                     f"{', '.join(family.inputs)} | {row['experts']} | {row['attention']} | {row['engine']} | "
                     f"{row['packed']} | {_plan_cell(family)} | {status} | {family.examples} |")
    return "\n".join(lines) + "\n"


def _plan_cell(family: ModelFamily) -> str:
    plan = PLANS[family.parallel_plan]
    return "no" if not plan.tensor else f"`{plan.name}`: {plan.summary}"


# What the table says of each family's architecture (the defaults of its transformers config).
_ATTENTION = {"qwen3_next": "hybrid: gated DeltaNet + full", "qwen3_5_text": "hybrid: gated DeltaNet + full",
              "qwen3_5_moe_text": "hybrid: gated DeltaNet + full", "qwen3_5": "hybrid: gated DeltaNet + full",
              "deepseek_v3": "MLA", "glm_moe_dsa": "MLA + sparse (DSA)", "kimi_k25": "MLA",
              "gemma3_text": "sliding window + full"}


def _row_traits(family: ModelFamily) -> dict[str, str]:
    from transformers import CONFIG_MAPPING

    model_type = family.model_types[0]
    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001 - a config that needs arguments: say nothing rather than guess
        return {"experts": "?", "attention": _ATTENTION.get(model_type, "full"), "engine": "?", "packed": "?"}
    found = traits(config)
    return {"experts": "yes" if found.experts else "no", "attention": _ATTENTION.get(model_type, "full"),
            "engine": "paged" if found.engine_core else "model cache",
            "packed": "yes" if found.packing_unsupported is None else f"no ({found.packing_unsupported})"}
