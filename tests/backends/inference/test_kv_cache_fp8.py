"""The FP8 KV pool (``--kv-cache-dtype fp8_e4m3``): each head vector in one byte per entry with a scale of its own,
on every path that writes or reads the pool (prefill, decode, copy-on-write, preemption), against the pool in the
model's dtype; the flag refused where it has no pool to act on."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine
from relax.backends.inference.engine_core.kv_cache import KVPool, LayerKV, kv_bytes_per_token, quantize_heads
from relax.cli.args import parse_config
from relax.config import ConfigError
from tests.backends.inference.test_embedded_engine import make_model, make_tokenizer

FP8_STEP = 2.0 ** -4  # e4m3 keeps 3 mantissa bits: rounding moves a value by at most 1/16 of its binade's top


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), magnitude=st.sampled_from([1e-3, 1.0, 30.0, 3e4]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_head_vector_comes_back_within_fp8_rounding_of_its_own_largest_entry(seed, magnitude, dtype):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, 3, 16, generator=generator) * magnitude).to(dtype)
    x[0, 0] = 0  # a vector of zeros keeps its zeros
    pool = KVPool(1, 8, 3, 16, dtype, "fp8_e4m3", torch.device("cpu"))
    slots = torch.tensor([6, 1, 3, 0, 5])
    pool.layers[0].write(slots, x, -x)
    keys, values = pool.layers[0].gather(slots, torch.float32)
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    assert (keys - x.float()).abs().le(amax * FP8_STEP + 1e-30).all()
    assert torch.equal(values, -keys)
    assert (keys[0, 0] == 0).all()
    _, scales = quantize_heads(x)
    assert torch.equal(pool.scales[0, 0][slots], scales)


def test_the_pool_in_fp8_takes_about_half_the_bytes_a_token():
    bf16 = kv_bytes_per_token(36, 8, 128, torch.bfloat16, "auto")
    fp8 = kv_bytes_per_token(36, 8, 128, torch.bfloat16, "fp8_e4m3")
    assert fp8 == bf16 // 2 + 2 * 36 * 8 * 4  # one byte an entry, and a float32 scale a head vector
    assert KVPool(36, 10, 8, 128, torch.bfloat16, "fp8_e4m3", torch.device("cpu")).nbytes == 10 * fp8


def _engine(cache_dtype: str, **core) -> EmbeddedEngine:
    return EmbeddedEngine(make_model(0), make_tokenizer(), max_batch_size=8,
                          core=CoreSettings(mode="on", kv_cache_dtype=cache_dtype, **core))


def _requests(temperature: float = 0.0) -> list[GenerationRequest]:
    shared = [3 + j % 40 for j in range(13)]  # a prompt the group shares: its blocks are shared, then copied
    prompts = [shared] * 3 + [[3 + (i * 11 + j) % 50 for j in range(5 + 3 * i)] for i in range(4)]
    return [GenerationRequest(f"r{i}", prompt, SamplingParams(max_new_tokens=20, temperature=temperature,
                                                              ignore_eos=True, seed=i))
            for i, prompt in enumerate(prompts)]


def test_the_fp8_pool_equals_a_model_dtype_pool_holding_the_same_rounded_values(monkeypatch):
    """Every path that writes or reads the pool (prefill over a shared prompt, copy-on-write of its last block,
    decode) gives, on the FP8 pool, what the model-dtype pool gives when each written vector is first rounded
    through FP8 and back: the pool's plumbing adds nothing to the quantisation itself."""
    engine = _engine("fp8_e4m3", page_size=4)
    outputs = asyncio.run(engine.generate(_requests(temperature=1.0)))
    assert engine.core.runner.pool.kv.dtype == torch.float8_e4m3fn
    original = LayerKV.write

    def rounded_write(self, slots, keys, values):
        (k, k_scale), (v, v_scale) = quantize_heads(keys), quantize_heads(values)
        original(self, slots, (k.float() * k_scale[..., None]).to(keys.dtype),
                 (v.float() * v_scale[..., None]).to(values.dtype))

    monkeypatch.setattr(LayerKV, "write", rounded_write)
    reference = asyncio.run(_engine("auto", page_size=4).generate(_requests(temperature=1.0)))
    assert [o.output_ids for o in outputs] == [o.output_ids for o in reference]
    for a, b in zip(outputs, reference):
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=1e-5)


def test_fp8_pool_keeps_greedy_outputs_through_preemption_and_copy_on_write():
    roomy = asyncio.run(_engine("fp8_e4m3", page_size=4).generate(_requests()))
    tight_engine = _engine("fp8_e4m3", page_size=4, max_total_tokens=72)
    tight = asyncio.run(tight_engine.generate(_requests()))
    assert tight_engine.core.scheduler.preemptions > 0
    assert [o.output_ids for o in tight] == [o.output_ids for o in roomy]
    for a, b in zip(tight, roomy):
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=1e-5)


def test_the_flag_is_refused_where_it_has_no_pool_to_act_on(tiny_workspace, tmp_path):
    from tests.support.runs import tiny_train_args

    base = tiny_train_args(tiny_workspace, tmp_path / "out", "--kv-cache-dtype", "fp8_e4m3")
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8_e4m3 is the paged engine core's KV pool"):
        parse_config([*base, "--engine-core", "off"])
    with pytest.raises(ConfigError, match="roll out elsewhere"):
        parse_config([*base, "--rollout-external", "--rollout-external-engine-addrs", "http://127.0.0.1:9"])
    assert parse_config(base).kv_cache_dtype == "fp8_e4m3"
    launched = parse_config([*base, "--rollout-external", "--rollout-engine-protocol", "relax",
                             "--rollout-external-engine-addrs", "http://127.0.0.1:9"])
    from relax.core.engines.factory import build_relax_server_engine

    engine = build_relax_server_engine(launched, "http://127.0.0.1:9", tmp_path / "weights")
    (tmp_path / "weights").mkdir()
    arguments = engine.arguments()
    assert arguments[arguments.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8_e4m3"):
        CoreSettings(kv_cache_dtype="fp4")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fused_store_kernel_writes_what_the_pool_writes_on_cuda():
    """`qk_norm_rope_store` into an FP8 pool: the same vectors as into a bf16 pool, each within FP8 rounding of its
    own largest entry, with the scale `quantize_heads` gives; the queries unchanged."""
    from relax.backends.inference.engine_core.triton_ops import qk_norm_rope_store

    torch.manual_seed(0)
    tokens, heads, kv_heads, dim, slots_total = 37, 16, 8, 128, 512
    device, dtype = torch.device("cuda"), torch.bfloat16
    q = torch.randn(tokens, heads * dim, device=device, dtype=dtype)
    k = torch.randn(tokens, kv_heads * dim, device=device, dtype=dtype) * 4
    v = torch.randn(tokens, kv_heads * dim, device=device, dtype=dtype)
    q_weight, k_weight = torch.rand(dim, device=device, dtype=dtype) + 0.5, torch.rand(dim, device=device, dtype=dtype)
    positions = torch.randint(0, 1000, (tokens,), device=device)
    angles = torch.arange(1024, device=device)[:, None] * torch.rand(dim // 2, device=device)[None]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    slots = torch.randperm(slots_total, device=device)[:tokens]
    plain = KVPool(1, slots_total, kv_heads, dim, dtype, "auto", device).layers[0]
    fp8 = KVPool(1, slots_total, kv_heads, dim, dtype, "fp8_e4m3", device).layers[0]
    q_plain = qk_norm_rope_store(q, k, v, q_weight, k_weight, 1e-6, cos, sin, positions, slots, plain)
    q_fp8 = qk_norm_rope_store(q, k, v, q_weight, k_weight, 1e-6, cos, sin, positions, slots, fp8)
    assert torch.equal(q_plain, q_fp8)
    keys, values = fp8.gather(slots, torch.float32)
    exact_keys, exact_values = plain.gather(slots, torch.float32)
    for got, want in ((keys, exact_keys), (values, exact_values)):
        amax = want.abs().amax(dim=-1, keepdim=True)
        assert (got - want).abs().le(amax * FP8_STEP * 1.01).all()
    _, want_scales = quantize_heads(exact_keys)
    torch.testing.assert_close(fp8.key_scales[slots], want_scales, rtol=1e-2, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_heads, dim", [(8, 128), (2, 64), (3, 80)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gather_kernel_dequantizes_as_torch_does(kv_heads, dim, dtype):
    """A prefill's K/V from an FP8 pool (`triton_ops.gather_dequantized`, one kernel): the torch operations' values
    (`LayerKV.gather`) bit for bit, for slots of any shape, head counts and widths that are not powers of two
    included."""
    from relax.backends.inference.engine_core.triton_ops import gather_dequantized

    torch.manual_seed(kv_heads * dim)
    layer = KVPool(2, 300, kv_heads, dim, dtype, "fp8_e4m3", torch.device("cuda")).layers[1]
    written = torch.randperm(300, device="cuda")[:200]
    layer.write(written, torch.randn(200, kv_heads, dim, device="cuda", dtype=dtype) * 40,
                torch.randn(200, kv_heads, dim, device="cuda", dtype=dtype) * 1e-3)
    for slots in (torch.randint(0, 300, (57,), device="cuda"), torch.randint(0, 300, (3, 11), device="cuda")):
        for got, want in zip(gather_dequantized(layer, slots, dtype), layer.gather(slots, dtype)):
            assert got.shape == want.shape and torch.equal(got, want)


def test_relax_serve_passes_the_flag_to_its_engine(monkeypatch, tiny_workspace):
    import relax.serving.server as server
    from relax.cli import serve as serve_cli

    seen = {}
    monkeypatch.setattr(server, "serve", lambda model, **kwargs: seen.update(kwargs))
    assert serve_cli.cmd_serve(["--hf-checkpoint", str(tiny_workspace / "model"), "--device", "cpu",
                           "--kv-cache-dtype", "fp8_e4m3"]) == 0
    assert seen["core"].kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ConfigError, match="--kv-cache-dtype: invalid choice: 'fp4'"):
        serve_cli.cmd_serve(["--hf-checkpoint", str(tiny_workspace / "model"), "--kv-cache-dtype", "fp4"])
