"""Qwen3's query/key norms and RoPE in one pass (`fused_qk_rope`): its reference math is the separate kernels', and
the fused attention forward gives the packed forward and gradients of the layer's own code. On CPU the fused forward
computes the reference in torch; `tests/e2e/test_gpu_smoke.py` checks the Triton kernels against it on the GPU."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.backends.training import fused_qk_rope, varlen_attention
from relax.backends.training.compiled_norm import rms_norm_reference
from relax.backends.training.fused_qk_rope import fuse_qk_norm_rope, qk_norm_rope_reference
from tests.support.tiny_families import build_text_family


def _hf_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps):
    """Hugging Face's order with the separate kernels' math: each head normalised, transposed, rotated."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    q, k = rms_norm_reference(q, q_weight, eps).transpose(1, 2), rms_norm_reference(k, k_weight, eps).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float())
    return q.transpose(1, 2), k.transpose(1, 2)


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 9), heads=st.sampled_from([(4, 2), (2, 2), (6, 1)]), dim=st.sampled_from([4, 8, 16]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_the_reference_is_norm_then_rotary_embedding(tokens, heads, dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, tokens, heads[0], dim, generator=generator).to(dtype)
    k = torch.randn(1, tokens, heads[1], dim, generator=generator).to(dtype)
    q_weight, k_weight = (1 + 0.2 * torch.randn(dim, generator=generator) for _ in range(2))
    angles = torch.randn(1, tokens, dim // 2, generator=generator)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    fused = qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, 1e-6)
    separate = _hf_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, 1e-6)
    for got, want in zip(fused, separate):
        assert got.dtype == dtype and got.shape == want.shape
        # one rounding of the rotated value (bf16: half a unit in the last place of the largest entry)
        torch.testing.assert_close(got.float(), want, atol=0 if dtype == torch.float32 else 2e-2, rtol=1e-5)


def _packed_inputs(lengths: list[int], vocab: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (1, sum(lengths)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    boundaries = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packing = varlen_attention.PackedAttention.of(boundaries, max(lengths), torch.device("cpu"))
    return ids, positions, packing


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_the_fused_layers_give_the_packed_forward_and_gradients_of_the_stock_ones(family, tmp_path, monkeypatch):
    calls, real = [], fused_qk_rope.fused_qk_norm_rope
    monkeypatch.setattr(fused_qk_rope, "fused_qk_norm_rope", lambda *args: calls.append(1) or real(*args))
    implementation = varlen_attention.register()
    stock = transformers.AutoModelForCausalLM.from_pretrained(build_text_family(family, tmp_path),
                                                              attn_implementation=implementation)
    fused = copy.deepcopy(stock)
    assert fuse_qk_norm_rope(fused.model) == stock.config.num_hidden_layers
    assert fuse_qk_norm_rope(fused.model) == 0  # installed once
    for lengths in ([5, 1, 9], [3]):
        ids, positions, packing = _packed_inputs(lengths, stock.config.vocab_size, seed=len(lengths))
        # (as the trainer's forwards: no cache)
        outputs = [model(input_ids=ids, position_ids=positions, use_cache=False, relax_packed=packing).logits
                   for model in (stock, fused)]
        assert len(calls) == stock.config.num_hidden_layers  # every layer's fused path ran
        calls.clear()
        torch.testing.assert_close(outputs[1], outputs[0], atol=2e-5, rtol=1e-4)
        upstream = torch.randn_like(outputs[0])
        for model, out in zip((stock, fused), outputs):
            model.zero_grad()
            (out * upstream).sum().backward()
        grads = {name: p.grad for name, p in stock.named_parameters() if p.grad is not None}
        assert any(".q_norm." in name for name in grads) and any(".k_norm." in name for name in grads)
        for name, p in fused.named_parameters():
            torch.testing.assert_close(p.grad, grads[name], atol=5e-5, rtol=1e-4, msg=name)


def test_a_forward_that_is_not_packed_runs_the_stock_code(tmp_path):
    stock = transformers.AutoModelForCausalLM.from_pretrained(build_text_family("qwen3", tmp_path),
                                                              attn_implementation=varlen_attention.register())
    fused = copy.deepcopy(stock)
    fuse_qk_norm_rope(fused.model)
    ids = torch.randint(stock.config.vocab_size, (2, 6))
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    want = stock(input_ids=ids, attention_mask=mask).logits
    with pytest.MonkeyPatch.context() as patch:  # the fused kernel is not reached
        patch.setattr("relax.backends.training.fused_qk_rope.fused_qk_norm_rope", None)
        got = fused(input_ids=ids, attention_mask=mask).logits
        cached = fused(input_ids=ids, attention_mask=mask, use_cache=True)
    assert torch.equal(got, want)
    assert cached.past_key_values is not None


def test_only_per_head_query_key_norms_are_fused(tmp_path):
    llama = transformers.AutoModelForCausalLM.from_pretrained(build_text_family("llama", tmp_path / "llama"))
    assert fuse_qk_norm_rope(llama.model) == 0
