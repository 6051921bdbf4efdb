"""MoE experts as grouped GEMMs in the compute dtype (`grouped_experts`, issue 30): the same function as
transformers' experts in float32 for every MoE family, the same bf16 computation under the master weights as under
autocast with float32 gradients, and a permutation whose backward is exact for any routing."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.backends.training.fsdp import FSDPTrainBackend
from relax.backends.training.grouped_experts import (
    IMPLEMENTATION,
    _FromExpertRows,
    _ToExpertRows,
    set_master_weight_casts,
    use_grouped_experts,
)
from relax.backends.training.master_weights import MasterWeightCasts, use_master_weight_linears
from tests.backends.training.test_packing import LOSS, _rl_batch, _settings
from tests.support.tiny_families import TEXT_CONFIGS, build_text_family

MOE_FAMILIES = [name for name, config in TEXT_CONFIGS.items() if "num_experts" in config]


def _experts(model):
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "num_experts")]


def _forward_backward(model, ids, autocast=False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
    (logits.float().square().mean()).backward()
    return logits.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_moe_family_computes_what_transformers_eager_experts_compute(family, tmp_path):
    model_dir = build_text_family(family, tmp_path / family)
    eager = transformers.AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager")
    grouped = copy.deepcopy(eager)
    assert use_grouped_experts(grouped) == len(_experts(grouped)) > 0
    assert all(m.config._experts_implementation == IMPLEMENTATION for m in _experts(grouped))
    ids = torch.randint(3, 40, (3, 17), generator=torch.Generator().manual_seed(1))
    expected_logits, expected_grads = _forward_backward(eager, ids)
    logits, grads = _forward_backward(grouped, ids)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_master_weight_casts_give_autocasts_bf16_experts_with_float32_gradients(tmp_path):
    model_dir = build_text_family("qwen3_moe", tmp_path / "moe")
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    use_grouped_experts(base)
    autocast, fused = base, copy.deepcopy(base)
    casts = MasterWeightCasts(torch.bfloat16)
    use_master_weight_linears(fused, casts)
    assert set_master_weight_casts(fused, casts) == len(_experts(fused))
    ids = torch.randint(3, 40, (2, 21), generator=torch.Generator().manual_seed(2))
    expected_logits, expected_grads = _forward_backward(autocast, ids, autocast=True)
    with casts.scope():
        logits, grads = _forward_backward(fused, ids, autocast=True)
        # a second micro-batch sums into the same float32 gradients
        _, twice = _forward_backward(fused, ids, autocast=True)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)  # the same bf16 products
    for name, grad in grads.items():
        assert grad.dtype == torch.float32
        # autocast rounds each weight gradient to bf16 before the float32 sum; the fused path does not
        torch.testing.assert_close(grad, expected_grads[name], rtol=2e-2, atol=1e-6, msg=name)
        torch.testing.assert_close(twice[name], 2 * grad, rtol=1e-6, atol=1e-9, msg=name)


routings = st.tuples(st.integers(1, 9), st.integers(1, 4), st.integers(1, 6)).flatmap(
    lambda nke: st.tuples(st.just(nke), st.lists(st.lists(st.integers(0, nke[2] - 1), min_size=nke[1],
                                                          max_size=nke[1]), min_size=nke[0], max_size=nke[0])))


@settings(max_examples=40, deadline=None)
@given(routings)
def test_the_permutation_to_expert_rows_and_back_is_exact_with_gathers_only(routing):
    (num_tokens, top_k, _), experts = routing
    index = torch.tensor(experts)  # repeated experts per token and experts that get no token included
    _, order = torch.sort(index.reshape(-1), stable=True)
    unsorted = torch.empty_like(order)
    unsorted[order] = torch.arange(order.numel())
    x = torch.randn(num_tokens, 5, dtype=torch.float64, requires_grad=True)
    rows = _ToExpertRows.apply(x, order, unsorted, top_k)
    assert torch.equal(rows, x[order // top_k])
    assert torch.autograd.gradcheck(lambda t: _ToExpertRows.apply(t, order, unsorted, top_k), (x,))
    y = torch.randn(num_tokens * top_k, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _FromExpertRows.apply(t, order, unsorted, top_k), (y,))
    # the round trip sums each token's k copies
    torch.testing.assert_close(_FromExpertRows.apply(rows, order, unsorted, top_k), x * top_k)


def test_the_trainer_steps_the_same_with_either_experts_implementation(tmp_path):
    model_dir = build_text_family("qwen3_moe", tmp_path / "moe")
    results = []
    for grouped in (False, True):
        torch.manual_seed(0)
        backend = FSDPTrainBackend(model_dir, dataclasses.replace(_settings(), moe_grouped_gemm=grouped))
        metrics = backend.train_step(_rl_batch(), LOSS)
        results.append((metrics, {n: p.detach().clone() for n, p in backend.model.named_parameters()}))
        backend.release()
    (m0, w0), (m1, w1) = results
    for key in ("loss", "grad_norm"):
        assert float(m1[key]) == pytest.approx(float(m0[key]), rel=1e-5)
    for name, weight in w1.items():
        # (Adam's first step moves a weight by about lr whatever its gradient's size: float32 sums taken in
        # another order move near-zero gradients' weights by up to 1e-6 of lr 1e-3)
        torch.testing.assert_close(weight, w0[name], rtol=1e-5, atol=5e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_weight_gradients_are_the_float32_sums_of_bf16_products():
    from relax.backends.training.grouped_experts import _weight_grads

    generator = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([0, 40, 7, 0, 81])  # empty experts too
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    grad_out = torch.randn(int(counts.sum()), 48, device="cuda", generator=generator).bfloat16()
    x = torch.randn(int(counts.sum()), 64, device="cuda", generator=generator).bfloat16()
    grads = _weight_grads(grad_out, x, offsets)
    starts = [0, *offsets.tolist()[:-1]]
    expected = torch.stack([grad_out[s:e].double().t() @ x[s:e].double() for s, e in zip(starts, offsets.tolist())])
    assert grads.shape == (5, 48, 64)
    torch.testing.assert_close(grads.double(), expected, rtol=1e-2 if grads.dtype == torch.bfloat16 else 1e-5,
                               atol=1e-3 if grads.dtype == torch.bfloat16 else 1e-4)
    print("weight-gradient dtype on this card:", grads.dtype)
