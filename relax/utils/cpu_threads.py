"""How many threads torch computes with on CPU, chosen by measurement (``--cpu-threads 0``, the default).

torch starts with one thread per core. For the small matrices of a tiny model the threads cost more than they give
(the quickstart ran 1.56x faster on one thread than on two, on an idle 2-core machine), and on a busy machine every
extra thread competes with the other work (126-152 s a step at load 8-16 on two threads, against 2 s on one). So
the count is measured: the model's own matrix product (tokens x hidden times hidden x 4 hidden) is timed at 1, 2, 4,
... threads, up to the cores the machine's one-minute load leaves free, and the fastest is taken; more threads must
be clearly faster (`MIN_GAIN`) to be chosen. ``$OMP_NUM_THREADS`` or a non-zero ``--cpu-threads`` wins over it.
Used by ``relax train`` (`relax.core.build`), ``relax eval`` and ``relax serve`` on CPU.
"""

from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger("relax")

MIN_GAIN = 1.15  # more threads are taken only when at least this much faster
PROBE_S = 0.03  # time spent measuring each thread count
PROBE_TOKENS = 256


def free_cores() -> int:
    """The cores this process may use, less what the machine's one-minute load average keeps busy (at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return max(1, min(cores, round(cores - load)))


def _seconds_per_product(threads: int, hidden: int) -> float:
    torch.set_num_threads(threads)
    left, right = torch.randn(PROBE_TOKENS, hidden), torch.randn(hidden, 4 * hidden)
    torch.mm(left, right)  # warm-up
    runs, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < PROBE_S:
        torch.mm(left, right)
        runs += 1
    return elapsed / runs


def choose_cpu_threads(hidden_size: int, configured: int = 0) -> tuple[int, str]:
    """The thread count for CPU work on a model of ``hidden_size``, and how it was chosen."""
    if configured:
        return configured, "--cpu-threads"
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"]), "$OMP_NUM_THREADS"
    limit = free_cores()
    candidates = [1]
    while candidates[-1] * 2 <= limit:
        candidates.append(candidates[-1] * 2)
    if limit not in candidates:
        candidates.append(limit)
    best, best_time = 1, _seconds_per_product(1, hidden_size)
    for threads in candidates[1:]:
        seconds = _seconds_per_product(threads, hidden_size)
        if seconds * MIN_GAIN < best_time:
            best, best_time = threads, seconds
    return best, f"measured (fastest of {candidates} threads; {limit} cores free)"


def set_cpu_threads(hidden_size: int, configured: int = 0) -> int:
    """Choose (`choose_cpu_threads`) and apply the thread count; returns it."""
    threads, how = choose_cpu_threads(hidden_size, configured)
    torch.set_num_threads(threads)
    logger.info("torch computes with %d CPU thread%s (%s)", threads, "" if threads == 1 else "s", how)
    return threads
