"""The trainer's packed attention on CPU: sequences padded into buckets of similar lengths (`_padded_attend`, the
path now) against one SDPA call per sequence (`_per_sequence_attend`, the path before), in the same process.

Two measurements, each a forward and backward, alternating the two paths for ``--rounds`` rounds (median taken):

- ``attention``: one layer's attention alone, the quickstart model's heads (4 query, 2 key/value, 64 wide), on a
  micro-batch of the quickstart's shape (128 sequences of 14-22 tokens) and on a long-tailed one (one sequence of
  512 tokens among 63 of 16-48: the buckets keep the long one apart, so padding stays bounded);
- ``model``: the quickstart model's whole decoder (examples/quickstart/model, 4 layers) on the quickstart's
  micro-batch, packed as the trainer packs it (one row, ``relax_packed``).

    python -m benchmarks.packed_attention_cpu            # writes benchmarks/results/packed_attention_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from relax.backends.training import varlen_attention
from relax.backends.training.varlen_attention import PACKING_KWARG, PackedAttention, length_buckets

REPO = Path(__file__).resolve().parent.parent
QUICKSTART_MODEL = REPO / "examples" / "quickstart" / "model"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "packed_attention_cpu.json"
PATHS = {"per_sequence": varlen_attention._per_sequence_attend, "padded": varlen_attention._padded_attend}


def _packing(lengths: list[int]) -> PackedAttention:
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return PackedAttention.of(cu_seqlens, max(lengths), torch.device("cpu"))


def _median_seconds(step: Callable[[], None], repeats: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _compare(steps: dict[str, Callable[[], None]], rounds: int, repeats: int) -> dict:
    """Each path's median seconds per step over ``rounds`` alternating rounds, and the ratio before/now."""
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for round_index in range(rounds):
        order = list(steps) if round_index % 2 == 0 else list(reversed(steps))
        for name in order:
            seconds[name].append(_median_seconds(steps[name], repeats))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {"per_sequence_s": medians["per_sequence"], "padded_s": medians["padded"],
            "speedup": medians["per_sequence"] / medians["padded"]}


def attention_case(lengths: list[int], rounds: int, repeats: int) -> dict:
    heads, kv_heads, dim = 4, 2, 64
    packing = _packing(lengths)
    tokens = sum(lengths)
    inputs = [torch.randn(tokens, h, dim, requires_grad=True) for h in (heads, kv_heads, kv_heads)]

    def step(path):
        def run() -> None:
            out = path(*inputs, packing, dim ** -0.5, 0.0)
            out.square().sum().backward()
        return run

    with torch.no_grad():  # the two paths agree before either is timed
        before, now = (path(*inputs, packing, dim ** -0.5, 0.0) for path in PATHS.values())
    result = _compare({name: step(path) for name, path in PATHS.items()}, rounds, repeats)
    buckets = length_buckets(lengths)
    return {"sequences": len(lengths), "tokens": tokens, "longest": max(lengths), "buckets": len(buckets),
            "padded_scores_over_needed": sum(len(b) * lengths[b[0]] ** 2 for b in buckets)
            / sum(length ** 2 for length in lengths),
            "max_abs_difference": (before - now).abs().max().item(), **result}


def model_case(lengths: list[int], rounds: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    from relax.backends.training.response_model import packed_mask_placeholder
    from relax.backends.training.varlen_attention import use_packed_attention

    model = AutoModelForCausalLM.from_pretrained(str(QUICKSTART_MODEL), dtype=torch.float32)
    body = model.base_model
    use_packed_attention(body)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (1, sum(lengths)), generator=generator)
    position_ids = torch.cat([torch.arange(length) for length in lengths])[None]
    packing = _packing(lengths)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = body(input_ids=input_ids, attention_mask=packed_mask_placeholder(input_ids.device),
                   position_ids=position_ids, use_cache=False, **{PACKING_KWARG: packing})
        out.last_hidden_state.square().mean().backward()

    def with_path(path):
        def run() -> None:
            saved = varlen_attention._padded_attend
            varlen_attention._padded_attend = path  # the forward calls this name
            try:
                step()
            finally:
                varlen_attention._padded_attend = saved
        return run

    parameters = sum(p.numel() for p in model.parameters())
    result = _compare({name: with_path(path) for name, path in PATHS.items()}, rounds, repeats)
    return {"model": str(QUICKSTART_MODEL.relative_to(REPO)), "parameters": parameters, "layers":
            model.config.num_hidden_layers, "sequences": len(lengths), "tokens": sum(lengths), **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per round and path")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    draw = random.Random(0)
    quickstart = [draw.randint(14, 22) for _ in range(128)]
    long_tailed = [512] + [draw.randint(16, 48) for _ in range(63)]
    cases = {"attention_quickstart": attention_case(quickstart, args.rounds, args.repeats),
             "attention_long_tailed": attention_case(long_tailed, args.rounds, args.repeats),
             "model_quickstart": model_case(quickstart, args.rounds, args.repeats)}
    result = {
        "model_step_speedup": cases["model_quickstart"]["speedup"],
        "attention_quickstart_speedup": cases["attention_quickstart"]["speedup"],
        "attention_long_tailed_speedup": cases["attention_long_tailed"]["speedup"],
        "threads": args.threads, "torch": torch.__version__, "machine": platform.machine(),
        **cases,
    }
    for name, case in cases.items():
        print(f"{name:24s} per-sequence {case['per_sequence_s'] * 1e3:8.1f} ms  padded {case['padded_s'] * 1e3:8.1f} ms"
              f"  speedup {case['speedup']:.2f}x")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
