"""Stop a training at a step boundary on SIGTERM or SIGINT, with a checkpoint to resume from.

Schedulers preempt with SIGTERM and a grace period (SLURM, Kubernetes), and a user stops a run with
Ctrl-C. The first signal asks the training loop to stop after the step in progress: it finishes the
step, saves a checkpoint (weights, optimizer, data cursor) unless that step was just saved, and
returns, so ``--load <output-dir>`` continues at the next step without losing or repeating a
sample. A second signal stops at once with the signal's default action.

Under torchrun every rank gets the signal, not necessarily between the same two steps; the ranks
agree (an all-reduce of the flag after each step) so that all of them take the same last step and
join the same checkpoint save.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist

logger = logging.getLogger("relax")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """The stop request of one training run; `installed` routes SIGTERM/SIGINT to it."""

    def __init__(self) -> None:
        self.signal_number: int | None = None
        self.stopped_after_step: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal_number is not None

    def request(self, signal_number: int) -> None:
        if self.signal_number is None:
            self.signal_number = signal_number
            logger.warning("%s: stopping after the current step with a checkpoint (send it again to stop now)",
                           signal.Signals(signal_number).name)

    @contextlib.contextmanager
    def installed(self) -> Iterator[GracefulStop]:
        """Route SIGTERM and SIGINT here while the block runs (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {number: signal.getsignal(number) for number in STOP_SIGNALS}

        def handle(number, frame):
            if self.requested:  # the second signal: the default action, now
                signal.signal(number, signal.SIG_DFL)
                signal.raise_signal(number)
                return
            self.request(number)

        for number in STOP_SIGNALS:
            signal.signal(number, handle)
        try:
            yield self
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def agreed(self) -> bool:
        """Whether to stop now: this process's request, or any rank's under torch.distributed."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.requested
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([1 if self.requested else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not self.requested:
            self.signal_number = int(signal.SIGTERM)  # another rank's signal: stop with it
        return bool(flag.item())

    @property
    def exit_code(self) -> int:
        """The shell's code for death by the signal (143 for SIGTERM, 130 for SIGINT); 0 without one."""
        return 128 + self.signal_number if self.signal_number is not None else 0
