"""A tiny Llama and the quickstart's tokenizer written to a GGUF file by the `gguf` package, as llama.cpp's converter
lays one out (tensor names from gguf's own map, query and key rows permuted for its rotary layout, a byte-level BPE
vocabulary), in float32 or Q8_0."""

from __future__ import annotations

from pathlib import Path

import gguf
import torch
import transformers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.support.tiny_assets import build_tokenizer

HEADS, KV_HEADS, LAYERS = 4, 2, 2


def _rotary_rows(weight, heads: int):
    """llama.cpp's order of a query or key projection's rows (its rotary pairs adjacent)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def tiny_llama(seed: int = 0) -> tuple[transformers.LlamaForCausalLM, transformers.PreTrainedTokenizerFast]:
    tokenizer = build_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval(), tokenizer


def write_gguf(model: transformers.LlamaForCausalLM, tokenizer, path: Path, quantized: bool = False) -> Path:
    """``model`` and ``tokenizer`` as a GGUF file at ``path``; ``quantized``: its matrices in Q8_0."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"] if getattr(config, "rope_parameters", None)
                              else config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    vocab = tokenizer.get_vocab()
    special = set(tokenizer.all_special_tokens)
    to_unicode = bytes_to_unicode()
    ordered = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t if t in special else "".join(to_unicode[b] for b in t.encode()) for t in ordered])
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in ordered])
    writer.add_token_scores([0.0] * len(ordered))
    writer.add_token_merges([])  # one character, one token
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            array = _rotary_rows(array, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = _rotary_rows(array, config.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if quantized and array.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
