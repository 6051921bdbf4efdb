"""The phases of each training step, for the timeline (``--timeline-dump-dir``) and stall reports
(``--stall-warning-s``).

The controller runs every phase of a step (rollout, training, weight sync, evaluation, checkpoint, moving memory)
inside `PhaseClock.phase`. Each finished phase becomes a Chrome trace event in ``<dir>/timeline.json`` (open it in
Perfetto or chrome://tracing): the file is a JSON array written one event per line as phases end, without its
closing bracket, which the trace viewers accept, so a run that dies keeps every phase up to its death. A watchdog
thread reports a phase that has run longer than ``--stall-warning-s`` (which step, which phase, what it waits for,
since when) to the log and to ``--notify-urls``, again at every further multiple of the threshold, long before
``--data-wait-timeout`` ends a wait.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("relax")

TIMELINE_FILE = "timeline.json"


@dataclass
class _Running:
    name: str
    step: int
    detail: str
    started: float  # time.monotonic()
    wall_started: float  # time.time()
    reported: int = 0  # how many stall reports were made for it


class PhaseClock:
    def __init__(self, timeline_dir: str | Path | None = None, stall_warning_s: float | None = None,
                 notifier=None) -> None:
        self.timeline_path = Path(timeline_dir) / TIMELINE_FILE if timeline_dir else None
        self.stall_warning_s = stall_warning_s
        self.notifier = notifier
        self._lock = threading.Lock()
        self._running: list[_Running] = []
        self._origin = time.time()
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        if self.timeline_path is not None:
            self.timeline_path.parent.mkdir(parents=True, exist_ok=True)
            if not self.timeline_path.is_file() or self.timeline_path.stat().st_size == 0:
                self.timeline_path.write_text("[\n")

    @contextmanager
    def phase(self, name: str, step: int, detail: str = ""):
        running = _Running(name, step, detail, time.monotonic(), time.time())
        with self._lock:
            self._running.append(running)
        try:
            yield
        finally:
            with self._lock:
                self._running.remove(running)
            self._record(running, time.monotonic() - running.started)

    def _record(self, running: _Running, seconds: float) -> None:
        if self.timeline_path is None:
            return
        event = {"name": running.name, "cat": "step", "ph": "X", "pid": os.getpid(), "tid": running.name,
                 "ts": round((running.wall_started - self._origin) * 1e6), "dur": round(seconds * 1e6),
                 "args": {"step": running.step, **({"detail": running.detail} if running.detail else {})}}
        with self._lock, self.timeline_path.open("a") as handle:
            handle.write(json.dumps(event) + ",\n")

    def current(self) -> dict:
        """The outermost phase running now: ``{"step", "phase", "since"}`` (wall time), or ``{}`` between phases."""
        with self._lock:
            running = self._running[0] if self._running else None
        if running is None:
            return {}
        return {"step": running.step, "phase": running.name, "since": running.wall_started}

    # ---- stall reports -------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.stall_warning_s is None or self._watchdog is not None:
            return
        self._watchdog = threading.Thread(target=self._watch, name="relax-stall-watchdog", daemon=True)
        self._watchdog.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(5)
            self._watchdog = None

    def _watch(self) -> None:
        period = min(1.0, self.stall_warning_s / 4)
        while not self._stop.wait(period):
            self.report_stalls()

    def report_stalls(self) -> list[str]:
        """Report each phase past the next multiple of the threshold; the messages."""
        now = time.monotonic()
        messages = []
        with self._lock:
            running = list(self._running)
        for phase in running:
            age = now - phase.started
            if age < self.stall_warning_s * (phase.reported + 1):
                continue
            phase.reported = int(age // self.stall_warning_s)
            since = time.strftime("%H:%M:%S", time.localtime(phase.wall_started))
            waiting = f", waiting for {phase.detail}" if phase.detail else ""
            message = f"step {phase.step} has been in {phase.name} for {age:.0f} s (since {since}{waiting})"
            logger.warning("stalled: %s", message)
            if self.notifier is not None:
                self.notifier.send("stalled", message, failure=True)
            messages.append(message)
        return messages
