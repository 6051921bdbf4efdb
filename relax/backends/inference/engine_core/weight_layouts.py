"""Which layout each of a decoder layer's products keeps its weight in, chosen by timing both on the card.

A decode step's products are ``x [rows, in] @ W^T`` at a few hundred rows. cuBLAS picks its kernel by the shapes
and by the layout of ``W``: stored as the model stores it (``[out, in]`` row-major, what `F.linear` reads) or
column-major (the same shape with each input's column contiguous, a plain ``x @ W``). The two can differ by a fifth
and the faster one depends on the shape and the card: on an H100 at 256 rows the Qwen3-4B down projection runs
1.21x faster column-major (cuBLAS takes a split-K kernel and a reduction for the stored layout), its q/k/v product
1.05x slower, and the other products move by 0-7% (`benchmarks.decode_gemm_layouts_gpu`). So the engine times each
kind of product (q/k/v, o, gate/up, down) both ways at its largest decode-graph batch, over enough layers' weights
to pass the L2 cache as a decode step does, and lays every layer's weights of that kind out the faster way when it
wins by more than `MARGIN` (`MergedLinears.lay_out`). The layout costs no memory: the parameters stay views of it,
and weight updates copy into them in place.

The choice is made once, on CUDA, before the decode graphs are captured (`PagedRunner`); on CPU, and for products
that are not plain bf16/fp16 linears (FP8 rollout's own, LoRA-wrapped ones), the weights stay as stored.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.nn import functional

from relax.backends.inference.engine_core.merged_projections import LayerGroups, MergedLinears

logger = logging.getLogger(__name__)

MARGIN = 0.05  # a layout must be this much faster to be taken over the model's own (graph timings vary by 2-3%)
TRIALS = 5  # each layout timed this many times, alternating; the medians are compared
REPLAYS = 10  # graph replays a timing
# On an H100 the 4B shape took its down projection column-major (34.9 -> 33.0 us a layer) and decoded 1.015x faster
# (docs/engines.md). `benchmarks.engine_gpu`'s ``core_weights_as_stored`` turns it off for its baseline.
MEASURE = True


class LayoutTiming(NamedTuple):
    """Microseconds one layer's product took at ``rows`` rows, as stored and column-major, and the layout taken."""

    rows: int
    as_stored_us: float
    column_major_us: float
    column_major: bool


def replay_us(product: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor],
              x: torch.Tensor) -> Callable[[], float]:
    """A timer of ``product(x, w)`` over every weight in turn, as one CUDA graph: microseconds a weight."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # cuBLAS sets up its workspace outside the capture
        for weight in weights:
            product(x, weight)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for weight in weights:
            product(x, weight)

    def time() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        return 1000 * start.elapsed_time(end) / (REPLAYS * len(weights))

    return time


def time_layouts(groups: list[MergedLinears], rows: int) -> LayoutTiming:
    """Both layouts of ``groups``' weights (one per layer, same shape) at ``rows`` rows. The column-major copies are
    made for the timing and dropped after it: as many layers as pass twice the L2 cache, so that each product reads
    its weight from memory as in a decode step."""
    stored = [group.weight for group in groups]
    per_weight = stored[0].numel() * stored[0].element_size()
    l2_bytes = torch.cuda.get_device_properties(stored[0].device).L2_cache_size
    count = min(len(stored), max(2, -(-2 * l2_bytes // per_weight)))
    stored = stored[:count]
    column_major = [weight.t().contiguous().t() for weight in stored]
    x = torch.randn(rows, stored[0].shape[1], device=stored[0].device, dtype=stored[0].dtype)
    timers = [replay_us(functional.linear, weights, x) for weights in (stored, column_major)]
    for timer in timers:  # warm: clocks up, code loaded
        timer()
    trials: list[list[float]] = [[], []]
    for _ in range(TRIALS):
        for times, timer in zip(trials, timers):
            times.append(timer())
    as_stored, transposed = (statistics.median(times) for times in trials)
    return LayoutTiming(rows, round(as_stored, 2), round(transposed, 2), transposed * (1 + MARGIN) < as_stored)


def choose(layers: list[LayerGroups], rows: int) -> dict[str, LayoutTiming]:
    """Time each kind of product (``qkv``, ``o``, ``gate_up``, ``down``) both ways at ``rows`` rows and lay every
    layer's weights of that kind out the faster way. Kinds whose groups are not plain linears of the model's half
    dtype keep the stored layout and are left out of the result."""
    timings: dict[str, LayoutTiming] = {}
    if not MEASURE or not layers:
        return timings
    for kind in LayerGroups._fields:
        groups = [getattr(layer, kind) for layer in layers]
        if not all(group is not None and group.merged and group.weight.is_cuda
                   and group.weight.dtype in (torch.bfloat16, torch.float16) for group in groups):
            continue
        with torch.inference_mode(False), torch.no_grad():
            timing = time_layouts(groups, rows)
        for group in groups:
            group.lay_out(timing.column_major)
        timings[kind] = timing
    logger.info("decode products' weight layouts at %d rows: %s", rows, {
        kind: f"{'column-major' if t.column_major else 'as stored'} ({t.as_stored_us} us as stored, "
              f"{t.column_major_us} column-major)" for kind, t in timings.items()})
    return timings
