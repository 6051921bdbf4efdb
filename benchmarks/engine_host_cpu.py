"""The engine core's host work per decode step, with the device's work taken out.

On the GPU a decode step of the paged runner is one CUDA-graph replay, and the host's share (scheduling,
staging the step's inputs, reading the previous step's tokens) must stay below the graph's device time, or the
GPU waits for Python. This runs the real `EngineCore`, `Scheduler` and `PagedRunner` host code on the CPU with a
graph whose replay does nothing, a decoder that is never called and a prefill that only samples, so what it times
is that host share alone: ``--batch`` sequences of ``--prompt-len`` tokens decoding ``--new-tokens`` tokens each.

    python -m benchmarks.engine_host_cpu                     # batch 256, 256 + 512 tokens
    python -m benchmarks.engine_host_cpu --profile           # and the functions that take the time
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import time
from pathlib import Path

import torch

from relax.backends.inference.base import GenerationRequest, PauseHolds, SamplingParams
from relax.backends.inference.engine_core.block_manager import BlockManager
from relax.backends.inference.engine_core.core import EngineCore
from relax.backends.inference.engine_core.kv_cache import KVPool
from relax.backends.inference.engine_core.paged_runner import GRAPH_BATCH_SIZES, PagedRunner
from relax.backends.inference.engine_core.scheduler import Scheduler
from relax.backends.inference.engine_core.table_rows import BlockTableRows

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 151936


class _NoGraph:
    def replay(self) -> None:
        pass


class HostOnlyRunner(PagedRunner):
    """`PagedRunner` with its device work removed: decode goes through the graph path's input staging with a
    replay that does nothing; prefill samples without a forward. Buffers live on the CPU."""

    def __init__(self, batch: int, num_blocks: int, block_size: int, max_blocks_per_sequence: int) -> None:
        from relax.backends.inference.engine_core.step_runner import StepRunner

        StepRunner.__init__(self, torch.device("cpu"), batch)
        self.block_size, self.max_blocks_per_sequence = block_size, max_blocks_per_sequence
        self._kv_dtype = torch.float32
        self.graph_sizes = [size for size in GRAPH_BATCH_SIZES if size <= batch] or [1]
        self.graphs = {size: _NoGraph() for size in self.graph_sizes}
        self.prefill_tokens = 0
        self.pool, self.caches = KVPool(1, 1, 1, 1, torch.float32, "auto", self.device), []  # never read
        self._staging = [torch.zeros((batch, 6 + max_blocks_per_sequence), dtype=torch.int64) for _ in range(2)]
        self._staging_arrays = [buffer.numpy() for buffer in self._staging]
        self._table_rows = BlockTableRows(2 * batch, max_blocks_per_sequence)
        largest, width = self.graph_sizes[-1], max_blocks_per_sequence
        self._buffers = self._graph_buffers(largest, width, vocab=1)

    def prefill(self, sequences, version):
        self.prefill_tokens += sum(s.num_tokens - s.num_cached for s in sequences)
        tokens = torch.randint(2, VOCAB, (len(sequences),))
        return self._finish(sequences, tokens, torch.zeros(len(sequences)), version)

    def copy_blocks(self, copies) -> None:
        pass


def run(batch: int, prompt_len: int, new_tokens: int, profile: str | None = None) -> dict:
    block_size = 16
    blocks_per_sequence = -(-(prompt_len + new_tokens + 1) // block_size)
    num_blocks = batch * blocks_per_sequence + 1
    runner = HostOnlyRunner(batch, num_blocks, block_size, blocks_per_sequence)
    scheduler = Scheduler(BlockManager(num_blocks, block_size), max_running=batch, max_prefill_tokens=8192,
                          reserve_tokens=block_size)
    core = EngineCore(runner, scheduler.blocks, scheduler, tokenizer=None, eos_token_ids=frozenset({1}),
                      pauses=PauseHolds(), weight_version=lambda: 0)
    core._output = lambda sequence: len(sequence.output_ids)  # no tokenizer: the text is not the step's work
    generator = torch.Generator().manual_seed(0)
    requests = [GenerationRequest(f"r{i}", torch.randint(2, VOCAB, (prompt_len,), generator=generator).tolist(),
                                  SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=i))
                for i in range(batch)]
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    produced = sum(asyncio.run(core.generate(requests)))
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    seconds = time.perf_counter() - started
    steps = max(core.decode_steps, 1)
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "seconds": round(seconds, 3),
            "new_tokens_produced": produced, "decode_steps": core.decode_steps,
            "host_ms_per_decode_step": round(1000 * seconds / steps, 3),
            "phases_ms_per_decode_step": {phase: round(1000 * s / steps, 3) for phase, s in core.host_seconds.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run(args.batch, args.prompt_len, 16)  # warm-up
    result = run(args.batch, args.prompt_len, args.new_tokens, "profile" if args.profile else None)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
