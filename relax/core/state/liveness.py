"""Whether a process of this machine that went silent (no heartbeat, no health state) is stopped or hung, or only
starved of CPU.

A heartbeat thread beats every second, but on a machine loaded far beyond its cores (a busy node, a CI machine
running other jobs) a process may not get the CPU, or its interpreter lock, for longer than ``--heartbeat-timeout-s``
while it still works; restarting it then only costs the work done since the last checkpoint, again and again. So a
stale beat is a verdict only when the process is observed not to work: it is stopped (SIGSTOP, a debugger), or none
of its threads is runnable and its CPU time has not grown since the last look (a deadlock, a wait that never ends).
A process that is starved (a thread waiting for a CPU, or CPU time still growing) is given longer, up to
`STARVED_LIMIT_FACTOR` heartbeat timeouts, after which it is judged as hung all the same (a native loop that holds
the interpreter lock forever also computes).

Only local processes can be observed (``/proc``); a process of another machine is judged by its beats alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

STARVED_LIMIT_FACTOR = 10.0
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcessActivity:
    """What ``/proc`` says of a process now."""

    stopped: bool  # every thread stopped (SIGSTOP) or traced
    runnable: bool  # some thread runs or waits for a CPU
    cpu_s: float  # user + system CPU time so far


def process_activity(pid: int) -> ProcessActivity | None:
    """The activity of local process ``pid``, or None where it cannot be read (gone, not Linux)."""
    states = []
    try:
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(_fields(stat.read_text())[0])
            except (OSError, IndexError):  # a thread that ended meanwhile
                continue
        fields = _fields(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, IndexError, ValueError):
        return None
    states = states or [fields[0]]
    return ProcessActivity(stopped=all(state in "Tt" for state in states), runnable="R" in states,
                           cpu_s=(int(fields[11]) + int(fields[12])) / _TICKS_PER_S)


def _fields(stat: str) -> list[str]:
    """The fields of a ``/proc/.../stat`` line after the command name (which may hold spaces and parentheses)."""
    return stat[stat.rindex(")") + 2:].split()


class SilenceJudge:
    """Judges silent local processes (module docstring), remembering each one's CPU time between looks."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._cpu_s: dict[int, float] = {}

    def look(self, pid: int) -> None:
        """Note ``pid``'s CPU time now: the next judgement compares with it."""
        activity = process_activity(pid)
        if activity is not None:
            self._cpu_s[pid] = activity.cpu_s

    def starved(self, pid: int, silent_s: float) -> bool:
        """Whether ``pid``, silent for ``silent_s`` (more than the timeout), is alive and working, so to be waited
        for: not stopped, a thread runnable or its CPU time grown since the last look, and silent for less than
        `STARVED_LIMIT_FACTOR` timeouts."""
        activity = process_activity(pid)
        if activity is None or activity.stopped or silent_s > STARVED_LIMIT_FACTOR * self.timeout_s:
            return False
        before, self._cpu_s[pid] = self._cpu_s.get(pid), activity.cpu_s
        return activity.runnable or (before is not None and activity.cpu_s > before)
