"""Gradient-accumulation fusion (`master_weights`): bf16 compute from float32 master weights cast once per step,
weight gradients summed in float32. On CPU `accumulate_grad` takes its float32 fallback; the GPU suite runs
the cuBLAS path (tests/e2e/test_gpu_smoke.py)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from relax.backends.training.fsdp import FSDPTrainBackend
from relax.backends.training.log_probs import token_log_probs
from relax.backends.training.master_weights import (
    MasterWeightCasts,
    accumulate_grad,
    shared_input_linears,
    use_master_weight_linears,
)
from tests.backends.training.test_packing import LOSS, _rl_batch, _settings

BF16 = torch.bfloat16


def _micro_batches(count=3, rows=5, width=16, out=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, rows, width, generator=generator), torch.randn(2, rows, out, generator=generator))
            for _ in range(count)]


def test_linear_weight_gradient_is_the_exact_float32_sum_over_micro_batches():
    torch.manual_seed(0)
    fused, plain = nn.Linear(16, 8, bias=False), nn.Linear(16, 8, bias=False)
    plain.load_state_dict(fused.state_dict())
    casts = MasterWeightCasts(BF16)
    assert use_master_weight_linears(fused, casts) == 1
    batches = _micro_batches()
    with casts.scope():
        for x, g in batches:
            x = x.requires_grad_()
            out = fused(x)
            with torch.autocast("cpu", dtype=BF16):
                reference = plain(x.detach())
            assert out.dtype == BF16 and torch.equal(out, reference)  # the same bf16 product as autocast's
            (out.float() * g).sum().backward()
            with torch.autocast("cpu", dtype=BF16):
                plain_x = x.detach().clone().requires_grad_()
                plain_out = plain(plain_x)
            (plain_out.float() * g).sum().backward()
            torch.testing.assert_close(x.grad, plain_x.grad, atol=0, rtol=0)
    exact = sum(g.to(BF16).float().flatten(0, 1).T @ x.to(BF16).float().flatten(0, 1) for x, g in batches)
    assert fused.weight.grad.dtype == torch.float32
    torch.testing.assert_close(fused.weight.grad, exact, atol=1e-5, rtol=1e-5)
    # autocast rounds each micro-batch's gradient to bf16 before the float32 sum: the fused sum is closer
    assert (fused.weight.grad - exact).abs().max() < (plain.weight.grad - exact).abs().max()


def test_bias_and_frozen_weights():
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    frozen = nn.Linear(8, 4, bias=False).requires_grad_(False)
    model = nn.Sequential(layer, frozen)
    casts = MasterWeightCasts(BF16)
    assert use_master_weight_linears(model, casts) == 2
    x, _ = _micro_batches(count=1)[0]
    model(x).float().sum().backward()
    assert layer.bias.grad is not None and layer.bias.grad.dtype == torch.float32
    assert layer.weight.grad is not None and frozen.weight.grad is None
    with torch.no_grad():  # a no-grad forward writes no gradient
        layer.weight.grad = None
        model(x)
    assert layer.weight.grad is None


def test_weights_are_cast_once_per_scope_and_again_after_it():
    weight = nn.Parameter(torch.randn(4, 3))
    casts = MasterWeightCasts(BF16)
    assert casts.cast(weight) is not casts.cast(weight)  # outside a scope: a fresh cast per call
    with casts.scope():
        first = casts.cast(weight)
        with casts.scope():  # nested scopes share the outer cache
            assert casts.cast(weight) is first
    with torch.no_grad():
        weight.add_(1.0)
    with casts.scope():
        assert torch.equal(casts.cast(weight), weight.detach().to(BF16))  # the update is seen by the next scope


@pytest.mark.parametrize("preexisting", [False, True])
def test_accumulate_grad_adds_into_an_existing_float32_gradient(preexisting):
    param = nn.Parameter(torch.zeros(3, 5))
    a, b = torch.randn(3, 7).to(BF16), torch.randn(7, 5).to(BF16)
    if preexisting:
        param.grad = torch.ones(3, 5)
    accumulate_grad(param, a, b)
    expected = a.float() @ b.float() + (1.0 if preexisting else 0.0)
    torch.testing.assert_close(param.grad, expected)


def test_chunked_head_sums_a_tied_weight_gradient_into_the_master():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(7, 6, generator=generator)
    master = nn.Parameter(torch.randn(11, 6, generator=generator))
    ids = torch.randint(0, 11, (7, 1), generator=generator)
    grads = []
    for casts in (None, MasterWeightCasts(BF16)):
        master.grad = torch.ones_like(master)  # e.g. the tied embedding's gradient, already there
        h = hidden.clone().requires_grad_()
        out = token_log_probs(h, master, ids, chunk_size=3, compute_dtype=BF16, weight_casts=casts,
                              entropy_grad=True)
        (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
        grads.append((out.log_probs.detach(), h.grad, master.grad.clone()))
    (lp_plain, h_plain, w_plain), (lp_fused, h_fused, w_fused) = grads
    assert torch.equal(lp_fused, lp_plain) and torch.equal(h_fused, h_plain)
    torch.testing.assert_close(w_fused, w_plain, atol=2e-2, rtol=1e-2)  # plain rounds the head's gradient to bf16


def test_backend_step_with_fusion_matches_autocast_and_casts_once(tiny_workspace):
    model_dir = tiny_workspace / "model"
    batch = _rl_batch()
    results = []
    for fusion in (False, True):
        settings = dataclasses.replace(_settings(compute_dtype=BF16, max_tokens_per_gpu=24),
                                       gradient_accumulation_fusion=fusion)
        backend = FSDPTrainBackend(model_dir, settings)
        assert (backend._weight_casts is not None) == fusion
        metrics = backend.train_step(batch, LOSS)
        grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
        results.append((metrics, grads))
    (m_plain, g_plain), (m_fused, g_fused) = results
    assert g_plain.keys() == g_fused.keys()
    for name in g_plain:
        assert g_fused[name].dtype == torch.float32
        torch.testing.assert_close(g_fused[name], g_plain[name], atol=5e-3, rtol=5e-2, msg=name)
    assert abs(m_fused["loss"] - m_plain["loss"]) < 1e-2
    # a frozen model loads in bf16: nothing to cast, nothing patched
    frozen = FSDPTrainBackend(model_dir, _settings(compute_dtype=BF16), trainable=False)
    assert frozen._weight_casts is None


def test_the_residual_stream_is_in_the_compute_dtype_and_learns_as_the_float32_one(tiny_workspace):
    """`embed_in_compute_dtype`: with the embedding's output cast, every decoder layer takes (and the residual stream
    carries) bf16 hidden states; without it they are float32 under autocast (the path before). The step's loss and
    every float32 master gradient, the embedding's included, agree up to bf16 rounding."""
    model_dir = tiny_workspace / "model"
    batch = _rl_batch()
    results = {}
    for cast in (False, True):
        settings = dataclasses.replace(_settings(compute_dtype=BF16, max_tokens_per_gpu=24),
                                       activations_in_compute_dtype=cast)
        backend = FSDPTrainBackend(model_dir, settings)
        seen = set()
        layers = [m for m in backend.model.modules() if type(m).__name__.endswith("DecoderLayer")]
        assert layers
        for layer in layers:
            layer.register_forward_pre_hook(lambda module, args, kwargs, seen=seen: seen.add(
                args[0].dtype if args else kwargs["hidden_states"].dtype), with_kwargs=True)
        metrics = backend.train_step(batch, LOSS)
        grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
        results[cast] = (seen, metrics, grads)
    assert results[True][0] == {BF16} and results[False][0] == {torch.float32}
    (_, m_before, g_before), (_, m_cast, g_cast) = results[False], results[True]
    assert g_before.keys() == g_cast.keys() and any("embed" in name for name in g_cast)
    for name in g_before:
        assert g_cast[name].dtype == torch.float32
        torch.testing.assert_close(g_cast[name], g_before[name], atol=1e-2, rtol=1e-1, msg=name)
    assert abs(m_cast["loss"] - m_before["loss"]) < 2e-2


@settings(max_examples=15, deadline=None)
@given(outs=st.lists(st.integers(1, 9), min_size=1, max_size=3), bias=st.booleans(), frozen=st.booleans(),
       dtype=st.sampled_from([BF16, torch.float32]), seed=st.integers(0, 2**16))
def test_shared_input_linears_give_each_linears_outputs_and_gradients(outs, bias, frozen, dtype, seed):
    """`shared_input_linears` (q/k/v, gate/up: the input gradient summed inside the GEMMs) against each linear's own
    forward: the same outputs and weight gradients bit for bit, the input gradient up to the order of its sum's
    roundings; a frozen weight or a linear outside the casts takes the linears' own path."""
    torch.manual_seed(seed)
    shared = [nn.Linear(12, n, bias=bias) for n in outs]
    own = [nn.Linear(12, n, bias=bias) for n in outs]
    for a, b in zip(shared, own):
        b.load_state_dict(a.state_dict())
        a.requires_grad_(not frozen), b.requires_grad_(not frozen)
    casts = MasterWeightCasts(dtype)
    for linears in (shared, own):
        use_master_weight_linears(nn.ModuleList(linears), casts)
    x = torch.randn(2, 5, 12)
    grads = [torch.randn(2, 5, n) for n in outs]
    results = []
    with casts.scope():
        for linears, run in ((shared, lambda x: shared_input_linears(x, tuple(shared))),
                             (own, lambda x: tuple(linear(x) for linear in own))):
            xi = x.clone().requires_grad_()
            got = run(xi)
            torch.autograd.backward(got, [g.to(out.dtype) for g, out in zip(grads, got)])
            results.append((got, xi.grad, [(lin.weight.grad, lin.bias.grad if bias else None) for lin in linears]))
    (got, grad_x, params), (want, want_x, want_params) = results
    nodes = {id(_linears_node(out.grad_fn)) for out in got}
    assert (_linears_node(got[0].grad_fn) is None) == frozen
    assert frozen or len(nodes) == 1  # one backward for all the linears of the input
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    torch.testing.assert_close(grad_x, want_x, atol=2e-2 if dtype == BF16 else 1e-6, rtol=1e-2)
    for (weight, b), (want_weight, want_b) in zip(params, want_params):
        assert (weight is None) == frozen and (weight is None or torch.equal(weight, want_weight))
        assert (b is None) == (not bias or frozen) and (b is None or torch.equal(b, want_b))


def _linears_node(node, depth: int = 3):
    """The `_MasterWeightLinears` backward node behind an output (through a bias's add), or None."""
    if node is None or depth < 0:
        return None
    if type(node).__name__ == "_MasterWeightLinearsBackward":
        return node
    return next((found for child, _ in node.next_functions if (found := _linears_node(child, depth - 1))), None)


def test_shared_input_linears_fall_back_without_the_casts():
    torch.manual_seed(0)
    linears = (nn.Linear(4, 3), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    got = shared_input_linears(x, linears)
    assert all(torch.equal(a, linear(x)) for a, linear in zip(got, linears))
    # the path before, kept as the benchmark's baseline: the casts say so
    use_master_weight_linears(nn.ModuleList(linears), MasterWeightCasts(BF16, share_input_gradients=False))
    got = shared_input_linears(x, linears)
    nodes = [_linears_node(out.grad_fn) for out in got]
    assert all(node is not None for node in nodes) and nodes[0] is not nodes[1]  # each linear's own backward
