"""Global restart (``--max-global-restart N``): `relax train` as a supervising parent of the run's process.

The parent starts the run as a child process and waits. A child that ends well, stops on a signal with a
checkpoint, or fails with an error Relax named (a bad setting, a damaged checkpoint: exit 2, which a restart
would only repeat) ends the supervision with its exit code. A child that dies otherwise (killed, out of memory,
a crash) is started again, at most N times, resuming the run in place (``--load <save dir>``): from its newest intact
checkpoint or, when none was saved yet, from its first step (its run.log kept). A resumed run truncates its metrics
after the checkpoint's step and re-trains the steps after it, so the metrics equal an uninterrupted run's: no step
trained twice into the record, none skipped.

With ``--use-health-check`` the parent also watches the child's ``health.json``, which its health monitor rewrites
every second: once the child has written it, a state older than ``--heartbeat-timeout-s`` means the whole process
is stopped (SIGSTOP) or wedged, and the parent kills its process group and restarts it like a dead one.

SIGTERM and SIGINT sent to the parent go to the child (which stops after its step with a checkpoint), so a
scheduler's stop works as without supervision. Each restart is logged to ``run.log`` and notified
(``--notify-urls``).

Each child is forked from Python's forkserver, a clean interpreter started once per supervision that imported the
training code (the command's ``preload``: torch, transformers, Relax) and never ran anything: a restart does not
import them again (about 8 s of CPU on a 2-core machine, most of a restart's start-up before the model loads). The
forkserver only imports, never touches CUDA, so a child starts as a fresh interpreter would, as a process of its own
(its own pid and process group, the parent's environment, directory and standard streams, its exit code or signal).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from relax.core.state.health import HealthStateError, read_state
from relax.core.state.liveness import SilenceJudge

logger = logging.getLogger("relax")

SUPERVISED_ENV = "RELAX_SUPERVISED"  # set in the child: it runs the training itself
RESTARTS_ENV = "RELAX_GLOBAL_RESTARTS"  # how many restarts came before this child (--use-metrics-service)
NOT_RESTARTABLE = {0, 2}  # done; an error Relax named (a restart would repeat it)


def _without_flags(argv: list[str], names: set[str], with_value: set[str]) -> list[str]:
    """``argv`` without the given flags (and the value of those in ``with_value``), in either spelling."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in names:
            skip = name in with_value and "=" not in arg
            continue
        kept.append(arg)
    return kept


def child_argv(argv: list[str], save_dir: Path, restart: int) -> list[str]:
    """The first start runs ``argv`` as given; a restart resumes the run in place (``--load`` its save directory):
    from its newest intact checkpoint, or from its first step when it had none yet, keeping its run.log (with the
    fault's error and the restart's note), which ``--overwrite`` would delete."""
    if restart == 0:
        return list(argv)
    base = _without_flags(argv, {"--load", "--overwrite", "--no-overwrite"}, {"--load"})
    return [*base, "--load", str(save_dir)]


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def supervise(argv: list[str], cfg, notifier, entry: Callable[[list[str]], int], preload: Sequence[str]) -> int:
    """Run ``entry(argv)`` (the command, ``relax train argv``; a module-level function: the child gets it by name) in
    a child process, restarting it as the module docstring says; the children's forkserver imports
    ``preload`` (modules) once."""
    save_dir = Path(cfg.save_dir)
    env = {**os.environ, SUPERVISED_ENV: "1"}
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    child: multiprocessing.process.BaseProcess | None = None
    stop_signal: list[int] = []

    def forward(signum, _frame) -> None:
        stop_signal.append(signum)
        if child is None or child.pid is None:
            return
        # Not `child.exitcode`: that reads the exit status off the forkserver's pipe, and a handler that ran while
        # the main thread waited on the same pipe would take the status from under it
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:  # it has just ended
            pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for restart in range(cfg.max_global_restart + 1):
            args = child_argv(argv, save_dir, restart)
            started = time.monotonic()
            child = context.Process(target=_child_main, name=f"relax-train-{restart}",
                                    args=(entry, args, {**env, RESTARTS_ENV: str(restart)}, os.getcwd()))
            child.start()
            code = _wait_or_hang(child, cfg)
            if code in NOT_RESTARTABLE or stop_signal or restart == cfg.max_global_restart:
                if code not in NOT_RESTARTABLE and not stop_signal:
                    _note(cfg, f"the run died ({_describe(code)}) and --max-global-restart "
                               f"{cfg.max_global_restart} restarts are used up")
                return code if code >= 0 else 128 - code
            cause = f"the run died ({_describe(code)}) after {time.monotonic() - started:.0f} s"
            _note(cfg, f"{cause}; restart {restart + 1} of {cfg.max_global_restart}")
            notifier.send("restarting", f"run directory {cfg.output_dir}: {cause}; restart {restart + 1} of "
                                        f"{cfg.max_global_restart}", failure=True)
        return 1  # pragma: no cover - the loop always returns
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _child_main(entry: Callable[[list[str]], int], args: list[str], env: dict[str, str], cwd: str) -> None:
    """In the forked child: ``entry(args)`` as the interpreter would run the command (environment, directory, exit
    code, exit handlers), in a process group of its own, so a terminal's Ctrl-C or a group-wide SIGTERM reaches it
    once, through the parent's `forward` (a second signal would make it stop at once, without its checkpoint)."""
    os.setpgid(0, 0)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["relax", "train", *args]
    interrupted = False
    try:
        code = entry(args)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except KeyboardInterrupt:
        interrupted, code = True, 130
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback on stderr, exit 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # a forked process skips them at os._exit; the interpreter runs them
    sys.stdout.flush()
    sys.stderr.flush()
    if interrupted:  # as the interpreter ends on an unhandled Ctrl-C: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _wait_or_hang(child: multiprocessing.process.BaseProcess, cfg) -> int:
    """The child's exit code, or minus the signal that killed it; under --use-health-check a child whose health
    state went stale is killed first."""
    if not cfg.use_health_check:
        child.join()
        return child.exitcode
    silence = SilenceJudge(cfg.heartbeat_timeout_s)
    starved_said = False
    while True:
        child.join(timeout=1.0)
        if child.exitcode is not None:
            return child.exitcode
        try:
            state = read_state(cfg.output_dir)
        except HealthStateError as err:  # not the child's writing (it replaces the whole file each second)
            logger.debug("%s", err)
            state = None
        if state is None or state.get("pid") != child.pid or state.get("fatal") or state.get("ended"):
            continue  # not written by this child yet (start-up), or it is ending (after a fault, or done)
        silent = time.time() - state["time"]
        if silent <= cfg.heartbeat_timeout_s:
            silence.look(child.pid)
            starved_said = False
            continue
        if silence.starved(child.pid, silent):  # computing, only slowly: a loaded machine (`liveness`)
            if not starved_said:
                _note(cfg, f"the run's process (pid {child.pid}) has written no health state for {silent:.0f} s but "
                           "is computing: starved of CPU, not hung; waiting")
                starved_said = True
            continue
        _note(cfg, f"the run's process (pid {child.pid}) has written no health state for {silent:.0f} s "
                   f"(--heartbeat-timeout-s {cfg.heartbeat_timeout_s:g}): stopped or hung; killing it")
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.join()
        return child.exitcode


def _note(cfg, message: str) -> None:
    """To the console and the run's log (the child appends to the same run.log)."""
    print(f"relax train: {message}", file=sys.stderr, flush=True)
    run_log = Path(cfg.output_dir) / "run.log"
    if run_log.parent.is_dir():
        with run_log.open("a") as handle:
            handle.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} WARNING relax.supervisor: {message}\n")
