"""The engine core's sampler on CUDA in two kernels, capturable in a CUDA graph: one read of the logits.

A row draws as `relax.backends.inference.sampling.CounterNoise.sample_rows` does everywhere else: one uniform from
the row's key (its request's seed and the index of the token it samples, splitmix64), and the token is the first
whose cumulative weight ``exp(logit / T - max)`` passes the uniform times the row's total. So a seeded request gets
the same tokens on CUDA, off it and on the eager path, up to rounding: each weight is a float32 exponential, summed in
float64 (chunk by chunk here, in one cumulative sum on the eager path), so two paths part only where the target lies
within about 1e-7 of the total from a token boundary.

1. `_chunk_stats_kernel`, one program per (row, chunk of ``BLOCK`` ids): the chunk's max of ``logit / T``, its sum
   of ``exp(logit / T - max)`` and its argmax (greedy rows).
2. `_pick_kernel`, one program per row: the row's log-normaliser from the chunks; greedy rows take the best chunk's
   argmax; sampled rows find the chunk the target falls in from the chunks' cumulative sums, then the token within
   it from one more read of that chunk alone (``BLOCK`` ids).

The earlier kernel drew Exp(1) noise for every vocabulary entry (Philox, two logarithms per entry) and took the
exponential race's winner: 186 us a step at batch 256 over 151,936 bf16 logits on an H100, where reading them takes
26 us at the card's copy rate; this one takes 46 us (`benchmarks/sampler_gpu.py` times both in CUDA graphs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SAMPLE_BLOCK = 4096


@triton.jit
def _row_uniform(seed, counter):
    """`CounterNoise.uniforms` for one row: splitmix64 of the row's key (`CounterNoise.row_keys`), its top 53 bits
    as a float64 in [0, 1). The same int64 arithmetic (wrapping products; logical shifts as masked arithmetic ones)."""
    key = seed * -7046029254386353131 + counter * -4658895280553007687
    key = (key ^ (key >> 31)) & 0x7FFFFFFFFFFFFFFF
    x = key ^ ((key >> 30) & 0x3FFFFFFFF)
    x = x * -4658895280553007687
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * -7723592293110705685
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    return ((x >> 11) & 0x1FFFFFFFFFFFFF).to(tl.float64) * 1.1102230246251565e-16  # 2**-53


@triton.jit
def _scaled_chunk(logits_row, temperature, offsets, vocab):
    """A chunk's ``logit / T`` (greedy, T = 0: the logit), -inf past the vocabulary."""
    inverse = 1.0 / tl.where(temperature == 0.0, 1.0, temperature)
    return tl.load(logits_row + offsets, mask=offsets < vocab, other=float("-inf")).to(tl.float32) * inverse


@triton.jit
def _chunk_stats_kernel(logits_ptr, stride, temperature_ptr, max_ptr, sum_ptr, argmax_ptr, vocab: tl.constexpr,
                        CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    scaled = _scaled_chunk(logits_ptr + row.to(tl.int64) * stride, tl.load(temperature_ptr + row), offsets, vocab)
    maximum = tl.max(scaled, axis=0)
    # A -inf logit weighs nothing, even in a chunk whose every logit is -inf (where s - max would be NaN). The sum in
    # float64, as the eager path's cumulative sum. The two paths still part about once in 500 rows of 151,936 ids
    # (an H100, with float32 sums and with these alike): their float32 weights round differently, and the many tiny
    # weights put token boundaries close together.
    total = tl.sum(tl.where(scaled == float("-inf"), 0.0, tl.exp(scaled - maximum)).to(tl.float64), axis=0)
    argmax = tl.min(tl.where(scaled == maximum, offsets, vocab), axis=0)
    out = row * CHUNKS + chunk
    tl.store(max_ptr + out, maximum)
    tl.store(sum_ptr + out, total)
    tl.store(argmax_ptr + out, argmax)


@triton.jit
def _pick_kernel(logits_ptr, stride, temperature_ptr, seed_ptr, counter_ptr, max_ptr, sum_ptr, argmax_ptr, token_ptr,
                 log_prob_ptr, vocab: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunks = tl.arange(0, BLOCK_C)
    valid = chunks < CHUNKS
    base = row * CHUNKS + chunks
    maxima = tl.load(max_ptr + base, mask=valid, other=float("-inf"))
    sums = tl.load(sum_ptr + base, mask=valid, other=0.0)  # float64
    row_max = tl.max(maxima, axis=0)
    weights = tl.where(valid & (maxima > float("-inf")), sums * tl.exp((maxima - row_max).to(tl.float64)), 0.0)
    total = tl.sum(weights, axis=0)
    log_z = row_max + tl.log(total).to(tl.float32)
    temperature = tl.load(temperature_ptr + row)
    logits_row = logits_ptr + row.to(tl.int64) * stride
    if temperature == 0.0:  # greedy: the best chunk's argmax (the lowest id among equal maxima)
        argmaxes = tl.load(argmax_ptr + base, mask=valid, other=vocab)
        token = tl.min(tl.where(maxima == row_max, argmaxes, vocab), axis=0)
    else:
        target = _row_uniform(tl.load(seed_ptr + row), tl.load(counter_ptr + row)) * total
        cumulative = tl.cumsum(weights, axis=0)
        # The first chunk whose cumulative weight passes the target; the last one with weight when rounding puts the
        # target at the total.
        last_weighted = tl.max(tl.where(weights > 0, chunks, 0), axis=0)
        chunk = tl.minimum(tl.min(tl.where(valid & (cumulative > target), chunks, BLOCK_C), axis=0), last_weighted)
        before = tl.sum(tl.where(chunks < chunk, weights, 0.0), axis=0)
        offsets = chunk * BLOCK + tl.arange(0, BLOCK)
        scaled = _scaled_chunk(logits_row, temperature, offsets, vocab)
        inner = tl.where(scaled == float("-inf"), 0.0, tl.exp(scaled - row_max)).to(tl.float64)
        passed = before + tl.cumsum(inner, axis=0) > target
        last_inner = tl.max(tl.where(inner > 0, offsets, 0), axis=0)
        token = tl.minimum(tl.min(tl.where(passed, offsets, vocab), axis=0), last_inner)
    inverse = 1.0 / tl.where(temperature == 0.0, 1.0, temperature)
    chosen = tl.load(logits_row + token).to(tl.float32) * inverse
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(log_prob_ptr + row, chosen - log_z)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                  tokens: torch.Tensor, log_probs: torch.Tensor, block: int = SAMPLE_BLOCK, num_warps: int = 8) -> None:
    """Draw one token per row of ``logits [B, V]`` into ``tokens [B]`` (int64) and ``log_probs [B]`` (float32,
    ``log_softmax(logits / T)`` at the token): ``temperature [B]`` (0: greedy), the draw keyed by ``seeds [B]`` and
    ``counters [B]`` (int64). No top-k/top-p: rows that filter take
    `relax.backends.inference.sampling.sample_next_tokens`."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, block)
    maxima = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    sums = torch.empty((rows, chunks), dtype=torch.float64, device=logits.device)
    argmax = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _chunk_stats_kernel[(rows, chunks)](logits, logits.stride(0), temperature, maxima, sums, argmax,
                                        vocab=vocab, CHUNKS=chunks, BLOCK=block, num_warps=num_warps)
    _pick_kernel[(rows,)](logits, logits.stride(0), temperature, seeds, counters, maxima, sums, argmax, tokens,
                          log_probs, vocab=vocab, CHUNKS=chunks, BLOCK_C=triton.next_power_of_2(chunks), BLOCK=block,
                          num_warps=num_warps)
