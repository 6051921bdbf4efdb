"""The decode graphs' sampler (`triton_sampling.sample_tokens`) draws as the eager path does: the same tokens for the
same logits and keys (one uniform per row inverted through the cumulative weights), log-probs ``log_softmax(logits /
T)`` at the token, greedy rows the lowest-id argmax, -inf logits never drawn. On the GPU (``-m gpu``), and on CPU
through Triton's interpreter where Triton is installed (it is not in the CPU set-up)."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

from relax.backends.inference.base import SamplingParams
from relax.backends.inference.sampling import BatchSampling, CounterNoise, sample_next_tokens


def hard_logits(rows: int, vocab: int, device) -> torch.Tensor:
    """Random logits with the cases a chunked kernel can get wrong: a row with one live token, rows whose first
    chunks are all -inf, exact ties for the argmax, bf16-rounded values."""
    generator = torch.Generator().manual_seed(rows * 31 + vocab)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    logits[1] = float("-inf")
    logits[1, vocab - 3] = 0.5
    logits[2, : 2 * vocab // 3] = float("-inf")
    logits[3, [5, vocab // 2]] = 50.0  # a tie, greedy takes the lower id
    logits[4] = logits[4].to(torch.bfloat16).float()
    return logits.to(device)


def at_a_boundary(logits: torch.Tensor, temperature: float, uniform: float, a: int, b: int) -> bool:
    """Whether the row's target lies, in exact float64 arithmetic, within 1e-6 of the total from the boundary after
    the lower of tokens ``a`` and ``b``: where rounding may take either side of it."""
    scaled = logits.double() / temperature
    cumulative = (scaled - scaled.max()).exp().cumsum(0)
    target = uniform * cumulative[-1]
    return bool(abs(cumulative[min(a, b)] - target) <= 1e-6 * cumulative[-1])


def compare_with_eager(rows: int, vocab: int, device, block: int, num_warps: int) -> None:
    from relax.backends.inference.triton_sampling import sample_tokens

    logits = hard_logits(rows, vocab, device)
    temperature = torch.tensor([0.0 if row % 4 == 3 else (0.6 if row % 2 else 1.0) for row in range(rows)],
                               device=device)
    seeds = torch.arange(rows, device=device, dtype=torch.int64) * 7919 + 11
    counters = torch.arange(rows, device=device, dtype=torch.int64) + 300
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    log_probs = torch.empty(rows, dtype=torch.float32, device=device)
    sample_tokens(logits, temperature, seeds, counters, tokens, log_probs, block=block, num_warps=num_warps)
    params = [SamplingParams(temperature=float(t)) for t in temperature.tolist()]
    noise = CounterNoise(seeds, counters)
    eager_tokens, _ = sample_next_tokens(logits, BatchSampling.from_params(params, device), noise)
    uniforms = noise.uniforms().tolist()
    for row, (token, eager) in enumerate(zip(tokens.tolist(), eager_tokens.tolist())):
        if token != eager:  # only where the two roundings straddle a token boundary; never on a greedy row
            assert temperature[row] > 0 and at_a_boundary(logits[row].cpu(), float(temperature[row]), uniforms[row],
                                                          token, eager), (row, token, eager)
    scale = torch.where(temperature > 0, temperature, 1.0)[:, None]  # greedy rows: log_softmax of the logits
    reference = (logits.float() / scale).log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(log_probs, reference, atol=2e-5, rtol=0)
    assert torch.isfinite(logits.gather(1, tokens[:, None])).all()
    assert tokens[1] == vocab - 3 and tokens[3] == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows, vocab, block", [(512, 151936, 4096), (16, 1000, 128), (9, 4096, 4096)])
def test_the_kernel_draws_the_eager_paths_tokens_on_the_gpu(rows, vocab, block):
    compare_with_eager(rows, vocab, torch.device("cuda"), block, num_warps=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernels_draws_follow_the_softmax_on_the_gpu():
    from relax.backends.inference.triton_sampling import sample_tokens

    draws, vocab = 40_000, 5000
    weights = torch.zeros(vocab)
    weights[[3, 1500, 4095, 4999]] = torch.tensor([1.0, 2.0, 5.0, 0.5])  # across chunks of 4096 ids
    logits = weights.log().cuda().expand(draws, -1).contiguous()
    tokens = torch.empty(draws, dtype=torch.int64, device="cuda")
    log_probs = torch.empty(draws, device="cuda")
    sample_tokens(logits, torch.ones(draws, device="cuda"), torch.arange(draws, device="cuda", dtype=torch.int64),
                  torch.full((draws,), 7, device="cuda", dtype=torch.int64), tokens, log_probs)
    counts = torch.bincount(tokens.cpu(), minlength=vocab).double()
    assert counts[weights == 0].sum() == 0
    expected = weights.double() / weights.sum() * draws
    for token in (weights > 0).nonzero().flatten().tolist():
        sigma = math.sqrt(expected[token] * (1 - expected[token] / draws))
        assert abs(counts[token] - expected[token]) < 5 * sigma, (token, counts[token], expected[token])
    assert torch.allclose(log_probs.cpu(), (weights / weights.sum()).log()[tokens.cpu()], atol=1e-5)


INTERPRETED = """
import torch
from tests.backends.inference.test_triton_sampling import compare_with_eager
compare_with_eager(12, 1000, torch.device("cpu"), block=128, num_warps=1)
compare_with_eager(5, 300, torch.device("cpu"), block=512, num_warps=1)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CPU set-up)")
def test_the_kernel_draws_the_eager_paths_tokens_in_tritons_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read when the kernels are defined: a fresh interpreter
    done = subprocess.run([sys.executable, "-c", INTERPRETED], check=False, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
