"""The decode graphs' sampler on its own: the inverse-CDF kernel (`triton_sampling.sample_tokens`: one uniform per
row, one read of the logits) against the exponential race it replaced (Exp(1) noise for every vocabulary entry from
Philox, kept below as the baseline), both timed inside CUDA graphs as the engine runs them, over bf16 logits of the
Qwen3 vocabulary; and the new kernel's tokens checked against the eager path's (`sample_next_tokens` with the same
`CounterNoise`). Writes ``benchmarks/results/sampler_gpu.json``.

    python -m benchmarks.sampler_gpu [--batches 64 256 512]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.cards import copy_bytes_per_s
from relax.backends.inference.base import SamplingParams
from relax.backends.inference.sampling import BatchSampling, CounterNoise, sample_next_tokens
from relax.backends.inference.triton_sampling import sample_tokens

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 151936


# ---- the baseline: the exponential race (relax/backends/inference/triton_sampling.py until 2026-12-05) ----------
@triton.jit
def _race_quarter(logits_row, offsets, uniform, inverse, greedy, vocab):
    valid = offsets < vocab
    scaled = tl.load(logits_row + offsets, mask=valid, other=float("-inf")).to(tl.float32) * inverse
    score = tl.where(greedy, scaled, scaled - tl.log(tl.maximum(-tl.log(1.0 - uniform), 1.1754943508222875e-38)))
    return scaled, tl.where(valid, score, float("-inf")), valid


@triton.jit
def _race_partial_kernel(logits_ptr, stride, temperature_ptr, seed_ptr, counter_ptr, max_ptr, sum_ptr, score_ptr,
                         index_ptr, vocab: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    inverse = tl.where(greedy, 1.0, 1.0 / temperature)
    key = tl.load(seed_ptr + row) * -7046029254386353131 + tl.load(counter_ptr + row) * -4658895280553007687
    key = (key ^ (key >> 31)) & 0x7FFFFFFFFFFFFFFF
    counters = chunk * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    u0, u1, u2, u3 = tl.rand4x(key, counters)
    logits_row = logits_ptr + row.to(tl.int64) * stride
    s0, g0, v0 = _race_quarter(logits_row, 4 * counters, u0, inverse, greedy, vocab)
    s1, g1, v1 = _race_quarter(logits_row, 4 * counters + 1, u1, inverse, greedy, vocab)
    s2, g2, v2 = _race_quarter(logits_row, 4 * counters + 2, u2, inverse, greedy, vocab)
    s3, g3, v3 = _race_quarter(logits_row, 4 * counters + 3, u3, inverse, greedy, vocab)
    maximum = tl.maximum(tl.maximum(tl.max(s0, axis=0), tl.max(s1, axis=0)),
                         tl.maximum(tl.max(s2, axis=0), tl.max(s3, axis=0)))
    total = (tl.sum(tl.where(v0, tl.exp(s0 - maximum), 0.0), axis=0)
             + tl.sum(tl.where(v1, tl.exp(s1 - maximum), 0.0), axis=0)
             + tl.sum(tl.where(v2, tl.exp(s2 - maximum), 0.0), axis=0)
             + tl.sum(tl.where(v3, tl.exp(s3 - maximum), 0.0), axis=0))
    best = tl.maximum(tl.maximum(tl.max(g0, axis=0), tl.max(g1, axis=0)),
                      tl.maximum(tl.max(g2, axis=0), tl.max(g3, axis=0)))
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
def _race_combine_kernel(logits_ptr, stride, temperature_ptr, max_ptr, sum_ptr, score_ptr, index_ptr, token_ptr,
                         log_prob_ptr, vocab: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr):
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


def race_sample_tokens(logits, temperature, seeds, counters, tokens, log_probs, block: int = 4096) -> None:
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, block)
    partial = torch.empty((3, rows, chunks), dtype=torch.float32, device=logits.device)
    index = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _race_partial_kernel[(rows, chunks)](logits, logits.stride(0), temperature, seeds, counters, partial[0],
                                         partial[1], partial[2], index, vocab=vocab, CHUNKS=chunks, BLOCK=block,
                                         num_warps=8)
    _race_combine_kernel[(rows,)](logits, logits.stride(0), temperature, partial[0], partial[1], partial[2], index,
                                  tokens, log_probs, vocab=vocab, CHUNKS=chunks,
                                  BLOCK_C=triton.next_power_of_2(chunks), num_warps=1)


# ---- the measurement ---------------------------------------------------------------------------------------------
def graph_us(sample, logits, temperature, seeds, counters) -> float:
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    log_probs = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    return 1000 * triton.testing.do_bench_cudagraph(
        lambda: sample(logits, temperature, seeds, counters, tokens, log_probs), rep=200, return_mode="median")


def agreement(logits, temperature, seeds, counters) -> dict:
    """The kernel's tokens and log-probs against the eager path's on the same logits and keys (the two sum the same
    float32 weights in different orders, so a draw whose target lies at a token boundary may part)."""
    rows = logits.shape[0]
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    log_probs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    sample_tokens(logits, temperature, seeds, counters, tokens, log_probs)
    params = [SamplingParams(temperature=float(t)) for t in temperature.tolist()]
    eager_tokens, eager_log_probs = sample_next_tokens(logits, BatchSampling.from_params(params, logits.device),
                                                       CounterNoise(seeds, counters))
    return {"rows": rows, "same_tokens": int((tokens == eager_tokens).sum()),
            "log_prob_max_abs_diff": float((log_probs - eager_log_probs).abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--output", type=Path, default=RESULTS / "sampler_gpu.json")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="bytes/s the card copies (default: the measured figure for an H200 or an H100)")
    args = parser.parse_args()
    device = torch.device("cuda")
    name = torch.cuda.get_device_name()
    bandwidth = args.bandwidth or copy_bytes_per_s(name)
    torch.manual_seed(0)
    report = {"benchmark": "sampler_gpu", "device": name, "copy_bytes_per_s": bandwidth, "vocab": VOCAB,
              "logits_dtype": "bfloat16", "date": time.strftime("%Y-%m-%d"), "settings": {}}
    for batch in args.batches:
        logits = (torch.randn(batch, VOCAB, device=device) * 3).to(torch.bfloat16)
        temperature = torch.where(torch.arange(batch, device=device) % 8 == 0, 0.0, 1.0)  # an eighth greedy
        seeds = torch.arange(batch, device=device, dtype=torch.int64) * 7919 + 11
        counters = torch.full((batch,), 300, device=device, dtype=torch.int64)
        race = graph_us(race_sample_tokens, logits, temperature, seeds, counters)
        inverse = graph_us(sample_tokens, logits, temperature, seeds, counters)
        bound = logits.numel() * logits.element_size() / bandwidth * 1e6
        setting = {"race_us": round(race, 1), "inverse_cdf_us": round(inverse, 1),
                   "speedup": round(race / inverse, 2), "logits_read_bound_us": round(bound, 1),
                   **agreement(logits, temperature, seeds, counters)}
        report["settings"][str(batch)] = setting
        print(f"batch {batch}: exponential race {race:.1f} us, inverse CDF {inverse:.1f} us -> {race / inverse:.2f}x "
              f"(logits read once: {bound:.1f} us); {setting['same_tokens']}/{batch} tokens as the eager path, "
              f"log-probs within {setting['log_prob_max_abs_diff']:.1e}", flush=True)
    headline = report["settings"].get("256") or next(iter(report["settings"].values()))
    report = {**{f"bs256_{key}": value for key, value in headline.items()}, **report}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
