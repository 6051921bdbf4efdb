"""The trainer's packed causal attention on a GPU: PyTorch's FlashAttention-2 varlen kernel (what `flash_varlen`
runs) beside cuDNN's varlen attention (`torch.ops.aten._cudnn_attention_forward` with cumulative lengths, which
PyTorch's `varlen_attn` uses only on Blackwell), forward and forward + backward.

The 0.6B trainer's H100 profile put FlashAttention-2 at 24% of the step's kernel time (docs/training.md), work the
MFU's 6·N·tokens does not count: a faster kernel is the largest lever left on that shape. This measures, on a
micro-batch as the trainer packs it (``--tokens`` tokens of sequences of ``--min-len``..``--max-len``, fixed
seed), each kernel's time (CUDA events, the median of ``--repeats`` after warm-up) and its outputs' and gradients'
error against FlashAttention-2's. cuDNN is tried with the keys and values as they are (grouped-query) and
repeated to the query heads; a variant the installed PyTorch or cuDNN refuses is reported with its error.
``flex`` is FlexAttention compiled with a document-causal block mask (``flex_autotuned``: in the compiler's
max-autotune mode), its mask's build time reported apart (once a micro-batch in a trainer). The first of
``--variants`` is the baseline.

    python -m benchmarks.varlen_attention_gpu [--shapes 0.6b,4b] [--variants flash2,cudnn_gqa,cudnn_repeated,flex]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"0.6b": (16, 8, 128), "4b": (32, 8, 128)}  # query heads, KV heads, head dim


def packed_lengths(tokens: int, low: int, high: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(low, high + 1, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - tokens
    return [length for length in lengths if length > 0]


def flash(q, k, v, cu, max_len, scale):
    out, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False,
                                                       scale=scale)
    return out


def cudnn(q, k, v, cu, max_len, scale):
    result = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False,
                                                     scale=scale)
    return result[0]


def cudnn_repeated(q, k, v, cu, max_len, scale):
    groups = q.shape[1] // k.shape[1]
    return cudnn(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), cu, max_len, scale)


@functools.lru_cache(maxsize=2)
def _compiled_flex(mode: str | None):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False, mode=mode)


@functools.lru_cache(maxsize=4)
def document_causal_mask(cu_host: tuple[int, ...], device: str):
    """FlexAttention's block mask for a packed row: a query sees the keys of its own sequence up to itself."""
    from torch.nn.attention.flex_attention import create_block_mask

    lengths = torch.tensor(cu_host[1:]) - torch.tensor(cu_host[:-1])
    document = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)

    def mask(batch, head, query, key):
        return (document[query] == document[key]) & (query >= key)

    return create_block_mask(mask, None, None, cu_host[-1], cu_host[-1], device=device, _compile=True)


def _flex(q, k, v, cu, max_len, scale, mode=None):
    block_mask = document_causal_mask(tuple(cu.tolist()), str(q.device))
    out = _compiled_flex(mode)(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), block_mask=block_mask,
                               scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def flex(q, k, v, cu, max_len, scale):
    return _flex(q, k, v, cu, max_len, scale)


def flex_autotuned(q, k, v, cu, max_len, scale):
    return _flex(q, k, v, cu, max_len, scale, mode="max-autotune-no-cudagraphs")


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def bench_shape(name: str, args: argparse.Namespace) -> dict:
    heads, kv_heads, dim = SHAPES[name]
    lengths = packed_lengths(args.tokens, args.min_len, args.max_len, seed=0)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    max_len, scale = max(lengths), dim ** -0.5
    torch.manual_seed(0)
    q = torch.randn(args.tokens, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(args.tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(args.tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(args.tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    # causal attention FLOPs: 4·D per (query, key) pair for the two products, half the square per sequence
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    forward_flops = 4 * dim * heads * pairs
    result: dict = {"heads": heads, "kv_heads": kv_heads, "dim": dim, "tokens": args.tokens,
                    "sequences": len(lengths), "max_len": max_len}
    reference = None
    variants = {"flash2": flash, "cudnn_gqa": cudnn, "cudnn_repeated": cudnn_repeated, "flex": flex,
                "flex_autotuned": flex_autotuned}
    for variant in args.variants.split(","):
        fn = variants[variant]
        try:
            out = fn(q, k, v, cu, max_len, scale)
            out.backward(grad)
            out = out.detach()
            grads = [t.grad.clone() for t in (q, k, v)]
            for t in (q, k, v):
                t.grad = None

            def forward(fn=fn):
                with torch.no_grad():
                    fn(q, k, v, cu, max_len, scale)

            def forward_backward(fn=fn):
                fn(q, k, v, cu, max_len, scale).backward(grad)

            forward_ms = median_ms(forward, args.repeats)
            total_ms = median_ms(forward_backward, args.repeats)
        except Exception as error:  # noqa: BLE001 - a variant this PyTorch or cuDNN refuses is a result
            result[variant] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            print(f"{name} {variant}: {result[variant]['error']}", flush=True)
            continue
        entry = {"forward_ms": round(forward_ms, 3), "forward_backward_ms": round(total_ms, 3),
                 "forward_tflops": round(forward_flops / forward_ms / 1e9, 1),
                 "forward_backward_tflops": round(3.5 * forward_flops / total_ms / 1e9, 1)}
        if reference is None:
            reference = (out, grads)
        else:
            entry["output_error"] = float((out.float() - reference[0].float()).norm() / reference[0].float().norm())
            entry["grad_errors"] = [float((a.float() - b.float()).norm() / b.float().norm())
                                    for a, b in zip(grads, reference[1])]
        result[variant] = entry
        print(f"{name} {variant}: {entry}", flush=True)
        for t in (q, k, v):
            t.grad = None
    if "flex" in args.variants:  # the block mask is made once a micro-batch (every layer shares it)
        cu_host = tuple(cu.tolist())
        document_causal_mask.cache_clear()
        result["flex_block_mask_ms"] = round(median_ms(lambda: document_causal_mask.__wrapped__(cu_host, "cuda"),
                                                       args.repeats), 3)
    baseline, *others = args.variants.split(",")
    for variant in others:
        if "forward_backward_ms" in result.get(variant, {}) and "forward_backward_ms" in result.get(baseline, {}):
            result[f"{variant}_speedup"] = round(result[baseline]["forward_backward_ms"]
                                                 / result[variant]["forward_backward_ms"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="0.6b,4b")
    parser.add_argument("--tokens", type=int, default=32768, help="one packed micro-batch")
    parser.add_argument("--min-len", type=int, default=288, help="prompt 256 + the shortest response, 32")
    parser.add_argument("--max-len", type=int, default=1280, help="prompt 256 + the longest response, 1024")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--variants", default="flash2,cudnn_gqa,cudnn_repeated,flex",
                        help="the first is the baseline the others' errors and speedups are against")
    parser.add_argument("--out", type=Path, default=RESULTS / "varlen_attention_gpu.json")
    args = parser.parse_args()
    shapes = {name: bench_shape(name, args) for name in args.shapes.split(",")}
    headline = {f"{name}_{key}": value for name, shape in shapes.items() for key, value in shape.items()
                if key.endswith("_speedup")}
    report = {"benchmark": "varlen_attention_gpu", **headline, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "shapes": shapes}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(headline, indent=2))


if __name__ == "__main__":
    main()
