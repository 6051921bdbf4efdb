"""The trainer's compute on a worker thread, so that the event loop stays free for the rollout producer.

In the asynchronous loops with in-process placement, the rollout producer and the trainer share one
event loop. The in-process roles' coroutines (`Actor.train`, `ActorFwd.compute_log_probs`, ...) do
their compute synchronously, so a training step blocks the loop for its whole length: the producer
can neither start the next generation when the staleness gate opens nor take in a finished one. On
2 GPUs (rollout served by `relax serve` on one, training on the other) that serialized the two and
made fully-async slower than colocated (``benchmarks/modes_gpu.py``: 0.78x).

`ComputeThread` runs those coroutines on one dedicated thread (always the same one, so CUDA's
per-thread current device and the order of collective calls stay as they were), each in a
short-lived event loop of that thread; `OffLoopRole` wraps a role so that its coroutine methods go
there while everything else (attributes, plain methods such as `Actor.weight_buckets` and `save`)
stays on the caller's thread. The trainer still awaits each call, so role calls never overlap each other.

It is used when the rollout runs in other processes (``--rollout-external``, ``--rollout-serve-replicas``), and
with ``--colocate-async``, where the embedded engine decodes on the loop thread and the trainer trains beside it on
the same GPU. On CUDA the thread then computes on a stream of its own, so the trainer's kernels and the engine's
(on the loop thread's stream) run side by side, and each call waits for its stream's work before it returns: what
the trainer wrote (the updated weights the loop thread sends to the engine, the metrics) is complete when the loop
thread sees the result. Without ``--colocate-async`` an embedded engine keeps the trainer on the loop thread: on
CPU two threads of torch compute in one process compete for the cores (measured 1.7x slower per step, see
`relax.backends.inference.embedded`).

While the thread exists, the interpreter's GIL switch interval is 1 ms instead of Python's 5 ms. Two threads that
share the GIL, one launching the trainer's kernels and one driving the engine's decode steps (or the rollout's
HTTP), form a convoy: each time the decode thread lets go of the GIL (to wait for the GPU, a socket), taking it
back waits for the trainer's thread to be forced off, up to a whole interval (5 ms beside a decode step of 2).
Measured on CPU with a tiny model, `--colocate-async` (benchmarks/modes_learning_gpu.py --tiny): 0.099 s a step at
5 ms, 0.063 at 1 ms, 0.060 at 0.2 ms. The previous interval comes back on `close`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


SWITCH_INTERVAL_S = 0.001  # while a ComputeThread runs (module doc)


class ComputeThread:
    """One worker thread that runs coroutines to completion, one at a time; on CUDA with ``own_stream``, on a
    stream of its own (module doc)."""

    def __init__(self, device: torch.device, own_stream: bool = False):
        self._previous_switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._previous_switch_interval, SWITCH_INTERVAL_S))
        self._stream = torch.cuda.Stream(device) if own_stream and device.type == "cuda" else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relax-trainer-compute",
                                            initializer=_bind_device, initargs=(device, self._stream))

    async def run(self, coroutine_function, *args, **kwargs) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(
            self._run_to_completion, coroutine_function(*args, **kwargs)))

    def _run_to_completion(self, coroutine) -> Any:
        try:
            return asyncio.run(coroutine)
        finally:
            if self._stream is not None:  # the caller's stream may read what this call wrote
                self._stream.synchronize()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        sys.setswitchinterval(self._previous_switch_interval)


def _bind_device(device: torch.device, stream: torch.cuda.Stream | None) -> None:
    # The current CUDA device and stream are per thread; a new thread starts on device 0's default stream.
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if stream is not None:
        torch.cuda.set_stream(stream)


class OffLoopRole:
    """A role whose coroutine methods run on a `ComputeThread`; any other attribute is the role's own."""

    def __init__(self, role: Any, thread: ComputeThread):
        self._role = role
        self._thread = thread

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._role, name)
        if not inspect.iscoroutinefunction(attribute):
            return attribute

        @functools.wraps(attribute)
        async def off_loop(*args, **kwargs):
            return await self._thread.run(attribute, *args, **kwargs)

        return off_loop
