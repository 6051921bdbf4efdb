"""The trainer's elementwise and attention kernels, each beside the one it replaced, on the shapes of a packed
Qwen3-0.6B micro-batch (32,768 tokens; 16 query and 8 KV heads of 128; hidden 1,024).

- RMSNorm forward + backward: liger-kernel's (the path before) against `compiled_norm` (Inductor) and the
  eager reference, for the layer norms' rows of 1,024 and the per-head query/key norms' rows of 128; time, the
  bandwidth it reaches (bytes: read x, write y; read x and dy, write dx), and the largest error of y, dx and dw
  against the reference computed in float32;
- packed causal attention forward + backward with grouped-query heads: keys and values repeated to the query
  heads (the path before) against the FlashAttention kernel reading them per group (`flash_varlen._flash_gqa`);
- Qwen3's per-head query/key norms and RoPE forward + backward: the compiled norms then liger's RoPE (the path
  before), `torch.compile` of the same math in one graph, and the Triton kernels of `triton_qk_rope`.

Every variant runs in this one process on one card; times are medians of CUDA-event timings after warm-up.
Writes ``benchmarks/results/train_kernels_gpu.json`` (headline speedups at the top level).

    python -m benchmarks.train_kernels_gpu
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from relax.backends.models.flash_varlen import causal_varlen_attention, repeat_kv_attention
from relax.backends.training.compiled_norm import compiled_rms_norm, rms_norm_reference

RESULTS = Path(__file__).resolve().parent / "results"
BANDWIDTH = 4.3e12  # bytes/s the H200 copies at
H100_BANDWIDTH = 3.35e12  # the H100 SXM's


def bandwidth() -> float:
    """The HBM bandwidth of this card (the H200's unless it is an H100)."""
    return H100_BANDWIDTH if "H100" in torch.cuda.get_device_name() else BANDWIDTH


def median_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """The card's time for ``fn``'s kernels: the stream is held by a sleep kernel while the host queues them, so
    the launches' host cost (which a training step's deep queue hides) is not what is timed."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(20_000_000)  # ~10 ms at the H200's clock: longer than queueing any variant here
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def liger_rms_norm(hidden, weight, eps):
    from liger_kernel.transformers.functional import liger_rms_norm as liger

    return liger(hidden, weight, eps, 0.0, "llama", False)


def bench_norm(rows: int, cols: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(cols, device="cuda")).requires_grad_()
    dy = torch.randn_like(x)
    eps = 1e-6
    xr = x.float().requires_grad_()
    wr = w.detach().clone().requires_grad_()
    ref = rms_norm_reference(xr, wr, eps)  # float32 throughout: the yardstick of every variant's error
    ref.backward(dy.float())
    out = {"rows": rows, "cols": cols}
    for name, fn in (("liger", liger_rms_norm), ("compiled", compiled_rms_norm), ("eager", rms_norm_reference)):
        xi = x.detach().clone().requires_grad_()
        wi = w.detach().clone().requires_grad_()

        def step(fn=fn, xi=xi, wi=wi):
            xi.grad = wi.grad = None
            fn(xi, wi, eps).backward(dy)

        ms = median_ms(step)
        y = fn(xi, wi, eps)
        xi.grad = wi.grad = None
        y.backward(dy)
        moved = 5 * x.numel() * x.element_size()
        out[name] = {"ms": round(ms, 4), "bandwidth_fraction": round(moved / (ms / 1e3) / bandwidth(), 3),
                     "max_err_y": (y.float() - ref.detach()).abs().max().item(),
                     "max_err_dx": (xi.grad.float() - xr.grad).abs().max().item(),
                     "max_rel_err_dw": ((wi.grad - wr.grad).abs().max() / wr.grad.abs().max()).item()}
    out["speedup_compiled_vs_liger"] = round(out["liger"]["ms"] / out["compiled"]["ms"], 2)
    return out


def bench_gqa(tokens: int = 32768, heads: int = 16, kv_heads: int = 8, dim: int = 128) -> dict:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < tokens:  # RL-shaped: 256-token prompts and responses of 32-1024 tokens
        length = min(256 + int(torch.randint(32, 1025, (1,), generator=generator)), tokens - total)
        lengths.append(length)
        total += length
    cu = torch.tensor([0] + lengths, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    scale = dim ** -0.5
    results: dict = {"tokens": tokens, "sequences": len(lengths), "heads": heads, "kv_heads": kv_heads}
    grads = {}
    for name, fn in (("repeat_kv", repeat_kv_attention), ("grouped", causal_varlen_attention)):
        qi, ki, vi = (t.detach().clone().requires_grad_() for t in (q, k, v))

        def step(fn=fn, qi=qi, ki=ki, vi=vi):
            qi.grad = ki.grad = vi.grad = None
            fn(qi, ki, vi, cu, cu, max(lengths), max(lengths), scale).backward(dout)

        ms = median_ms(step)
        step()
        grads[name] = (fn(qi, ki, vi, cu, cu, max(lengths), max(lengths), scale).detach(), qi.grad, ki.grad, vi.grad)
        results[name] = {"ms": round(ms, 4)}
    a, b = grads["repeat_kv"], grads["grouped"]
    results["max_abs_diff"] = {n: (x.float() - y.float()).abs().max().item() for n, x, y in zip(("out", "dq", "dk", "dv"),
                                                                                                 a, b)}
    results["speedup_grouped_vs_repeat_kv"] = round(results["repeat_kv"]["ms"] / results["grouped"]["ms"], 2)
    return results


def qk_rope_inputs(tokens: int, heads: int, kv_heads: int, dim: int, base: float = 1e6):
    """Queries, keys (bf16, ``[1, T, H, D]``), the two norm weights, bf16 cos/sin of positions 0..T-1 and the
    incoming gradients of the queries and keys, seeded."""
    torch.manual_seed(0)
    q = torch.randn(1, tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    weights = [1 + 0.1 * torch.randn(dim, device="cuda") for _ in range(2)]
    angles = torch.arange(tokens, device="cuda").float()[:, None] * base ** -torch.linspace(0, 1, dim // 2,
                                                                                           device="cuda")
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1)[None].to(torch.bfloat16) for f in (torch.cos, torch.sin))
    return q, k, weights, cos, sin, torch.randn_like(q), torch.randn_like(k)


def separate_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps):
    """The path before `triton_qk_rope`: the compiled per-head norms, then liger's RoPE."""
    from liger_kernel.transformers.functional import liger_rope

    q, k = compiled_rms_norm(q, q_weight, eps), compiled_rms_norm(k, k_weight, eps)
    q, k = liger_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, None, 1)
    return q.transpose(1, 2), k.transpose(1, 2)


def qk_outputs_and_grads(fn, inputs, cos, sin, dq, dk) -> list[torch.Tensor]:
    """``fn``'s queries and keys and the gradients of ``inputs`` (q, k and the two weights), in float32."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves, cos, sin, 1e-6)
    torch.autograd.backward(out, (dq.to(out[0].dtype), dk.to(out[1].dtype)))
    return [t.detach().float() for t in out] + [t.grad.float() for t in leaves]


def bench_qk_rope(tokens: int = 32768, heads: int = 16, kv_heads: int = 8, dim: int = 128) -> dict:
    """Qwen3's per-head query/key norms and RoPE, forward + backward: the separate kernels (the compiled norms, then
    liger's RoPE: the path before), `torch.compile` of the same math in one graph, and the Triton kernels of
    `triton_qk_rope`; the bandwidth each reaches (bytes: read q, k and write them, forward; read q, k and the two
    gradients and write two, backward) and the largest error against float32."""
    from relax.backends.training.fused_qk_rope import fused_qk_norm_rope, qk_norm_rope_reference

    q, k, weights, cos, sin, dq, dk = qk_rope_inputs(tokens, heads, kv_heads, dim)

    def grads(fn, *inputs):
        return qk_outputs_and_grads(fn, inputs, cos, sin, dq, dk)

    reference = grads(qk_norm_rope_reference, q.float(), k.float(), *weights)
    moved = (q.numel() + k.numel()) * 2 * 5  # forward: read + write; backward: read x, dy, write dx
    out: dict = {"tokens": tokens, "heads": heads, "kv_heads": kv_heads}
    for name, fn in (("separate", separate_qk_norm_rope), ("compiled", torch.compile(qk_norm_rope_reference, dynamic=True)),
                     ("triton", fused_qk_norm_rope)):
        leaves = [t.clone().requires_grad_() for t in (q, k, *weights)]

        def step(fn=fn, leaves=leaves):
            for leaf in leaves:
                leaf.grad = None
            torch.autograd.backward(fn(*leaves[:2], *leaves[2:], cos, sin, 1e-6), (dq, dk))

        ms = median_ms(step)
        got = grads(fn, q, k, *weights)
        out[name] = {"ms": round(ms, 4), "bandwidth_fraction": round(moved / (ms / 1e3) / bandwidth(), 3),
                     "max_err": {n: (a - b).abs().max().item() for n, a, b in
                                 zip(("q", "k", "dq", "dk", "dq_weight", "dk_weight"), got, reference)}}
    out["speedup_triton_vs_separate"] = round(out["separate"]["ms"] / out["triton"]["ms"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=RESULTS / "train_kernels_gpu.json")
    args = parser.parse_args()
    norms = {f"{rows}x{cols}": bench_norm(rows, cols) for rows, cols in ((32768, 1024), (32768 * 16, 128),
                                                                          (32768 * 8, 128))}
    for key, row in norms.items():
        print(f"rmsnorm {key}: liger {row['liger']['ms']:.3f} ms ({row['liger']['bandwidth_fraction']:.0%} of HBM), "
              f"compiled {row['compiled']['ms']:.3f} ms ({row['compiled']['bandwidth_fraction']:.0%}), eager "
              f"{row['eager']['ms']:.3f} ms: {row['speedup_compiled_vs_liger']}x", flush=True)
    gqa = bench_gqa()
    print(f"gqa attention: repeat_kv {gqa['repeat_kv']['ms']:.3f} ms, grouped {gqa['grouped']['ms']:.3f} ms: "
          f"{gqa['speedup_grouped_vs_repeat_kv']}x; max diffs {gqa['max_abs_diff']}", flush=True)
    qk = bench_qk_rope()
    print(f"qk norm + rope: separate {qk['separate']['ms']:.3f} ms, compiled {qk['compiled']['ms']:.3f} ms, triton "
          f"{qk['triton']['ms']:.3f} ms ({qk['triton']['bandwidth_fraction']:.0%} of HBM): "
          f"{qk['speedup_triton_vs_separate']}x; errors {qk['separate']['max_err']} / {qk['triton']['max_err']}",
          flush=True)
    out = {"benchmark": "train_kernels_gpu",
           "qk_norm_rope_speedup_triton_vs_separate": qk["speedup_triton_vs_separate"],
           **{f"rmsnorm_{key}_speedup_compiled_vs_liger": row["speedup_compiled_vs_liger"] for key, row in norms.items()},
           "gqa_speedup_grouped_vs_repeat_kv": gqa["speedup_grouped_vs_repeat_kv"],
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rmsnorm": norms, "gqa_attention": gqa,
           "qk_norm_rope": qk}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)}, indent=2))


if __name__ == "__main__":
    main()
