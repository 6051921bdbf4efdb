"""Per-row sampling noise on CUDA in one kernel: Exp(1) draws keyed by each row's 63-bit key (`CounterNoise`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _exponential_noise_kernel(keys_ptr, out_ptr, vocab, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(keys_ptr + row)
    uniform = tl.rand(key, offsets)  # Philox keyed by the row, counter = vocabulary index: [0, 1)
    tl.store(out_ptr + row * stride + offsets, -tl.log(1.0 - uniform), mask=offsets < vocab)


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
def _sample_kernel(logits_ptr, stride, temperature_ptr, seed_ptr, counter_ptr, token_ptr, log_prob_ptr,
                   vocab: tl.constexpr, BLOCK: tl.constexpr):
    """One row: log Z of logits / T (online, one pass), then the Gumbel-max draw argmax(s - log E) with the row's
    Exp(1) noise (greedy: argmax s), and the drawn token's log-prob s - log Z."""
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    inverse = tl.where(greedy, 1.0, 1.0 / temperature)
    key = _row_key(tl.load(seed_ptr + row), tl.load(counter_ptr + row))
    base = logits_ptr + row.to(tl.int64) * stride
    maximum = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        scaled = tl.load(base + offsets, mask=offsets < vocab, other=float("-inf")).to(tl.float32) * inverse
        new_max = tl.maximum(maximum, scaled)
        total = total * tl.exp(maximum - new_max) + tl.where(scaled == float("-inf"), 0.0, tl.exp(scaled - new_max))
        maximum = new_max
    row_max = tl.max(maximum, axis=0)
    log_z = row_max + tl.log(tl.sum(total * tl.exp(maximum - row_max), axis=0))
    best_score = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_index = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        valid = offsets < vocab
        scaled = tl.load(base + offsets, mask=valid, other=float("-inf")).to(tl.float32) * inverse
        uniform = tl.rand(key, offsets)
        noise = -tl.log(1.0 - uniform)
        score = tl.where(greedy, scaled, scaled - tl.log(tl.maximum(noise, 1.1754943508222875e-38)))
        score = tl.where(valid, score, float("-inf"))
        better = score > best_score
        best_score = tl.where(better, score, best_score)
        best_index = tl.where(better, offsets, best_index)
    winner = tl.max(best_score, axis=0)
    token = tl.min(tl.where(best_score == winner, best_index, vocab), axis=0)
    chosen = tl.load(base + token).to(tl.float32) * inverse
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(log_prob_ptr + row, chosen - log_z)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                  tokens: torch.Tensor, log_probs: torch.Tensor) -> None:
    """Draw one token per row of ``logits [B, V]`` into ``tokens [B]`` (int64) and ``log_probs [B]`` (float32):
    ``temperature [B]`` (0: greedy), noise keyed by ``seeds [B]`` and ``counters [B]`` (int64). No top-k/top-p:
    rows that filter take `relax.backends.inference.sampling.sample_next_tokens`. Capturable in a CUDA graph."""
    _sample_kernel[(logits.shape[0],)](logits, logits.stride(0), temperature, seeds, counters, tokens, log_probs,
                                       vocab=logits.shape[1], BLOCK=2048, num_warps=8)
