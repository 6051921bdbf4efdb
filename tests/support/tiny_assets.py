"""A tiny random Qwen3 with a character tokenizer and an addition dataset, built offline in
a second, for tests of the training machinery (the learning tests use the quickstart model)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = list("0123456789+= abcdefghijklmnopqrstuvwxyz\n")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# ChatML that refuses messages without a user message, as Qwen3's template does ("No user query found in
# messages."): a template's `raise_exception` is bad input to report, not a crash.
REFUSING_CHATML = ("{% if messages | selectattr('role', 'equalto', 'user') | list | length == 0 %}"
                   "{{ raise_exception('No user query found in messages.') }}{% endif %}" + CHATML)


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.add_special_tokens({"additional_special_tokens": SPECIALS})
    hf.chat_template = CHATML
    return hf


# Qwen3's chat template as it behaves (written here, not copied): ChatML; an assistant message of the history keeps
# its reasoning (`reasoning_content`, or the text before `</think>`) only after the last user message; the generation
# prompt opens an empty reasoning block when `enable_thinking` is false (`--apply-chat-template-kwargs`).
QWEN3_TEMPLATE = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "{% set content = m['content'] or '' %}{% set reasoning = m.get('reasoning_content') or '' %}"
    "{% if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_query %}<think>\n{{ reasoning }}\n</think>\n\n{% endif %}{{ content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_qwen3_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer with Qwen3's reasoning tokens and its chat template (`QWEN3_TEMPLATE`)."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [*SPECIALS, "<think>", "</think>"]})
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


def build_tiny_model_dir(directory: Path, seed: int = 0, tokenizer: PreTrainedTokenizerFast | None = None,
                         **shape) -> Path:
    """The tiny Qwen3 with its tokenizer; ``shape``: config fields that differ (a larger model for a GPU test)."""
    tokenizer = tokenizer or build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen3Config(**{
        "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True,
        "max_position_embeddings": 256, "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None, **shape})
    Qwen3ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_addition_data(path: Path, count: int, seed: int) -> Path:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"input": f"{a}+{b}=", "label": str(a + b)})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
