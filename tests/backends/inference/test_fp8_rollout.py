"""FP8 rollout (`relax.backends.inference.engine_core.fp8`, ``--rollout-fp8``): row-wise quantisation within e4m3's
rounding, FP8 linears close to the full-precision ones, an FP8 engine whose log-probs stay near the full-precision
engine's, and weight syncs that requantise in place (an updated FP8 engine samples exactly as one built from the new
weights); projections that read the same input are one product over their stacked weights, in any call order. torch's ``_scaled_mm`` runs
on CPU, so these run everywhere; the GPU tests compare with bf16 on CUDA and the Triton quantisation kernel with the
torch one, bit for bit."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from transformers import Qwen3Config, Qwen3ForCausalLM

from relax.backends.inference.base import GenerationRequest, SamplingParams, ScoreRequest
from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine
from relax.backends.inference.engine_core import fp8 as fp8_module
from relax.backends.inference.engine_core.fp8 import Fp8LayerProducts, Fp8Linears, fp8_linear, unscaled_product
from relax.backends.inference.engine_core.fp8_format import FP8, FP8_MAX, Fp8Rows, ScaledProduct, quantize_rows
from relax.cli.args import parse_config
from relax.config import ConfigError
from tests.backends.inference.test_embedded_engine import make_model, make_tokenizer

# e4m3 keeps 3 mantissa bits: a normal value rounds to within 2^-4 of itself; below 2^-6 (subnormal) the spacing is
# a fixed 2^-9 of the row's scale.
RELATIVE = 2.0 ** -4
SUBNORMAL_STEP = 2.0 ** -9


@settings(max_examples=200, deadline=None)
@given(arrays("float32", st.tuples(st.integers(1, 6), st.integers(1, 40)),
              elements=st.floats(-1e4, 1e4, allow_nan=False, width=32)),
       st.sampled_from([1e-6, 1.0, 1e3]))
def test_rows_quantise_within_e4m3_rounding(values, magnitude):
    matrix = torch.from_numpy(values) * magnitude
    quantized, scale = quantize_rows(matrix)
    assert quantized.dtype == FP8 and scale.shape == (matrix.shape[0], 1)
    restored = quantized.float() * scale
    amax = matrix.abs().amax(dim=1, keepdim=True)
    assert torch.all(restored.abs().amax(dim=1, keepdim=True) <= amax * (1 + RELATIVE) + 1e-30)
    bound = matrix.abs() * RELATIVE + scale * SUBNORMAL_STEP
    assert torch.all((restored - matrix).abs() <= bound * 1.0001), (restored - matrix).abs().max()
    assert torch.all(restored[amax.squeeze(1) == 0] == 0)  # a zero row stays zero (no 0 / 0)


def test_the_largest_value_of_a_row_maps_to_the_largest_fp8():
    quantized, scale = quantize_rows(torch.tensor([[1.0, -3.0, 0.5], [0.0, 0.0, 0.0]]))
    assert quantized[0].float().abs().max() == FP8_MAX and math.isclose(scale[0, 0].item(), 3.0 / FP8_MAX, rel_tol=1e-6)


def test_an_fp8_linear_is_close_to_the_full_precision_one():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(3, 7, 64), torch.randn(48, 64) * 0.05, torch.randn(48)
    exact = torch.nn.functional.linear(x, weight, bias)
    w8, scale = quantize_rows(weight)
    approx = fp8_linear(x, w8, scale, bias)
    assert approx.shape == exact.shape
    assert ((approx - exact).norm() / exact.norm()).item() < 0.05


def test_the_fp8_product_is_the_product_of_the_dequantised_operands():
    """`_scaled_mm` with row-wise scales equals the float32 product of what the two FP8 operands stand for: the
    scales are applied to the right rows and columns, and what is left is FP8's rounding alone."""
    torch.manual_seed(1)
    x, weight = torch.randn(5, 64) * 3, torch.randn(48, 64) * 0.02
    w8, w_scale = quantize_rows(weight)
    x8, x_scale = quantize_rows(x)
    expected = (x8.float() * x_scale) @ (w8.float() * w_scale).t()
    torch.testing.assert_close(fp8_linear(x, w8, w_scale, None), expected, rtol=1e-5, atol=1e-6)


def _requests(n: int = 4, tokens: int = 12) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", [3 + (i * 5 + j) % 40 for j in range(4 + i)],
                              SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=7 + i)) for i in range(n)]


def _outputs(engine: EmbeddedEngine):
    return [(o.output_ids, o.output_log_probs) for o in asyncio.run(engine.generate(_requests()))]


def _engine(seed: int, fp8: bool) -> EmbeddedEngine:
    return EmbeddedEngine(make_model(seed), make_tokenizer(), core=CoreSettings(mode="on", fp8=fp8))


def _realistic_model(seed: int) -> Qwen3ForCausalLM:
    """A model with the usual initialisation (std 0.02): the conftest's tiny engine model is initialised wide
    (0.3) for peaked distributions, which makes every rounding error large."""
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=64, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return Qwen3ForCausalLM(config).eval()


def test_an_fp8_engine_scores_near_the_full_precision_one():
    """Teacher-forced log-probs of the same sequences, FP8 engine against full precision: FP8's rounding of weights
    and activations, not a wrong scale or layout (which would move them by whole nats)."""
    exact = EmbeddedEngine(_realistic_model(0), make_tokenizer(), core=CoreSettings(mode="on"))
    fp8 = EmbeddedEngine(_realistic_model(0), make_tokenizer(), core=CoreSettings(mode="on", fp8=True))
    assert fp8.fp8 is not None and len(fp8.fp8.linears) == 4 * 7
    sequences = [ScoreRequest([3 + (i * 7 + j * 3) % 60 for j in range(24)], response_length=16) for i in range(4)]
    reference = [o.log_probs for o in asyncio.run(exact.score(sequences))]
    approx = [o.log_probs for o in asyncio.run(fp8.score(sequences))]
    deltas = torch.tensor(reference) - torch.tensor(approx)
    assert 0 < deltas.abs().mean().item() < 0.05 and deltas.abs().max().item() < 0.2, deltas.abs().max()


def test_a_weight_sync_requantises_in_place():
    engine = _engine(0, fp8=True)
    buffers = [linear.fp8_weight.data_ptr() for linear in engine.fp8.linears]
    before = _outputs(engine)
    new_weights = dict(make_model(seed=1).named_parameters())
    asyncio.run(engine.update_weights(new_weights.items(), version=1))
    assert [linear.fp8_weight.data_ptr() for linear in engine.fp8.linears] == buffers  # the same buffers
    after = _outputs(engine)
    assert after != before
    assert after == _outputs(_engine(1, fp8=True))  # as an engine built from the new weights, exactly


@pytest.mark.parametrize("flags, message", [
    (["--rollout-fp8", "--engine-core", "off"], "--rollout-fp8 runs on the paged engine core"),
    (["--rollout-fp8", "--rollout-external", "--rollout-external-engine-addrs", "http://127.0.0.1:1"],
     "--rollout-fp8 quantises the embedded engine"),
])
def test_rollout_fp8_is_refused_where_it_cannot_act(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(["--n-samples-per-prompt", "4", "--num-rollout", "2", *flags])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_on_cuda_scores_near_bf16():
    """On CUDA (the FP8 GEMM of `torch._scaled_mm`, a bf16 model): teacher-forced log-probs of the same sequences
    within the CPU test's tolerance of the bf16 engine's (mean |delta| < 0.05 nats, none above 0.2)."""
    def engine(fp8: bool) -> EmbeddedEngine:
        model = _realistic_model(0).to("cuda", torch.bfloat16)
        return EmbeddedEngine(model, make_tokenizer(), core=CoreSettings(mode="on", fp8=fp8))

    sequences = [ScoreRequest([3 + (i * 7 + j * 3) % 60 for j in range(24)], response_length=16) for i in range(4)]
    reference = [o.log_probs for o in asyncio.run(engine(False).score(sequences))]
    approx = [o.log_probs for o in asyncio.run(engine(True).score(sequences))]
    deltas = torch.tensor(reference) - torch.tensor(approx)
    assert 0 < deltas.abs().mean().item() < 0.05 and deltas.abs().max().item() < 0.2, deltas.abs().max()


def test_projections_that_read_one_input_are_one_product(monkeypatch):
    """A layer quantises 4 activations (q/k/v's input, o's, gate/up's, down's), not 7, and runs 4 FP8 GEMMs: q, k
    and v over their stacked weights, gate and up over theirs. Each projection's output equals its own FP8 product
    (up to the order of the float sums), also when a model calls the group out of order (it multiplies again); the
    stacked weights are the only FP8 copies."""
    model = _realistic_model(0)
    layer = model.model.layers[0]
    x = torch.randn(5, model.config.hidden_size)
    expected = {name: fp8_linear(x, *quantize_rows(getattr(layer.self_attn, name).weight), None)
                for name in ("q_proj", "k_proj", "v_proj")}
    fp8 = Fp8Linears(model.model.layers)
    product = layer.self_attn.q_proj.fp8_shared[0]
    assert all(getattr(layer.self_attn, name).fp8_weight.untyped_storage().data_ptr()
               == product.weight.untyped_storage().data_ptr() for name in ("q_proj", "k_proj", "v_proj"))
    calls, gemms = [], []
    original, scaled_mm = fp8_module.quantize_activations, torch._scaled_mm
    monkeypatch.setattr(fp8_module, "quantize_activations", lambda rows: calls.append(rows.shape) or original(rows))
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: gemms.append(a[1].shape) or scaled_mm(*a, **k))
    for order in (("q_proj", "k_proj", "v_proj"), ("k_proj", "v_proj", "q_proj"), ("q_proj", "k_proj", "v_proj")):
        calls.clear()
        step_input = x.clone()  # a new activation, as each forward's
        for name in order:
            torch.testing.assert_close(getattr(layer.self_attn, name)(step_input), expected[name])
        assert len(calls) == (1 if order[-1] == "v_proj" else 2)  # q, k, v in order: one product
    calls.clear()
    gemms.clear()
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5, 6]]))
    assert len(calls) == len(gemms) == 4 * model.config.num_hidden_layers
    assert all(product.source is None and not product.outputs for product in fp8.products)  # let go


def test_a_stacked_product_keeps_each_projections_bias_through_weight_syncs():
    """Projections with biases (Qwen2's q, k and v): the stacked product adds each one's, and a weight sync (the
    biases written in place, then `requantize`) reaches the product as it reaches the weights."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=True)
    model = Qwen3ForCausalLM(config).eval()
    attention = model.model.layers[1].self_attn
    x = torch.randn(3, 128)

    def expected():
        return {name: fp8_linear(x, *quantize_rows(getattr(attention, name).weight), getattr(attention, name).bias)
                for name in ("q_proj", "k_proj", "v_proj")}

    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(attention, name).bias.normal_()
    fp8 = Fp8Linears(model.model.layers)
    for name, want in expected().items():
        torch.testing.assert_close(getattr(attention, name)(x), want)
    with torch.no_grad():  # a weight sync: new values into the same parameters
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(attention, name).bias.add_(1.0)
            getattr(attention, name).weight.mul_(1.5)
    fp8.requantize()
    for name, want in expected().items():
        torch.testing.assert_close(getattr(attention, name)(x), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("columns", [1, 64, 1000, 2560, 9728])
def test_the_triton_quantisation_equals_the_torch_one_bit_for_bit(columns):
    from relax.backends.inference.engine_core.triton_ops import quantize_rows_fp8

    torch.manual_seed(columns)
    x = (torch.randn(37, columns, device="cuda") * torch.logspace(-6, 4, 37, device="cuda")[:, None]).bfloat16()
    x[3] = 0  # a zero row keeps the floor scale
    quantized, scales = quantize_rows_fp8(x, FP8_MAX, torch.finfo(torch.float32).tiny)
    expected, expected_scales = quantize_rows(x)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(quantized.view(torch.uint8), expected.view(torch.uint8))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 9), st.lists(st.integers(1, 5).map(lambda n: 16 * n), min_size=1, max_size=3),
       st.sampled_from([1e-3, 1.0, 1e3]), st.integers(0, 2**16))
def test_an_unscaled_product_with_its_scales_is_the_fp8_linear(tokens, widths, magnitude, seed):
    """What the fused forward's FP8 GEMMs hand the kernels after them (`ScaledProduct`: the product with unit
    scales, the token's and the channel's scales beside it) is, scales applied, the row-wise FP8 linear's output,
    for the stacked projections' parts too (their columns and their channels' scales)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=generator) * magnitude
    weight = torch.randn(sum(widths), 64, generator=generator) * torch.logspace(-3, 0, sum(widths))[:, None]
    fp8_weight, weight_scales = quantize_rows(weight)
    whole = unscaled_product(Fp8Rows(*quantize_rows(x)), fp8_weight, weight_scales.view(-1), torch.ones(()),
                             torch.float32)
    expected = fp8_linear(x, fp8_weight, weight_scales, None)
    torch.testing.assert_close(whole.value(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    offset = 0
    for part, width in zip(whole.split(widths), widths):
        assert part.product.shape == (tokens, width) and part.column_scales.shape == (width,)
        torch.testing.assert_close(part.value(), whole.value()[:, offset:offset + width], rtol=0, atol=0)
        offset += width


@pytest.mark.parametrize("bias", [False, True])
def test_the_fused_forward_takes_fp8_layer_products_over_the_same_buffers_unless_a_projection_has_a_bias(bias):
    """Each layer's `Fp8LayerProducts` multiplies the FP8 buffers `Fp8Linears` keeps and requantises in place (so
    weight syncs reach them and CUDA graphs stay valid); a projection with a bias (Qwen2's q, k, v), which the
    scale-applying kernels do not add, keeps the linears' own forwards."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=bias)
    model = Qwen3ForCausalLM(config).eval()
    fp8 = Fp8Linears(model.model.layers)
    products = fp8.layer_products()
    if bias:
        assert products is None
        return
    assert len(products) == 2 and all(isinstance(p, Fp8LayerProducts) for p in products)
    layer, first = model.model.layers[1], products[1]
    assert first.qkv_weight.data_ptr() == layer.self_attn.q_proj.fp8_weight.data_ptr()
    assert first.down_weight.data_ptr() == layer.mlp.down_proj.fp8_weight.data_ptr()
    assert first.o_scales.data_ptr() == layer.self_attn.o_proj.fp8_scale.data_ptr()
    x = torch.randn(3, 128)
    before = unscaled_product(Fp8Rows(*quantize_rows(x)), first.down_weight[:, :128], first.down_scales,
                              first.one, torch.float32).value()
    with torch.no_grad():
        layer.mlp.down_proj.weight.mul_(2.0)  # a weight sync: new values in the same parameters
    fp8.requantize()
    after = unscaled_product(Fp8Rows(*quantize_rows(x)), first.down_weight[:, :128], first.down_scales,
                             first.one, torch.float32).value()
    torch.testing.assert_close(after, 2 * before)


def _scaled_product(tokens: int, columns: int, seed: int) -> ScaledProduct:
    """A product as the FP8 GEMMs hand it on: unit-scale products of e4m3 magnitudes, scales of real ones."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    product = (torch.randn(tokens, columns, device="cuda", generator=generator) * 3e3).bfloat16()
    row_scales = torch.rand(tokens, 1, device="cuda", generator=generator) * 1e-2 + 1e-4
    column_scales = torch.rand(columns, device="cuda", generator=generator) * 1e-2 + 1e-4
    return ScaledProduct(product, row_scales, column_scales)


def _same_rows(got: Fp8Rows, expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(got.scales, expected[1])
    assert torch.equal(got.values.view(torch.uint8), expected[0].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("hidden", [64, 1000, 2560])
def test_the_norm_kernel_applies_a_products_scales_and_quantises_as_torch_does(hidden):
    """`add_rms_norm` over a `ScaledProduct`: the residual gets the product with its scales applied (rounded to
    bf16 as a linear's output), and ``quantize=True`` writes the normalised rows as `quantize_rows` of the bf16
    ones, bit for bit; the last layer's norm (no quantisation) writes those bf16 rows."""
    from relax.backends.inference.engine_core.triton_ops import add_rms_norm

    product = _scaled_product(33, hidden, hidden)
    weight = torch.randn(hidden, device="cuda").bfloat16()
    residual = torch.randn(33, hidden, device="cuda").bfloat16()
    expected_residual = residual.clone()
    expected = add_rms_norm(product.value().bfloat16(), weight, 1e-6, residual=expected_residual)
    quantized_residual = residual.clone()
    _same_rows(add_rms_norm(product, weight, 1e-6, residual=quantized_residual, quantize=True),
               quantize_rows(expected))
    assert torch.equal(quantized_residual, expected_residual)
    plain_residual = residual.clone()
    assert torch.equal(add_rms_norm(product, weight, 1e-6, residual=plain_residual), expected)
    assert torch.equal(plain_residual, expected_residual)
    _same_rows(add_rms_norm(residual, weight, 1e-6, quantize=True),
               quantize_rows(add_rms_norm(residual, weight, 1e-6)))  # the first layer's, from the embeddings


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("width", [64, 1000, 3072, 9728])
def test_the_silu_mul_kernel_applies_each_halfs_scales(width):
    """The two halves of the FP8 gate/up product, each with its channels' scales and the token's: ``silu(gate) *
    up`` of the products with their scales applied, bit for bit."""
    from relax.backends.inference.engine_core.triton_ops import silu_mul

    gate, up = _scaled_product(29, 2 * width, width).split([width, width])
    assert torch.equal(silu_mul(gate, up), silu_mul(gate.value().bfloat16(), up.value().bfloat16()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("width", [64, 1000, 3072, 9728])
@pytest.mark.parametrize("block", [512, 1024])
def test_silu_mul_quantized_is_quantize_rows_of_silu_mul_bit_for_bit(width, block):
    """The down projection's input under the FP8 products: SiLU-mul's rows quantised from the block maxima SiLU-mul
    writes are `quantize_rows` of its bf16 rows, bit for bit, scales included; a row of zeros keeps the floor."""
    from relax.backends.inference.engine_core.triton_ops import silu_mul, silu_mul_quantized

    gate_up = _scaled_product(29, 2 * width, width + block)
    gate_up.product[4] = 0
    gate, up = gate_up.split([width, width])
    _same_rows(silu_mul_quantized(gate, up, block=block), quantize_rows(silu_mul(gate, up, block=block)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("heads, kv_heads, most_heads_per_program", [(8, 2, 8), (32, 8, 8), (32, 8, 1), (6, 2, 8)])
def test_the_qk_norm_rope_store_kernel_applies_each_projections_scales(cache_dtype, heads, kv_heads,
                                                                       most_heads_per_program):
    """q, k and v as parts of one stacked FP8 product: the kernel's rotated queries and stored keys and values are
    those of the products with their scales applied (each part its own channels' scales), bit for bit at the same
    number of heads a program. Across those numbers the per-head norms' float32 sums run in another order (an
    H100 gave other bf16 roundings for 2 heads a program than for 1), so the queries agree to a bf16 step."""
    from relax.backends.inference.engine_core.kv_cache import LayerKV
    from relax.backends.inference.engine_core.triton_ops import qk_norm_rope_store

    dim, tokens = 128, 21
    parts = _scaled_product(tokens, (heads + 2 * kv_heads) * dim, 7).split([heads * dim, kv_heads * dim,
                                                                          kv_heads * dim])
    cos, sin = (torch.randn(64, dim, device="cuda").bfloat16() for _ in range(2))
    positions = torch.randint(0, 64, (tokens,), device="cuda")
    slots = torch.randperm(40, device="cuda")[:tokens]
    norms = [torch.randn(dim, device="cuda").bfloat16() for _ in range(2)]

    def pool() -> LayerKV:
        scales = (torch.zeros(40, kv_heads, device="cuda") for _ in range(2)) if cache_dtype == FP8 else (None, None)
        return LayerKV(torch.zeros(40, kv_heads, dim, device="cuda", dtype=cache_dtype),
                       torch.zeros(40, kv_heads, dim, device="cuda", dtype=cache_dtype), *scales)

    got, expected = pool(), pool()
    queries = qk_norm_rope_store(*parts, *norms, 1e-6, cos, sin, positions, slots, got,
                                 most_heads_per_program=most_heads_per_program)
    unscaled = [part.value().bfloat16() for part in parts]
    expected_queries = qk_norm_rope_store(*unscaled, *norms, 1e-6, cos, sin, positions, slots, expected,
                                          most_heads_per_program=most_heads_per_program)
    assert torch.equal(queries, expected_queries)
    one_head_a_program = qk_norm_rope_store(*unscaled, *norms, 1e-6, cos, sin, positions, slots, pool(),
                                            most_heads_per_program=1)
    # a norm's result one bf16 step apart moves a rotated entry by up to a step of the products it sums (which may
    # cancel): within a bf16 step of the largest entry; a wrong head or column would move entries by whole units
    torch.testing.assert_close(queries.float(), one_head_a_program.float(), rtol=2 ** -7,
                               atol=2 ** -7 * queries.float().abs().max().item())
    for name in ("keys", "values", "key_scales", "value_scales"):
        a, b = getattr(got, name), getattr(expected, name)
        assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3"])
def test_the_fused_fp8_engine_decodes_as_its_fp8_linears_score(cache_dtype):
    """The FP8 engine on CUDA (fused forward, `Fp8LayerProducts`, decode in graphs): each sampled token's log-prob
    against the teacher-forced forward of the model through its FP8 linears (the row-wise products, the path
    before) and against the bf16 model. Both gaps stay within what the bf16 core test allows its own (mean below
    0.05 nats): the scales applied after the product instead of in the GEMM move only the order of a rounding."""
    model = make_model(seed=0).to("cuda", torch.bfloat16)
    reference = make_model(seed=0).to("cuda", torch.bfloat16)
    engine = EmbeddedEngine(model, make_tokenizer(), core=CoreSettings(mode="on", fp8=True, max_total_tokens=4096,
                                                                       kv_cache_dtype=cache_dtype))
    assert engine.core.runner.graphs and isinstance(engine.core.runner.decoder.products[0], Fp8LayerProducts)
    requests = [GenerationRequest(f"r{i}", [5 + i] * (4 + i), SamplingParams(max_new_tokens=24, temperature=1.0,
                                                                             seed=i, ignore_eos=True))
                for i in range(16)]
    outputs = asyncio.run(engine.generate(requests))
    gaps: dict[str, list[float]] = {"fp8_linears": [], "bf16": []}
    for req, out in zip(requests, outputs):
        ids = torch.tensor([req.input_ids + out.output_ids], device="cuda")
        chosen = torch.tensor(out.output_ids, device="cuda")[:, None]
        for name, forward in (("fp8_linears", model), ("bf16", reference)):
            with torch.no_grad():
                logits = forward(ids).logits[0, len(req.input_ids) - 1:-1].float()
            expected = logits.log_softmax(-1).gather(1, chosen)[:, 0]
            gaps[name] += (torch.tensor(out.output_log_probs, device="cuda") - expected).tolist()
    for name, values in gaps.items():
        mean = sum(values) / len(values)
        print(f"{cache_dtype} against {name}: mean gap {mean:.4f}, max |gap| {max(map(abs, values)):.4f}")
        assert abs(mean) < 0.05 and max(map(abs, values)) < 1.5, name


@pytest.mark.parametrize("heads, kv_heads, most, expected", [(32, 8, 8, 8), (16, 8, 8, 8), (6, 2, 8, 2), (40, 8, 4, 4),
                                                             (14, 2, 8, 2), (7, 1, 8, 1), (64, 64, 8, 8)])
def test_a_qk_program_takes_the_largest_power_of_two_of_heads_that_divides_both_counts(heads, kv_heads, most,
                                                                                      expected):
    pytest.importorskip("triton")
    from relax.backends.inference.engine_core.triton_ops import heads_per_program

    group = heads_per_program(heads, kv_heads, most)
    assert group == expected and heads % group == 0 and kv_heads % group == 0
