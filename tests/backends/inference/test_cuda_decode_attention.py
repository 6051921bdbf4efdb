"""The FP8 pool's CUDA decode-attention kernel (`engine_core.cuda_attention`): which calls it takes (on any machine),
and on a GPU its output against attention over the dequantized keys and values, the Triton kernel's, and inside a
CUDA graph."""

from __future__ import annotations

import pytest
import torch

from relax.backends.inference.engine_core import cuda_attention
from relax.backends.inference.engine_core.kv_cache import LayerKV, quantize_heads

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pool(slots: int, kv_heads: int, dim: int, device: str, key_magnitude: float = 3.0,
          value_magnitude: float = 1.0) -> LayerKV:
    keys = torch.randn(slots, kv_heads, dim, device=device) * key_magnitude
    values = torch.randn_like(keys) * value_magnitude
    (keys, key_scales), (values, value_scales) = quantize_heads(keys), quantize_heads(values)
    return LayerKV(keys, values, key_scales, value_scales)


def _unfit(query, cache: LayerKV, page: int) -> str | None:
    return cuda_attention.unfit(query, cache.keys, cache.values, page, cache.key_scales, cache.value_scales)


@pytest.mark.parametrize("heads, kv_heads, page", [(32, 8, 16), (16, 8, 32), (7, 1, 16), (6, 2, 48), (8, 8, 16)])
def test_groups_of_up_to_8_heads_over_pages_of_16_slots_fit(heads, kv_heads, page):
    query = torch.randn(3, heads, 128, dtype=torch.bfloat16)
    assert _unfit(query, _pool(4 * page, kv_heads, 128, "cpu"), page) is None


@pytest.mark.parametrize("heads, kv_heads, dim, page, dtype, why", [
    (32, 8, 64, 16, torch.bfloat16, "head dimension 64"),
    (32, 2, 128, 16, torch.bfloat16, "32 query heads over 2 KV heads"),
    (12, 8, 128, 16, torch.bfloat16, "12 query heads over 8 KV heads"),
    (32, 8, 128, 8, torch.bfloat16, "pages of 8 slots"),
    (32, 8, 128, 24, torch.bfloat16, "pages of 24 slots"),
    (32, 8, 128, 16, torch.float16, "bf16"),
])
def test_operands_outside_the_kernels_shapes_are_refused_with_the_reason(heads, kv_heads, dim, page, dtype, why):
    query = torch.randn(2, heads, dim, dtype=dtype)
    reason = _unfit(query, _pool(4 * page, kv_heads, dim, "cpu"), page)
    assert reason is not None and why in reason


def test_a_bf16_pool_fits_a_float32_pool_a_strided_query_and_the_cpu_do_not():
    cache = _pool(64, 8, 128, "cpu")
    query = torch.randn(2, 32, 128, dtype=torch.bfloat16)
    bf16 = torch.randn(64, 8, 128, dtype=torch.bfloat16)
    assert cuda_attention.unfit(query, bf16, bf16, 16, None, None) is None
    assert "neither FP8 nor bf16" in cuda_attention.unfit(query, bf16.float(), bf16.float(), 16, None, None)
    assert "missing" in cuda_attention.unfit(query, cache.keys, cache.values, 16, cache.key_scales, None)
    assert "contiguous" in _unfit(torch.randn(2, 32, 256, dtype=torch.bfloat16)[..., ::2], cache, 16)
    assert "aligned" in _unfit(torch.randn(2, 32, 130, dtype=torch.bfloat16)[..., 1:129], cache, 16)
    assert not cuda_attention.supported(query, cache.keys, cache.values, 16, cache.key_scales, cache.value_scales)


def _nvrtc_or_skip():
    from relax.backends.inference.engine_core import nvrtc

    try:
        nvrtc.library()
    except nvrtc.NvrtcError as error:  # the test extra installs nvidia-cuda-nvrtc on Linux x86_64
        pytest.skip(str(error))
    return nvrtc


@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("group, page", [(4, 16), (1, 16), (8, 32), (3, 48)])
def test_the_kernel_compiles_for_hopper_within_its_launch_bound_without_spilling(quantized, group, page):
    """NVRTC needs no GPU: the engine's launch of the real source, built for sm_90 as on an H100/H200, with ptxas'
    report. Its registers must let `Launch.min_blocks` blocks share a multiprocessor, and nothing may spill to local
    memory (a spill in the loop would put the tile through memory the kernel exists to avoid)."""
    import re

    nvrtc = _nvrtc_or_skip()
    launch = cuda_attention.LAUNCH[quantized]
    cubin, log = nvrtc.compile_cubin(cuda_attention.kernel_source(quantized, group, page, launch), "paged_decode",
                                     "sm_90", ("--ptxas-options=-v",))
    assert cubin[:4] == b"\x7fELF"
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    assert registers <= 65536 // (32 * launch.warps * launch.min_blocks), log
    assert "0 bytes spill stores, 0 bytes spill loads" in log, log


def test_a_source_that_does_not_compile_raises_with_nvrtcs_log():
    nvrtc = _nvrtc_or_skip()
    with pytest.raises(nvrtc.NvrtcError, match="undefined"):
        nvrtc.compile_cubin('extern "C" __global__ void k() { not_declared(); }', "k", "sm_90")


def _tables(lens: list[int], page: int, blocks: int, device: str) -> torch.Tensor:
    tables = torch.zeros(len(lens), 64, dtype=torch.int32, device=device)
    order = (torch.randperm(blocks - 1, device=device) + 1).to(torch.int32)
    used = 0
    for row, length in enumerate(lens):
        count = -(-length // page)
        tables[row, :count] = order[used:used + count]
        used += count
    return tables


def _reference(query, cache: LayerKV, tables, lens, page):
    """Attention in float32 over the dequantized keys and values of each sequence."""
    heads, dim = query.shape[1:]
    kv_heads = cache.keys.shape[1]
    out = []
    for row, length in enumerate(lens.tolist()):
        positions = torch.arange(length, device=query.device)
        slots = tables[row].long()[positions // page] * page + positions % page
        keys, values = (x.float() for x in cache.gather(slots, torch.float32))
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        probs = (torch.einsum("hd,lhd->hl", query[row].float(), keys) * dim ** -0.5).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", probs, values))
    return torch.stack(out)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads, kv_heads, page", [
    (32, 8, 16), (16, 8, 16), (8, 8, 16), (64, 8, 32), (6, 2, 16), (12, 4, 16), (7, 1, 16)])
@pytest.mark.parametrize("layout", ["slot_major", "head_major"])
@pytest.mark.parametrize("pool", ["fp8", "bf16"])
def test_the_cuda_kernel_matches_attention_over_the_dequantized_pool(heads, kv_heads, page, layout, pool):
    """Query groups of 1 to 8 heads (not only powers of two), fewer KV heads than a block's warps, pages of 16 and
    32 slots, lengths around the 16-token tiles and the 32-token trips, and a pool stored head-major."""
    torch.manual_seed(0)
    dim, blocks = 128, 400
    cache = _pool(blocks * page, kv_heads, dim, "cuda")
    if pool == "bf16":
        cache = LayerKV(*cache.gather(torch.arange(blocks * page, device="cuda"), torch.bfloat16))
    lens_list = [1, 2, 7, 15, 16, 17, 31, 32, 33, 48, 64, 65, 300, 777]
    lens = torch.tensor(lens_list, dtype=torch.int32, device="cuda")
    tables = _tables(lens_list, page, blocks, "cuda")
    query = torch.randn(len(lens_list), heads, dim, device="cuda", dtype=torch.bfloat16)
    keys, values, key_scales, value_scales = cache.keys, cache.values, cache.key_scales, cache.value_scales
    if layout == "head_major":  # the same values, [Hkv, slots, D] in memory
        keys, values = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (keys, values))
        if pool == "fp8":
            key_scales, value_scales = (x.t().contiguous().t() for x in (key_scales, value_scales))
    assert cuda_attention.supported(query, keys, values, page, key_scales, value_scales)
    out = cuda_attention.paged_decode_attention(query, keys, values, tables, lens, dim ** -0.5, page, key_scales,
                                                value_scales)
    expected = _reference(query, cache, tables, lens, page)
    for row, length in enumerate(lens_list):
        error = (out[row].float() - expected[row]).norm() / expected[row].norm()
        assert error < 1e-2, (row, length, float(error))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("key_magnitude, value_magnitude, query_magnitude", [
    (1e-4, 1e-4, 1e3), (1e4, 1e4, 1e-3), (1.0, 1e-4, 1.0), (1e-4, 1e4, 1.0), (300.0, 1.0, 30.0)])
def test_the_cuda_kernel_holds_over_magnitudes_as_the_triton_kernel_does(key_magnitude, value_magnitude,
                                                                         query_magnitude):
    """The kernel widens FP8 entries by their bits (times 2**-120) and carries the query and the probabilities 2**64
    up: across the magnitudes a head vector can take its output stays finite and equals the Triton kernel's, whose
    conversion path is the reference, within bf16 rounding."""
    from relax.backends.inference.engine_core.triton_attention import paged_decode_attention

    torch.manual_seed(1)
    batch, heads, kv_heads, dim, page = 6, 32, 8, 128, 16
    cache = _pool(batch * 16 * page, kv_heads, dim, "cuda", key_magnitude, value_magnitude)
    tables = torch.arange(batch * 16, device="cuda", dtype=torch.int32).view(batch, 16)
    lens = torch.tensor([1, 7, 16, 33, 150, 256], device="cuda", dtype=torch.int32)
    query = (torch.randn(batch, heads, dim, device="cuda") * query_magnitude).to(torch.bfloat16)
    triton_out = paged_decode_attention(query, cache.keys, cache.values, tables, lens, dim ** -0.5, page,
                                        key_scales=cache.key_scales, value_scales=cache.value_scales,
                                        widen_by_bits=False)
    out = cuda_attention.paged_decode_attention(query, cache.keys, cache.values, tables, lens, dim ** -0.5, page,
                                                cache.key_scales, cache.value_scales)
    assert torch.isfinite(out).all()
    error = (out.float() - triton_out.float()).norm() / triton_out.float().norm()
    assert error < 1e-2, float(error)


@pytest.mark.gpu
@needs_cuda
def test_the_cuda_kernel_replays_in_a_cuda_graph_with_new_lengths_and_tables():
    """The engine captures decode in CUDA graphs and changes only the buffers' contents between replays."""
    torch.manual_seed(2)
    batch, heads, kv_heads, dim, page, blocks = 5, 16, 8, 128, 16, 200
    cache = _pool(blocks * page, kv_heads, dim, "cuda")
    query = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([3, 40, 17, 100, 64], dtype=torch.int32, device="cuda")
    tables = _tables(lens.tolist(), page, blocks, "cuda")

    def step():
        return cuda_attention.paged_decode_attention(query, cache.keys, cache.values, tables, lens, dim ** -0.5,
                                                     page, cache.key_scales, cache.value_scales)

    step()  # built outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new_lens in ([1, 2, 3, 4, 5], [129, 33, 16, 250, 77]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        tables.copy_(_tables(new_lens, page, blocks, "cuda"))
        query.copy_(torch.randn_like(query))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())
        expected = _reference(query, cache, tables, lens, page)
        assert ((out.float() - expected).norm() / expected.norm()) < 1e-2
