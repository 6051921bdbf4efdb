"""Per-row sampling noise on CUDA in one kernel: Exp(1) draws keyed by each row's 63-bit key (`CounterNoise`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _uniform4(key, counters):
    """Four uniforms in [0, 1) per Philox counter: entry ``4c + q`` of the vocabulary takes output ``q`` of
    counter ``c`` (a quarter of the Philox rounds of one call per entry)."""
    return tl.rand4x(key, counters)


@triton.jit
def _exponential_noise_kernel(keys_ptr, out_ptr, vocab, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    counters = tl.program_id(1) * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    key = tl.load(keys_ptr + row)
    u0, u1, u2, u3 = _uniform4(key, counters)
    base = out_ptr + row * stride
    tl.store(base + 4 * counters, -tl.log(1.0 - u0), mask=4 * counters < vocab)
    tl.store(base + 4 * counters + 1, -tl.log(1.0 - u1), mask=4 * counters + 1 < vocab)
    tl.store(base + 4 * counters + 2, -tl.log(1.0 - u2), mask=4 * counters + 2 < vocab)
    tl.store(base + 4 * counters + 3, -tl.log(1.0 - u3), mask=4 * counters + 3 < vocab)


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, vocab]`` float32 Exp(1) noise, row ``b`` a function of ``keys[b]`` only."""
    out = torch.empty((keys.shape[0], vocab), dtype=torch.float32, device=keys.device)
    grid = (keys.shape[0], triton.cdiv(vocab, BLOCK))
    _exponential_noise_kernel[grid](keys.contiguous(), out, vocab, out.stride(0), BLOCK=BLOCK)
    return out


@triton.jit
def _row_key(seed, counter):
    """`CounterNoise.row_keys` for one row (the same int64 arithmetic, so both paths draw the same noise)."""
    key = seed * -7046029254386353131 + counter * -4658895280553007687
    key = key ^ (key >> 31)
    return key & 0x7FFFFFFFFFFFFFFF


@triton.jit
def _partial_quarter(logits_row, offsets, uniform, inverse, greedy, vocab):
    valid = offsets < vocab
    scaled = tl.load(logits_row + offsets, mask=valid, other=float("-inf")).to(tl.float32) * inverse
    noise = -tl.log(1.0 - uniform)
    score = tl.where(greedy, scaled, scaled - tl.log(tl.maximum(noise, 1.1754943508222875e-38)))
    return scaled, tl.where(valid, score, float("-inf")), valid


@triton.jit
def _sample_partial_kernel(logits_ptr, stride, temperature_ptr, seed_ptr, counter_ptr, max_ptr, sum_ptr,
                           score_ptr, index_ptr, vocab: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """One chunk of one row: the chunk's max and sum of exp of logits / T, and its best Gumbel-max score
    ``s - log E`` (greedy: ``s``) with the index holding it. One read of the logits; the noise is
    `_exponential_noise_kernel`'s."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    inverse = tl.where(greedy, 1.0, 1.0 / temperature)
    key = _row_key(tl.load(seed_ptr + row), tl.load(counter_ptr + row))
    counters = chunk * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    u0, u1, u2, u3 = _uniform4(key, counters)
    logits_row = logits_ptr + row.to(tl.int64) * stride
    s0, g0, v0 = _partial_quarter(logits_row, 4 * counters, u0, inverse, greedy, vocab)
    s1, g1, v1 = _partial_quarter(logits_row, 4 * counters + 1, u1, inverse, greedy, vocab)
    s2, g2, v2 = _partial_quarter(logits_row, 4 * counters + 2, u2, inverse, greedy, vocab)
    s3, g3, v3 = _partial_quarter(logits_row, 4 * counters + 3, u3, inverse, greedy, vocab)
    maximum = tl.maximum(tl.maximum(tl.max(s0, axis=0), tl.max(s1, axis=0)),
                         tl.maximum(tl.max(s2, axis=0), tl.max(s3, axis=0)))
    total = (tl.sum(tl.where(v0, tl.exp(s0 - maximum), 0.0), axis=0) + tl.sum(tl.where(v1, tl.exp(s1 - maximum), 0.0), axis=0)
             + tl.sum(tl.where(v2, tl.exp(s2 - maximum), 0.0), axis=0) + tl.sum(tl.where(v3, tl.exp(s3 - maximum), 0.0), axis=0))
    best = tl.maximum(tl.maximum(tl.max(g0, axis=0), tl.max(g1, axis=0)), tl.maximum(tl.max(g2, axis=0), tl.max(g3, axis=0)))
    index = tl.minimum(
        tl.minimum(tl.min(tl.where(g0 == best, 4 * counters, vocab), axis=0),
                   tl.min(tl.where(g1 == best, 4 * counters + 1, vocab), axis=0)),
        tl.minimum(tl.min(tl.where(g2 == best, 4 * counters + 2, vocab), axis=0),
                   tl.min(tl.where(g3 == best, 4 * counters + 3, vocab), axis=0)))
    out = row * CHUNKS + chunk
    tl.store(max_ptr + out, maximum)
    tl.store(sum_ptr + out, total)
    tl.store(score_ptr + out, best)
    tl.store(index_ptr + out, index)


@triton.jit
def _sample_combine_kernel(logits_ptr, stride, temperature_ptr, max_ptr, sum_ptr, score_ptr, index_ptr, token_ptr,
                           log_prob_ptr, vocab: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr):
    """A row's token (the best chunk's, lowest index on ties) and its log-prob ``s - log Z`` from the chunks."""
    row = tl.program_id(0)
    chunks = tl.arange(0, BLOCK_C)
    valid = chunks < CHUNKS
    base = row * CHUNKS + chunks
    maxima = tl.load(max_ptr + base, mask=valid, other=float("-inf"))
    sums = tl.load(sum_ptr + base, mask=valid, other=0.0)
    scores = tl.load(score_ptr + base, mask=valid, other=float("-inf"))
    indices = tl.load(index_ptr + base, mask=valid, other=vocab)
    row_max = tl.max(maxima, axis=0)
    log_z = row_max + tl.log(tl.sum(tl.where(valid, sums * tl.exp(maxima - row_max), 0.0), axis=0))
    best = tl.max(scores, axis=0)
    token = tl.min(tl.where(scores == best, indices, vocab), axis=0)
    temperature = tl.load(temperature_ptr + row)
    inverse = tl.where(temperature == 0.0, 1.0, 1.0 / temperature)
    chosen = tl.load(logits_ptr + row.to(tl.int64) * stride + token).to(tl.float32) * inverse
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(log_prob_ptr + row, chosen - log_z)


SAMPLE_BLOCK = 4096


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                  tokens: torch.Tensor, log_probs: torch.Tensor, block: int = SAMPLE_BLOCK, num_warps: int = 8) -> None:
    """Draw one token per row of ``logits [B, V]`` into ``tokens [B]`` (int64) and ``log_probs [B]`` (float32):
    ``temperature [B]`` (0: greedy), noise keyed by ``seeds [B]`` and ``counters [B]`` (int64). No top-k/top-p:
    rows that filter take `relax.backends.inference.sampling.sample_next_tokens`. Two launches (chunks of the
    vocabulary in parallel, then a per-row combine); capturable in a CUDA graph."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, block)
    partial = torch.empty((4, rows, chunks), dtype=torch.float32, device=logits.device)
    index = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _sample_partial_kernel[(rows, chunks)](logits, logits.stride(0), temperature, seeds, counters, partial[0],
                                           partial[1], partial[2], index, vocab=vocab, CHUNKS=chunks,
                                           BLOCK=block, num_warps=num_warps)
    _sample_combine_kernel[(rows,)](logits, logits.stride(0), temperature, partial[0], partial[1], partial[2], index,
                                    tokens, log_probs, vocab=vocab, CHUNKS=chunks,
                                    BLOCK_C=triton.next_power_of_2(chunks), num_warps=1)
