"""Tiny random models of each family of `relax.backends.models.registry` (by its ``test_id``), built offline from
their transformers configs with the character tokenizer of `tests.support.tiny_assets`: a few layers, four experts, a
48-token vocabulary, so a whole training loop takes seconds on a CPU."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.support.tiny_assets import build_tokenizer

_DENSE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "tie_word_embeddings": False}
_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_routed_experts": 4,
            "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
            "decoder_sparse_step": 1, "norm_topk_prob": True}
# Three gated-DeltaNet layers and one full-attention layer (the families' 3:1 pattern), small linear heads.
_LINEAR = {"num_hidden_layers": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "linear_key_head_dim": 16, "linear_value_head_dim": 16}
_MLA = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "head_dim": 8, "qk_nope_head_dim": 16,
        "v_head_dim": 16, "num_key_value_heads": 4}

TEXT_CONFIGS: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": _EXPERTS,
    "qwen3_next": {**_EXPERTS, **_LINEAR},
    "qwen3_5_text": _LINEAR,
    "qwen3_5_moe_text": {**_EXPERTS, **_LINEAR},
    "glm4_moe": _EXPERTS,
    "deepseek_v3": {**_EXPERTS, **_MLA},
    "gemma3_text": {"sliding_window": 8},
    "glm_moe_dsa": {**_EXPERTS, **_MLA, "index_topk": 8, "index_head_dim": 16, "index_n_heads": 2},
}


def build_text_family(test_id: str, directory: Path, seed: int = 0) -> Path:
    """A tiny random causal LM of ``test_id``'s ``model_type`` and the character tokenizer, saved to ``directory``."""
    tokenizer = build_tokenizer()
    config = transformers.CONFIG_MAPPING[test_id](
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, **{**_DENSE, **TEXT_CONFIGS[test_id]})
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
