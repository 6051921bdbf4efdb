"""Rollout decoding on a GPU: the engine core's paged runner beside its model-cache runner and `model.generate`.

For each setting (a model shape and a batch size), the same random prompts (``--prompt-len`` tokens, all
distinct, so no prefix is shared) get ``--new-tokens`` sampled tokens each (temperature 1, EOS ignored) from:

- ``core``: `EmbeddedEngine` on its engine core (paged KV pool, continuous batching, decode in CUDA graphs);
- ``previous``: `EmbeddedEngine` on the core's runner over the model's own forward and cache (``CoreSettings(mode=
  "off")``; until 2026-12-03 a decode loop of its own, which results from before that date measured);
- ``generate``: ``model.generate`` (sampling, static batch), the plain baseline;
- ``core_fp8`` (when named in ``--only``): the engine core with ``--rollout-fp8`` (`engine_core.fp8`; with
  ``--kv-cache-dtype fp8_e4m3`` its KV pool in FP8 too, `engine_core.kv_cache`), with the
  mismatch of its samples against the bf16 model (k1 KL and mean |delta log-prob| per token, teacher-forced on the
  first 32 sequences): the figure ``--use-tis`` reports in training;
- ``core_fp8_convert``: the same with the decode kernel as it was before it widened the FP8 pool's entries by their
  bits (`triton_attention`): the conversion instructions; the baseline of that change;
- ``core_triton_attention``, ``core_fp8_triton_attention``: ``core`` and ``core_fp8`` with decode attention in the
  Triton kernel (`triton_attention`) instead of the CUDA one (`cuda_attention`): the baselines of that kernel;
- ``core_weight_layouts``, ``core_weights_as_stored``: ``core`` with each kind of product's weight laid out as it
  measured fastest at engine start (`engine_core.weight_layouts`), and with every weight as the model stores it:
  the candidate and its baseline, whatever the engine's default;
- ``core_fp8_rowwise``: the same with the FP8 products as they were before the fused forward took
  `Fp8LayerProducts`: each linear's own forward (a quantisation kernel per product, GEMMs with row-wise scales);
  the baseline of that change.

Each is timed after a warm-up call (kernels compiled, graphs captured); the core engines report the median of
``--repeats`` calls on fresh prompts (the card's run-to-run spread was 15% on one call). Tokens/s counts new tokens over the
wall time of the call (prefill included). The HBM bound of a setting is the decode-only time of reading, at
every step, the weights once and every sequence's K/V so far, at ``--bandwidth`` bytes/s (by default the card's
measured copy rate, `benchmarks.cards`: 4.3 TB/s on the H200, 3.0 on the H100; the run measures it again and the
JSON gives both); the JSON gives each engine's fraction of it. That bound is not reachable on every
shape: at batch 256 the 4B shape's linear layers are compute-bound, and the wall time holds a prefill the bound
leaves out. So the JSON also gives the fraction of the roofline (`roofline_tokens_per_s`): the prefill's products at
``--flops``, each decode step's linears at the slower of their weights' reads and their products, its K/V reads at
``--bandwidth``.

    python -m benchmarks.engine_gpu                        # the issue's settings, all three engines
    python -m benchmarks.engine_gpu --only core            # the core alone (quick)
    python -m benchmarks.engine_gpu --tiny --device cpu    # smoke test of the script
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import platform
import time
from pathlib import Path

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.cards import COPY_BYTES_PER_S, copy_bytes_per_s, measure_copy_bytes_per_s
from benchmarks.grpo_step_gpu import QWEN3_0_6B, TINY, word_tokenizer
from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine
from relax.backends.inference.engine_core import weight_layouts

RESULTS = Path(__file__).resolve().parent / "results"
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                tie_word_embeddings=True)
SETTINGS = [("qwen3-0.6b", 64), ("qwen3-0.6b", 256), ("qwen3-0.6b", 512), ("qwen3-4b", 256)]
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-4b": QWEN3_4B, "tiny": TINY}


def build_model(shape: dict, device: str, dtype: torch.dtype) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(**shape, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return model.to(dtype).eval()


def decode_bytes(model) -> tuple[int, int]:
    """The bytes a decode step reads: the weights once, and per token of context its K/V in every layer."""
    config = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes_per_token = (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
                          * next(model.parameters()).element_size())
    return weight_bytes, kv_bytes_per_token


def hbm_bound_tokens_per_s(model, batch: int, prompt_len: int, new_tokens: int, bandwidth: float) -> float:
    """New tokens over the decode-only time of reading the weights and the K/V so far once per step."""
    weight_bytes, kv_bytes_per_token = decode_bytes(model)
    seconds = sum(weight_bytes + batch * (prompt_len + step) * kv_bytes_per_token for step in range(new_tokens))
    return batch * new_tokens / (seconds / bandwidth)


def roofline_tokens_per_s(model, batch: int, prompt_len: int, new_tokens: int, bandwidth: float,
                           flops: float) -> float:
    """New tokens over the time the card needs at the least for the whole call: the prefill's products at ``flops``,
    then every decode step's linear layers at the slower of reading their weights and computing them (at batch
    256 the 4B shape's products take 2.6 ms at 790 TFLOP/s, more than the 1.9 ms of reading its weights), and its
    K/V reads at ``bandwidth``. The HBM bound counts the weights' reads alone and leaves the prefill out."""
    config = model.config
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    weight_bytes, kv_bytes_per_token = decode_bytes(model)
    attention_flops = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim  # per (q, k) pair
    prefill = batch * (2 * matmul_params * prompt_len + attention_flops * prompt_len * (prompt_len + 1) / 2) / flops
    linears = max(weight_bytes / bandwidth, 2 * matmul_params * batch / flops)
    decode = sum(linears + batch * (prompt_len + step) * kv_bytes_per_token / bandwidth for step in range(new_tokens))
    return batch * new_tokens / (prefill + decode)


def requests_for(prompts: list[list[int]], new_tokens: int, tag: str) -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}-{i}", prompt, SamplingParams(max_new_tokens=new_tokens, temperature=1.0,
                                                                  ignore_eos=True, seed=i))
            for i, prompt in enumerate(prompts)]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_engine(engine: EmbeddedEngine, prompts: list[list[int]], new_tokens: int, device: str,
                repeats: int = 1) -> dict:
    """The median of ``repeats`` timed calls (each on its own prompts, so no call reuses another's cached
    prefix; the first is ``prompts``), with the host's time per decode step of the median call."""
    asyncio.run(engine.generate(requests_for(prompts[:8], 8, "warmup")))
    synchronize(device)
    calls = []
    for repeat in range(repeats):
        batch_prompts = prompts if repeat == 0 else torch.randint(
            2, engine.model.config.vocab_size, (len(prompts), len(prompts[0])),
            generator=torch.Generator().manual_seed(10_000 + repeat)).tolist()
        steps_before = engine.core.steps if engine.core else None
        if engine.core:
            engine.core.host_seconds.clear()
            engine.core.decode_steps = 0
        started = time.perf_counter()
        outputs = asyncio.run(engine.generate(requests_for(batch_prompts, new_tokens, f"timed{repeat}")))
        synchronize(device)
        seconds = time.perf_counter() - started
        produced = sum(len(o.output_ids) for o in outputs)
        result = {"seconds": seconds, "tokens_per_s": produced / seconds, "new_tokens": produced}
        if steps_before is not None:
            result["engine_steps"] = engine.core.steps - steps_before
            decode_steps = max(engine.core.decode_steps, 1)
            result["host_ms_per_decode_step"] = {phase: 1000 * seconds / decode_steps
                                                 for phase, seconds in engine.core.host_seconds.items()}
        calls.append(result)
    median = sorted(calls, key=lambda call: call["seconds"])[len(calls) // 2]
    if repeats > 1:
        median = {**median, "repeat_seconds": [round(call["seconds"], 3) for call in calls]}
    return median


def time_generate(model, prompts: list[list[int]], new_tokens: int, device: str) -> dict:
    input_ids = torch.tensor(prompts, device=device)  # equal lengths: no padding, no mask needed
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(input_ids[:8], max_new_tokens=8, min_new_tokens=8, **kwargs)
        synchronize(device)
        started = time.perf_counter()
        out = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    synchronize(device)
    seconds = time.perf_counter() - started
    produced = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    return {"seconds": seconds, "tokens_per_s": produced / seconds, "new_tokens": produced}


@contextlib.contextmanager
def fp8_pool_widened_by_conversions():
    """The decode kernel as it was before it widened FP8 entries by their bits: the conversion instructions. The
    engine's attention looks the kernel's entry point up at each call, so the CUDA graphs captured inside this
    block hold that kernel."""
    if not torch.cuda.is_available():  # the CPU path has no kernel to choose
        yield
        return
    from relax.backends.inference.engine_core import triton_attention

    kernel = triton_attention.paged_decode_attention
    triton_attention.paged_decode_attention = functools.partial(kernel, widen_by_bits=False)
    try:
        yield
    finally:
        triton_attention.paged_decode_attention = kernel


@contextlib.contextmanager
def attention_in_the_triton_kernel():
    """Decode attention in the Triton kernel, as before the CUDA kernel (`cuda_attention`) took it: the engine reads
    `cuda_attention.ENGINE_TAKES_IT` at each call, so graphs captured inside this block hold Triton's."""
    from relax.backends.inference.engine_core import cuda_attention

    taken, cuda_attention.ENGINE_TAKES_IT = cuda_attention.ENGINE_TAKES_IT, False
    try:
        yield
    finally:
        cuda_attention.ENGINE_TAKES_IT = taken


@contextlib.contextmanager
def weight_layouts_measured(measured: bool):
    """The engine built inside this block lays its products' weights out as they time fastest (`weight_layouts`),
    or keeps them as the model stores them."""
    measure = weight_layouts.MEASURE
    weight_layouts.MEASURE = measured
    try:
        yield
    finally:
        weight_layouts.MEASURE = measure


@contextlib.contextmanager
def fp8_products_in_the_linears():
    """The FP8 products as they were before the fused forward took `Fp8LayerProducts`: no layer products, so the
    fused forward calls the linears' own FP8 forwards (row-wise scales in the GEMM, one quantisation each)."""
    from relax.backends.inference.engine_core.fp8 import Fp8Linears

    layer_products = Fp8Linears.layer_products
    Fp8Linears.layer_products = lambda self: None
    try:
        yield
    finally:
        Fp8Linears.layer_products = layer_products


def time_fp8_core(model, tokenizer, prompts: list[list[int]], batch: int, args) -> dict:
    """The core with FP8 linears, and its samples' log-probs against the bf16 model's (the rollout/trainer
    mismatch); the model's linears are restored afterwards."""
    from relax.backends.inference.base import ScoreRequest

    pool = batch * (args.prompt_len + args.new_tokens + 16) + 4096
    engine = EmbeddedEngine(model, tokenizer, max_batch_size=batch,
                            core=CoreSettings(mode="on", max_total_tokens=pool, max_graph_batch=512, fp8=True,
                                              kv_cache_dtype=args.kv_cache_dtype))
    timing = time_engine(engine, prompts, args.new_tokens, args.device, args.repeats)
    outputs = asyncio.run(engine.generate(requests_for(prompts[:32], args.new_tokens, "mismatch")))
    engine.fp8.remove()
    del engine
    scorer = EmbeddedEngine(model, tokenizer, max_batch_size=4, core=CoreSettings(mode="off", max_total_tokens=4096))
    scored = asyncio.run(scorer.score([ScoreRequest(list(prompt) + list(output.output_ids), len(output.output_ids))
                                       for prompt, output in zip(prompts[:32], outputs)]))
    del scorer
    deltas = torch.tensor([a - b for output, score in zip(outputs, scored)
                           for a, b in zip(output.output_log_probs, score.log_probs)])
    timing["mismatch_k1_kl"] = deltas.mean().item()  # E_fp8[log p_fp8 - log p_bf16]
    timing["mismatch_mean_abs_log_prob_delta"] = deltas.abs().mean().item()
    return timing


def run_setting(shape_name: str, batch: int, args, engines: list[str]) -> dict:
    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(SHAPES[shape_name], device, dtype)
    tokenizer = word_tokenizer(model.config.vocab_size)
    generator = torch.Generator().manual_seed(batch)
    prompts = torch.randint(2, model.config.vocab_size, (batch, args.prompt_len), generator=generator).tolist()
    bound = hbm_bound_tokens_per_s(model, batch, args.prompt_len, args.new_tokens, args.bandwidth)
    roofline = roofline_tokens_per_s(model, batch, args.prompt_len, args.new_tokens, args.bandwidth, args.flops)
    result: dict = {"shape": shape_name, "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                    "hbm_bound_tokens_per_s": bound, "roofline_tokens_per_s": roofline}
    for name in engines:
        if device == "cuda":
            gc.collect()  # the previous engine's KV pool, held in reference cycles, goes before the next one starts
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if name == "generate":
            timing = time_generate(model, prompts, args.new_tokens, device)
        elif name == "core_fp8":
            timing = time_fp8_core(model, tokenizer, prompts, batch, args)
        elif name == "core_fp8_convert":
            with fp8_pool_widened_by_conversions():
                timing = time_fp8_core(model, tokenizer, prompts, batch, args)
        elif name == "core_fp8_triton_attention":
            with attention_in_the_triton_kernel():
                timing = time_fp8_core(model, tokenizer, prompts, batch, args)
        elif name == "core_fp8_rowwise":
            with fp8_products_in_the_linears():
                timing = time_fp8_core(model, tokenizer, prompts, batch, args)
        else:
            mode = "off" if name == "previous" else "on"
            pool = batch * (args.prompt_len + args.new_tokens + 16) + 4096
            variant = {"core_triton_attention": attention_in_the_triton_kernel,
                       "core_weight_layouts": functools.partial(weight_layouts_measured, True),
                       "core_weights_as_stored": functools.partial(weight_layouts_measured, False),
                       }.get(name, contextlib.nullcontext)
            with variant():
                engine = EmbeddedEngine(model, tokenizer, max_batch_size=batch,
                                        core=CoreSettings(mode=mode, max_total_tokens=pool, max_graph_batch=512))
                repeats = 1 if name == "previous" else args.repeats
                timing = time_engine(engine, prompts, args.new_tokens, device, repeats)
            decoder = getattr(getattr(engine.core, "runner", None), "decoder", None)
            if getattr(decoder, "weight_layouts", None):
                timing["weight_layouts"] = {kind: t._asdict() for kind, t in decoder.weight_layouts.items()}
            del engine, decoder
        if device == "cuda":
            timing["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        timing["fraction_of_hbm_bound"] = timing["tokens_per_s"] / bound
        timing["fraction_of_roofline"] = timing["tokens_per_s"] / roofline
        result[name] = timing
        print(f"{shape_name} batch {batch} {name:9s}: {timing['tokens_per_s']:10,.0f} tokens/s "
              f"({timing['seconds']:.2f} s; {100 * timing['fraction_of_hbm_bound']:.1f}% of the HBM bound "
              f"{bound:,.0f}; {100 * timing['fraction_of_roofline']:.1f}% of the roofline {roofline:,.0f}) "
              f"{timing.get('host_ms_per_decode_step', '')}", flush=True)
    core = result.get("core", {}).get("tokens_per_s")
    if core and "core_fp8" in result:
        result["speedup_fp8_vs_bf16"] = result["core_fp8"]["tokens_per_s"] / core
    if "core_fp8" in result and "core_fp8_convert" in result:
        result["speedup_fp8_over_previous_kernel"] = (result["core_fp8"]["tokens_per_s"]
                                                      / result["core_fp8_convert"]["tokens_per_s"])
    # each side: its variant, or ``core`` where that is the engine's default
    laid_out = result.get("core_weight_layouts", result.get("core") if weight_layouts.MEASURE else None)
    as_stored = result.get("core_weights_as_stored", None if weight_layouts.MEASURE else result.get("core"))
    if laid_out and as_stored:
        result["speedup_weight_layouts"] = laid_out["tokens_per_s"] / as_stored["tokens_per_s"]
    if core and "core_triton_attention" in result:
        result["speedup_cuda_attention"] = core / result["core_triton_attention"]["tokens_per_s"]
    if "core_fp8" in result and "core_fp8_triton_attention" in result:
        result["speedup_fp8_cuda_attention"] = (result["core_fp8"]["tokens_per_s"]
                                                / result["core_fp8_triton_attention"]["tokens_per_s"])
    if "core_fp8" in result and "core_fp8_rowwise" in result:
        result["speedup_fp8_over_rowwise_products"] = (result["core_fp8"]["tokens_per_s"]
                                                       / result["core_fp8_rowwise"]["tokens_per_s"])
    for baseline, key in (("generate", "speedup_vs_generate"), ("previous", "speedup_vs_previous")):
        if core and baseline in result:
            result[key] = core / result[baseline]["tokens_per_s"]
    del model
    return result


def profile_core(setting: tuple[str, int], args) -> None:
    """Kernel times of a short core run (16 new tokens) of ``setting``, as a table, to ``args.profile``."""
    from torch.profiler import ProfilerActivity, profile

    shape_name, batch = setting
    model = build_model(SHAPES[shape_name], args.device, torch.bfloat16)
    tokenizer = word_tokenizer(model.config.vocab_size)
    prompts = torch.randint(2, model.config.vocab_size, (batch, args.prompt_len)).tolist()
    engine = EmbeddedEngine(model, tokenizer, max_batch_size=batch,
                            core=CoreSettings(mode="on", max_total_tokens=batch * (args.prompt_len + 64) + 4096))
    asyncio.run(engine.generate(requests_for(prompts, 16, "warm")))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        asyncio.run(engine.generate(requests_for(prompts, 16, "prof")))
        synchronize(args.device)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    Path(args.profile).write_text(table + "\n\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
    print(table[:4000])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke test of the script)")
    parser.add_argument("--only", nargs="*", default=["core", "previous", "generate"],
                        choices=["core", "core_triton_attention", "core_weight_layouts", "core_weights_as_stored",
                                 "core_fp8", "core_fp8_convert",
                                 "core_fp8_triton_attention", "core_fp8_rowwise", "previous", "generate"])
    parser.add_argument("--settings", nargs="*", default=None, help="shape:batch, e.g. qwen3-0.6b:256")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="bytes/s the bounds assume (default: the card's measured copy rate, `cards`: the H200's "
                             "4.3e12, the H100's 3.0e12; the run measures it again and reports both)")
    parser.add_argument("--flops", type=float, default=790e12,
                        help="bf16 FLOP/s the roofline assumes: the H200's measured dense rate (989e12 datasheet)")
    parser.add_argument("--out", default=str(RESULTS / "engine_gpu.json"))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                        help="the KV pool of the core_fp8 engine (fp8_e4m3: FP8 rollout with an FP8 KV cache)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed calls of the core engines (their median is reported; the baselines run once)")
    parser.add_argument("--profile", default=None, help="write a torch-profiler table of core decode steps here")
    args = parser.parse_args()
    args.measured_bandwidth = measure_copy_bytes_per_s() if args.device == "cuda" else None
    if args.bandwidth is None:
        args.bandwidth = copy_bytes_per_s() if args.device == "cuda" else COPY_BYTES_PER_S["H200"]
    if args.tiny:
        settings = [("tiny", 8)]
    elif args.settings:
        settings = [(s.split(":")[0], int(s.split(":")[1])) for s in args.settings]
    else:
        settings = SETTINGS
    rows = []
    for shape, batch in settings:
        rows.append(run_setting(shape, batch, args, args.only))
        write_result(rows, args)  # after every setting: a run cut short keeps what it measured
    if args.profile:
        profile_core(settings[0], args)
    print(json.dumps(write_result(rows, args), indent=2))


def write_result(rows: list[dict], args) -> dict:
    summary = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "bandwidth_bytes_per_s": args.bandwidth, "copy_bytes_per_s_measured_in_this_run": args.measured_bandwidth,
    }
    for row in rows:
        prefix = f"{row['shape']}_bs{row['batch']}"
        for name in ("core", "core_triton_attention", "core_weight_layouts", "core_weights_as_stored", "core_fp8",
                     "core_fp8_convert", "core_fp8_triton_attention",
                     "core_fp8_rowwise", "previous", "generate"):
            if name in row:
                summary[f"{prefix}_{name}_tokens_per_s"] = round(row[name]["tokens_per_s"])
        for key in ("speedup_vs_generate", "speedup_vs_previous", "speedup_fp8_vs_bf16",
                    "speedup_cuda_attention", "speedup_weight_layouts", "speedup_fp8_over_previous_kernel",
                    "speedup_fp8_cuda_attention",
                    "speedup_fp8_over_rowwise_products"):
            if key in row:
                summary[f"{prefix}_{key}"] = round(row[key], 3)
        if "core" in row:
            summary[f"{prefix}_core_fraction_of_hbm_bound"] = round(row["core"]["fraction_of_hbm_bound"], 3)
            summary[f"{prefix}_core_fraction_of_roofline"] = round(row["core"]["fraction_of_roofline"], 3)
        if "core_fp8" in row:
            summary[f"{prefix}_fp8_mismatch_k1_kl"] = row["core_fp8"]["mismatch_k1_kl"]
    Path(args.out).write_text(json.dumps({**summary, "settings": rows}, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
