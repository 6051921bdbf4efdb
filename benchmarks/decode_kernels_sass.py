"""The paged decode-attention kernel compiled for Hopper (sm_90) on a machine without a GPU, and what its main loop
costs in instructions: registers, shared memory and the SASS instructions of one trip of the loop over the context
(one warp's share of ``BLOCK_N`` tokens of one sequence's KV head), by opcode.

Triton's wheel carries ptxas and cuobjdump, so a kernel's instruction stream can be read here, variant by variant,
and compared with the bf16 kernel's; what it costs in time is the device's to say. A lesson of issue 32: two
candidates that took the FP8 loop from 1,746 instructions to 1,078 (values stored by page, fp16 products) measured
0.85x on an H100 (`benchmarks/results/decode_kernels_fp8_candidates_h100_gpu.json`, docs/engines.md): fewer
instructions is a reason to measure, not a result, and they were removed. What bound that kernel was one pipe, not
the count: Nsight Compute found its XU pipe (the e4m3 -> fp16 -> bf16 conversions, the `F2F`/`F2FP` rows here, at a
quarter of the integer pipe's rate) 64% busy; widening the bytes by integer instructions instead (`PRMT`/`LOP3`
here) took 7% off the count and 15% off the time (`benchmarks/results/decode_kernels_fp8_widen_h100_gpu.json`).
Read the opcodes by pipe, not only their sum. The kernel is specialised as a launch
would specialise it (16-byte-aligned pointers, strides that are multiples of 16 marked so, a stride of 1 a
constant), on the Qwen3-4B layer's shape (32 query heads over 8 KV heads of 128, pages of 16 slots).

    pip install triton==3.6.0     # the device's Triton; any recent one works
    python -m benchmarks.decode_kernels_sass [--out benchmarks/results/decode_kernels_sass_cpu.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from relax.backends.inference.engine_core.triton_attention import _paged_decode_kernel

RESULTS = Path(__file__).resolve().parent / "results"
STRIDES_DIVISIBLE_BY_16 = ["stride_qb", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_ob",
                           "stride_oh", "stride_tb"]
# (name, FP8 pool, widened by bits, BLOCK_N, warps, stages, registers cap): the tiles decode_kernels_gpu found best
# for each pool; fp8_convert widens the FP8 entries by the conversion instructions, the path before widening by bits;
# fp8_capped96 caps the registers at 96 (ptxas spills at 80): five programs a multiprocessor instead of four, no
# spills, and yet 0.94x the uncapped kernel on an H100 (results/decode_kernels_fp8_register_cap_h100_gpu.json)
VARIANTS = [
    ("bf16", False, False, 128, 4, 3, None),
    ("fp8", True, True, 128, 4, 2, None),
    ("fp8_capped96", True, True, 128, 4, 2, 96),
    ("fp8_convert", True, False, 128, 4, 2, None),
    ("bf16_block64", False, False, 64, 4, 2, None),
    ("fp8_block64", True, True, 64, 4, 2, None),
]


def compile_kernel(quantized: bool, block_n: int, warps: int, stages: int, widen_by_bits: bool = True,
                   max_registers: int | None = None):
    """The kernel as a launch on the 4B layer would build it, for sm_90."""
    names = _paged_decode_kernel.arg_names
    kv = "*fp8e4nv" if quantized else "*bf16"
    signature = {"q_ptr": "*bf16", "k_ptr": kv, "v_ptr": kv, "out_ptr": "*bf16", "tables_ptr": "*i32",
                 "lens_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "scale": "fp32",
                 **{name: "i32" for name in STRIDES_DIVISIBLE_BY_16}, "stride_ss": "i32"}
    # the scales' strides: [slots, Hkv] float32 (8 and 1) with an FP8 pool; unread context lengths (1 and 0) without
    constants = {"stride_sh": 1 if quantized else 0, "GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "PAGE": 16,
                 "BLOCK_N": block_n, "QUANTIZED": quantized, "HEADS_FIRST": True,
                 "WIDEN_BY_BITS": widen_by_bits}
    if not quantized:
        constants["stride_ss"] = 1
    signature = {name: "constexpr" if name in constants else signature[name] for name in names}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in names[:8] + STRIDES_DIVISIBLE_BY_16}
    source = ASTSource(_paged_decode_kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages, "maxnreg": max_registers})


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def loop_cost(cubin: bytes) -> dict:
    """Registers, and the instructions of the longest backward branch's body (the loop over the context)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        sass = subprocess.run([_tool("cuobjdump"), "-sass", handle.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", handle.name], capture_output=True, text=True,
                               check=True).stdout
    instructions = [(int(m.group(1), 16), m.group(2).strip())
                    for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass, re.M)]
    index = {address: i for i, (address, _) in enumerate(instructions)}
    loops = []
    for i, (address, text) in enumerate(instructions):
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in index:
            loops.append((index[int(target.group(1), 16)], i))
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    body = [text for _, text in instructions[start:end + 1]]
    opcodes = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for text in body)
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)), "loop_instructions": len(body),
            "loop_opcodes": dict(opcodes.most_common())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_kernels_sass_cpu.json")
    args = parser.parse_args()
    report: dict = {"benchmark": "decode_kernels_sass", "triton": triton.__version__, "target": "sm_90",
                    "shape": "Qwen3-4B layer: 32 query heads over 8 KV heads of 128, pages of 16", "variants": {}}
    for name, quantized, widen_by_bits, block_n, warps, stages, max_registers in VARIANTS:
        kernel = compile_kernel(quantized, block_n, warps, stages, widen_by_bits, max_registers)
        cost = {"block_n": block_n, "num_warps": warps, "num_stages": stages, "max_registers": max_registers,
                "shared_bytes": kernel.metadata.shared,
                **loop_cost(kernel.asm["cubin"])}
        cost["loop_instructions_per_128_tokens"] = round(cost["loop_instructions"] * 128 / block_n)
        report["variants"][name] = cost
        top = ", ".join(f"{op} {count}" for op, count in list(cost["loop_opcodes"].items())[:8])
        print(f"{name:42s} regs {cost['registers']:3d}  shared {cost['shared_bytes']:6d} B  loop "
              f"{cost['loop_instructions']:5d} instructions ({cost['loop_instructions_per_128_tokens']} per 128 "
              f"tokens): {top}", flush=True)
    base = report["variants"]["bf16"]["loop_instructions_per_128_tokens"]
    for name, cost in report["variants"].items():  # the headline: each against the bf16 kernel
        report[f"{name}_loop_instructions_vs_bf16"] = round(cost["loop_instructions_per_128_tokens"] / base, 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**{k: v for k, v in report.items() if k != "variants"},
                                    "variants": report["variants"]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
