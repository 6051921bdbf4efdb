"""Health of the run's processes (``--use-health-check``): heartbeats, their state on disk, and a verdict that ends
the run when a role is dead or hung, so that ``--max-global-restart`` restarts it from its last checkpoint.

Who beats and who watches:

- every role in a Ray process (actor, rollout, reference, critic) runs a `Heartbeat` thread that writes
  ``<output-dir>/health/<role>.json`` (its pid and the time) every second. A thread, not a Ray call: a role busy in
  a long training step still beats, and a stopped (SIGSTOP) or dead process does not;
- the `HealthMonitor` thread of the controller's process reads those beats, asks Ray whether TransferQueue's
  controller and storage actors answer (their death or stop would otherwise hang the data plane, see
  `relax.data_plane.tq_plane`), and writes what it knows to ``<output-dir>/health.json``: per role
  ``healthy``, ``pid``, ``last_heartbeat``, ``error``, and the controller's own step and phase. `relax health`
  prints it; the metrics endpoint exports it (``relax_role_healthy``, ``relax_role_heartbeat_age_s``).

A role that sent no beat for ``--heartbeat-timeout-s`` (upstream's HealthManager: 120 s), whose process is gone, or
an actor Ray reports dead, is fatal (a role of this machine that is silent but observed computing, starved of CPU on
a loaded machine, is waited for longer: `relax.core.state.liveness`): the monitor logs which role and why, tells
``--notify-urls``, kills the processes it named (the placement's `end_process`: ``ray.kill``, so the teardown's
calls to a stopped process fail at once instead of each waiting out its timeout), and cancels the training loop,
which then fails with that reason (exit 1: the supervisor of ``--max-global-restart`` restarts it).
If the loop does not end within a grace (`FATAL_GRACE_S`, or twice the heartbeat timeout where that is shorter, at
least `MIN_FATAL_GRACE_S`: a call that cannot be cancelled, a teardown waiting on a stopped process), the process
exits.

Once the training loop has ended (`guard` returns or raises), the roles' processes going away is the teardown, not a
fault: the monitor stops judging them and keeps writing the state file until `stop`, so a run that ended well ends
healthy (no verdict, no "unhealthy" notification, `relax health` exits 0).

In-process roles share the controller's process: their health is its health, and a phase that does not end is
the stall watchdog's report (``--stall-warning-s``). External engines have the router's health checks
(``--rollout-health-check-*``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from relax.core.state.liveness import SilenceJudge
from relax.utils.errors import RunFault

logger = logging.getLogger("relax")

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_DIR = "health"
STATE_FILE = "health.json"
FATAL_GRACE_S = 30.0
MIN_FATAL_GRACE_S = 10.0
ACTOR_PING_WAIT_S = 0.5


def _write_atomically(path: Path, payload: dict) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(payload))
    os.replace(temporary, path)


class Heartbeat:
    """A daemon thread writing ``<directory>/<role>.json`` every `HEARTBEAT_INTERVAL_S`, in the role's process."""

    def __init__(self, directory: str | Path, role: str, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.path = Path(directory) / f"{role}.json"
        self.role = role
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"relax-heartbeat-{role}", daemon=True)

    def start(self) -> Heartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        _write_atomically(self.path, {"role": self.role, "pid": os.getpid(), "host": socket.gethostname(),
                                      "time": time.time()})

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except OSError:  # a full disk must not kill the role; the monitor sees the beat go stale
                logger.debug("heartbeat of %s not written", self.role, exc_info=True)

    def stop(self) -> None:
        self._stop.set()


@dataclass
class RoleHealth:
    healthy: bool = True
    pid: int | None = None
    host: str | None = None
    last_heartbeat: float | None = None  # time.time() of the last beat or answer
    error: str | None = None


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class HealthMonitor:
    """Watches the roles' heartbeats and the named Ray actors; writes ``health.json``; ends the run on a fault.

    ``roles``: the roles that beat (files under ``<run_dir>/health``). ``actors``: name -> Ray actor handle, probed
    with a no-op call (TransferQueue's controller and storage units). ``phase_of``: the controller's current
    ``(step, phase, since)``, for the state file.
    """

    def __init__(self, run_dir: str | Path, roles: list[str], heartbeat_timeout_s: float,
                 actors: dict[str, Any] | None = None, phase_of: Callable[[], dict] | None = None,
                 notifier=None, restarts: int = 0, interval_s: float = HEARTBEAT_INTERVAL_S,
                 engine_stats: Callable[[], list[dict]] | None = None,
                 end_process: Callable[[str], None] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.beat_dir = self.run_dir / HEARTBEAT_DIR
        self.roles = list(roles)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.actors = dict(actors or {})
        self.phase_of = phase_of
        self.engine_stats = engine_stats  # the router's engines, when they are behind one in this process
        self.notifier = notifier
        self.end_process = end_process  # the placement's: kills a role's or actor's process by its name here
        self.restarts = restarts
        self.interval_s = interval_s
        self.state: dict[str, RoleHealth] = {name: RoleHealth() for name in [*self.roles, *self.actors]}
        self.fatal: str | None = None
        self.tearing_down = False  # the loop has ended: no more verdicts (`guard`)
        self._started = time.time()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cancel: Callable[[], None] | None = None
        self._silence = SilenceJudge(heartbeat_timeout_s)  # a starved role is not a hung one (`liveness`)
        self._starved: set[str] = set()

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> HealthMonitor:
        self.beat_dir.mkdir(parents=True, exist_ok=True)
        # At once, not after the first interval: the supervisor judges a stopped process by this file's age, and
        # cannot judge one that stops before it first exists.
        self._write_state(time.time())
        self._thread = threading.Thread(target=self._run, name="relax-health-monitor", daemon=True)
        self._thread.start()
        return self

    def detach_actors(self) -> None:
        """Stop probing the Ray actors (their service is shutting down; a probe now would start a new Ray)."""
        with self._lock:
            self.actors = {}

    def stop(self) -> None:
        """End the watch; the state file says so (the supervisor stops judging its age)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self._write_state(time.time(), ended=True)

    async def guard(self, coroutine):
        """Run the training loop; a fatal verdict cancels it and raises `RoleFailedError` with the reason."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(coroutine)
        self._cancel = lambda: loop.call_soon_threadsafe(task.cancel)
        if self.fatal is not None:
            self._cancel()
        try:
            return await task
        except asyncio.CancelledError:
            if self.fatal is not None:
                raise RoleFailedError(self.fatal) from None
            raise
        finally:
            with self._lock:
                self.tearing_down = True  # what stops from now on is the teardown, not a fault
                self._cancel = None

    # ---- checks ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # the monitor must outlive a bad read
                logger.debug("health check failed", exc_info=True)

    def check(self) -> dict[str, RoleHealth]:
        """One round: read the beats, probe the actors, judge, write ``health.json``."""
        now = time.time()
        if self.tearing_down:  # the roles leave with the teardown: judged no more, and the state stays as it was
            self._write_state(now)
            return self.state
        before = {name: replace(health) for name, health in self.state.items()}
        for role in self.roles:
            self._check_beat(role, now)
        self._probe_actors(now)
        with self._lock:
            if self.tearing_down:  # the loop ended during this round: what it saw may be the teardown
                self.state = before
            failed = [] if self.tearing_down else [h.error for h in self.state.values() if not h.healthy]
            fatal_now = bool(failed) and self.fatal is None
            if fatal_now:
                self.fatal = "; ".join(failed)
        self._write_state(now)  # before the run is told: whoever sees it end can read why
        if fatal_now:
            self._end_run()
        return self.state

    def _check_beat(self, role: str, now: float) -> None:
        health = self.state[role]
        try:
            beat = json.loads((self.beat_dir / f"{role}.json").read_text())
            if beat["time"] >= self._started - 1.0:  # a beat of this run, not a previous process's
                health.pid, health.last_heartbeat = int(beat["pid"]), float(beat["time"])
                health.host = beat.get("host")
        except (OSError, ValueError, KeyError):
            pass
        if not health.healthy:
            return
        if health.last_heartbeat is not None and now - health.last_heartbeat <= self.heartbeat_timeout_s:
            self._starved.discard(role)
        if health.pid is not None and health.host == socket.gethostname() and _process_gone(health.pid):
            health.healthy, health.error = False, f"the {role} role's process (pid {health.pid}) is gone"
            return
        since = health.last_heartbeat if health.last_heartbeat is not None else self._started
        local = health.pid is not None and health.host == socket.gethostname()
        if now - since <= self.heartbeat_timeout_s:
            if local:
                self._silence.look(health.pid)
            return
        if local and self._silence.starved(health.pid, now - since):
            if role not in self._starved:  # said once per silence
                self._starved.add(role)
                logger.warning("the %s role (pid %d) sent no heartbeat for %.0f s but is computing: starved of CPU "
                               "(a loaded machine), not hung; waiting", role, health.pid, now - since)
            return
        pid = f" (pid {health.pid})" if health.pid is not None else ""
        health.healthy = False
        health.error = (f"the {role} role{pid} sent no heartbeat for {now - since:.0f} s "
                        f"(--heartbeat-timeout-s {self.heartbeat_timeout_s:g}): stopped or hung")

    def _probe_actors(self, now: float) -> None:
        """Ping every watched actor at once and wait at most `ACTOR_PING_WAIT_S`: a stopped actor must not stop
        the monitor (its own state file going stale would read as a hung run)."""
        import ray

        with self._lock:
            actors = dict(self.actors)
        if not actors or not ray.is_initialized():  # never start a Ray of our own
            return
        pings = {}
        for name, handle in actors.items():
            if self.state[name].healthy:  # the first answer also gives the actor's pid and host
                pings[name] = handle.__ray_call__.remote(lambda actor: (os.getpid(), socket.gethostname()))
        if not pings:
            return
        ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=ACTOR_PING_WAIT_S)
        ready = set(ready)
        for name, ref in pings.items():
            health = self.state[name]
            if ref in ready:
                try:
                    (health.pid, health.host), health.last_heartbeat = ray.get(ref), now
                except ray.exceptions.RayActorError as err:
                    health.healthy = False
                    health.error = f"{name} (pid {health.pid}) died: {str(err).splitlines()[0]}"
                    continue
                self._starved.discard(name)
                if health.host == socket.gethostname():
                    self._silence.look(health.pid)
                continue
            since = health.last_heartbeat if health.last_heartbeat is not None else self._started
            if now - since <= self.heartbeat_timeout_s:
                continue
            if (health.pid is not None and health.host == socket.gethostname()
                    and self._silence.starved(health.pid, now - since)):
                if name not in self._starved:
                    self._starved.add(name)
                    logger.warning("%s (pid %d) has not answered Ray for %.0f s but is computing: starved of CPU, "
                                   "not hung; waiting", name, health.pid, now - since)
                continue
            health.healthy = False
            health.error = (f"{name} (pid {health.pid}) has not answered Ray for {now - since:.0f} s "
                            f"(--heartbeat-timeout-s {self.heartbeat_timeout_s:g}): stopped or hung")

    def _end_run(self) -> None:
        reason = self.fatal
        logger.error("health check: %s; ending the run%s", reason,
                     " (--max-global-restart restarts it)" if os.environ.get("RELAX_SUPERVISED") else "")
        if self.notifier is not None:
            self.notifier.send("unhealthy", reason, failure=True)
        self._end_failed_processes()
        if self._cancel is not None:
            self._cancel()
        threading.Thread(target=self._exit_if_stuck, name="relax-health-exit", daemon=True).start()

    def _end_failed_processes(self) -> None:
        """Kill the processes the verdict names before the loop is cancelled: a stopped or hung one would
        otherwise hold the teardown (its calls time out one after the other, then the grace ends the run), and
        the run restarts without it either way. A dead one's kill is a no-op."""
        if self.end_process is None:
            return
        for name, health in self.snapshot().items():
            if health["healthy"]:
                continue
            try:
                self.end_process(name)
                logger.warning("health check: %s's process killed (if it was not gone already), so that the "
                               "teardown does not wait on it", name)
            except Exception as err:  # noqa: BLE001 - the grace still ends a teardown that waits on it
                logger.warning("health check: could not end %s's process: %s", name, err)

    def _exit_if_stuck(self) -> None:
        """The loop was cancelled; neither a call that ignores cancellation nor a teardown waiting on the failed
        process may keep the run alive: unless `stop` comes (the run's end, after its teardown) within
        the grace of the verdict, the process exits."""
        # A run that detects a stopped process within seconds should not then wait half a minute on it.
        grace = min(FATAL_GRACE_S, max(MIN_FATAL_GRACE_S, 2 * self.heartbeat_timeout_s))
        if self._stop.wait(grace):
            return
        logger.error("health check: the run did not end within %.0f s of the fault; exiting", grace)
        logging.shutdown()
        os._exit(1)

    # ---- state -------------------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, dict]:
        with self._lock:
            return {name: asdict(health) for name, health in self.state.items()}

    def _write_state(self, now: float, ended: bool = False) -> None:
        payload = {"time": now, "pid": os.getpid(), "global_restarts": self.restarts, "fatal": self.fatal,
                   "ended": ended, "controller": self.phase_of() if self.phase_of else {}, "roles": self.snapshot()}
        if self.engine_stats is not None:
            try:
                payload["engines"] = [{key: engine.get(key) for key in ENGINE_FIELDS} for engine in self.engine_stats()]
            except Exception as err:  # noqa: BLE001 - the roles' state is written whatever the router says
                logger.debug("engine stats unavailable: %s", err)
        _write_atomically(self.run_dir / STATE_FILE, payload)


ENGINE_FIELDS = ("engine", "healthy", "draining", "relaunching", "relaunches", "outstanding", "weight_version",
                 "pid", "last_error")


class RoleFailedError(RunFault):
    """A role died or hung (the health check's verdict); the message names it."""


class HealthStateError(ValueError):
    """A ``health.json`` that is not a run's health state (damaged, or another program's); the message names it."""


def read_state(run_dir: str | Path) -> dict | None:
    """``health.json`` of a run, or None where the run has none (health checks off, or not started); a file that is
    there but is not a health state raises `HealthStateError` naming what is wrong with it."""
    path = Path(run_dir) / STATE_FILE
    try:
        text = path.read_bytes().decode("utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise HealthStateError(f"{path}: cannot be read ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise HealthStateError(f"{path}: not UTF-8 text, so not a health state relax wrote") from None
    try:
        state = json.loads(text)
    except ValueError as err:
        raise HealthStateError(f"{path}: not valid JSON ({err}), so not a health state relax wrote") from None
    problem = _state_problem(state)
    if problem:
        raise HealthStateError(f"{path}: not a health state relax wrote: {problem}")
    return state


def _state_problem(state: Any) -> str | None:
    """What keeps ``state`` from being `_write_state`'s payload (the fields `format_state` and the supervisor
    read), or None."""
    number = (int, float)
    if not isinstance(state, dict):
        return f"a JSON object was expected, got {'null' if state is None else type(state).__name__}"
    if not isinstance(state.get("time"), number) or isinstance(state.get("time"), bool):
        return "its 'time' is not a number"
    if not isinstance(state.get("roles", {}), dict) or not all(
            isinstance(role, dict) and isinstance(role.get("last_heartbeat"), (*number, type(None)))
            for role in state.get("roles", {}).values()):
        return "its 'roles' is not an object of role objects (each with a numeric or null 'last_heartbeat')"
    controller = state.get("controller") or {}
    if not isinstance(controller, dict) or not isinstance(controller.get("since"), (*number, type(None))):
        return "its 'controller' is not an object (with a numeric or null 'since')"
    engines = state.get("engines") or []
    if not isinstance(engines, list) or not all(isinstance(engine, dict) and "engine" in engine for engine in engines):
        return "its 'engines' is not a list of engine objects"
    return None


def format_state(state: dict, now: float | None = None) -> str:
    """A table of ``health.json`` for `relax health`."""
    now = time.time() if now is None else now
    controller = state.get("controller") or {}
    lines = [(f"run process pid {state.get('pid')}, state written {now - state['time']:.0f} s ago, "
              f"global restarts {state.get('global_restarts', 0)}")]
    if controller:
        lines.append(f"controller: step {controller.get('step')}, {controller.get('phase') or 'between phases'}"
                     + (f" for {now - controller['since']:.0f} s" if controller.get("since") else ""))
    if state.get("fatal"):
        lines.append(f"fatal: {state['fatal']}")
    if state.get("ended"):
        lines.append("the run's process has ended its watch (the run finished or stopped)")
    roles = state.get("roles", {})
    width = max([len("role"), *map(len, roles)]) + 2
    lines.append(f"{'role':<{width}}{'healthy':<9}{'pid':<9}{'last heartbeat':<16}error")
    for name, health in roles.items():
        beat = health.get("last_heartbeat")
        age = f"{now - beat:.1f} s ago" if beat else "never"
        lines.append(f"{name:<{width}}{'yes' if health.get('healthy') else 'NO':<9}{health.get('pid') or '-'!s:<9}"
                     f"{age:<16}{health.get('error') or ''}")
    engines = state.get("engines") or []
    if engines:
        width = max(len("engine"), *(len(str(e["engine"])) for e in engines)) + 2
        lines.append(f"{'engine':<{width}}{'healthy':<13}{'pid':<9}{'version':<9}{'relaunches':<12}{'in flight':<11}"
                     "error")
        for engine in engines:
            status = ("relaunching" if engine.get("relaunching") else "draining" if engine.get("draining")
                      else "yes" if engine.get("healthy") else "NO")
            lines.append(f"{engine['engine']!s:<{width}}{status:<13}{engine.get('pid') or '-'!s:<9}"
                         f"{engine.get('weight_version')!s:<9}"
                         f"{engine.get('relaunches') or 0!s:<12}{engine.get('outstanding') or 0!s:<11}"
                         f"{engine.get('last_error') or ''}")
    return "\n".join(lines)
