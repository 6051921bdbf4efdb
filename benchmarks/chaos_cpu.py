"""Faults injected into a running training, as an operator meets them: real signals to real processes.

A fully-async run with its roles in Ray processes (`--placement ray --fully-async`, TransferQueue as the data plane)
is started with `--use-health-check` and `--max-global-restart`; while it trains, `run_with_faults` sends each
fault's signal (SIGKILL or SIGSTOP) to its target process once the run has logged the fault's step: the rollout or
actor role's Ray process, TransferQueue's storage unit or controller, or the run's own process. The targets' pids
come from the run's ``health.json`` (as an operator would read them with `relax health`). Each fault is timed from
the signal to the run's first error in ``run.log`` (detection) and to its next logged step (recovery). At the end
the run's steps are checked against the exactly-once contract: every step logged once, and each step's groups
produced = consumed with none outstanding; groups missing from or beyond the uninterrupted count are the
samples lost or duplicated.

    python -m benchmarks.chaos_cpu                 # both scenarios, 60 steps each; writes results/chaos_cpu.json
    python -m benchmarks.chaos_cpu --steps 12 --scenarios launched_engines   # a shorter run of one

Scenarios: ``ray_roles`` (the Ray roles, TransferQueue's storage and the run's process, seven faults) and
``launched_engines`` (two `relax serve` engines the run starts under --use-fault-tolerance, each SIGKILLed and
SIGSTOPped, and the run's own process SIGKILLed, five faults) and ``ray_engines`` (the same engines started by
the rollout role in its Ray process: each engine killed or stopped, and the rollout role killed, four faults). For an engine the pid comes from its /health,
detection is the first warning naming it, and recovery the next step after the run logged its relaunch.

`tests/e2e/test_chaos.py` runs the same machinery on a tiny model and also compares every metric with an
uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "chaos_cpu.json"
CONFIG = ROOT / "examples" / "quickstart" / "config.yaml"

# The process behind each fault target, as `relax.core.state.health` names it in health.json ("run": the run's own pid).
# A target "http://127.0.0.1:PORT" is a rollout engine the run started (--rollout-engine-protocol relax): its pid
# is the one its /health reports.
TARGETS = {"rollout": "rollout", "actor": "actor", "storage": "TransferQueue storage unit TransferQueueStorageUnit#0",
           "tq_controller": "TransferQueue controller", "run": None}
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(,\d{3})? (ERROR|WARNING) ")
_STEP_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(,\d{3})? INFO relax: step (\d+): ")


@dataclass
class Fault:
    target: str  # a key of TARGETS, or an engine's URL
    signal: str  # "SIGKILL" or "SIGSTOP"
    after_step: int  # sent once the run has logged this step
    # filled in by run_with_faults
    pid: int | None = None
    sent_at: float | None = None
    detection_s: float | None = None
    recovery_s: float | None = None
    recovered: bool = False
    detected_by: str | None = None


@dataclass
class ChaosReport:
    returncode: int
    wall_s: float
    faults: list[Fault] = field(default_factory=list)
    stderr_tail: str = ""
    warnings: str = ""  # run.log's last warnings and errors: what a failed assertion shows


def _last_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return -1
    steps = [json.loads(line).get("step", -1) for line in lines if line.strip()]
    return max(steps, default=-1)


def _read_state(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "health.json").read_text())
    except (OSError, ValueError):
        return None


def is_engine(target: str) -> bool:
    return target.startswith("http://")


def _engine_pid(url: str) -> int | None:
    import httpx

    try:
        return int(httpx.get(f"{url}/health", timeout=2).json()["pid"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None  # not up (yet, or again)


def _target_pid(state: dict | None, target: str) -> int | None:
    if is_engine(target):  # the pid the run's router reports (it started the engine), else the engine's own
        engines = {engine.get("engine"): engine for engine in (state or {}).get("engines") or []}
        known = engines.get(target, {})
        if known.get("pid") and known.get("healthy") and not known.get("relaunching"):
            return int(known["pid"])
        return _engine_pid(target)
    if TARGETS[target] is None:
        return state.get("pid")
    role = state.get("roles", {}).get(TARGETS[target], {})
    return role.get("pid") if role.get("healthy") else None


def _log_lines(run_log: Path):
    """Each ERROR or WARNING line of run.log as (time it was written, level, line)."""
    try:
        lines = run_log.read_text(errors="replace").splitlines()
    except OSError:
        return
    for line in lines:
        match = _LOG_TIME.match(line)
        if match:
            yield _stamp(match.group(1), match.group(2)), match.group(3), line[len(match.group(0)):]


def _stamp(seconds: str, milliseconds: str | None) -> float:
    """A run.log time as a Unix time; a supervisor line has no milliseconds: rounded up."""
    return datetime.strptime(seconds, "%Y-%m-%d %H:%M:%S").timestamp() + \
        (int(milliseconds[1:]) / 1000 if milliseconds else 0.999)


def _first_error_after(run_log: Path, since: float, mention: str | None = None) -> tuple[float, str] | None:
    """The time and text of the first ERROR (or supervisor WARNING) line of run.log written after ``since``; with
    ``mention``, the first ERROR or WARNING line that contains it."""
    for stamp, level, text in _log_lines(run_log):
        wanted = mention in text if mention is not None else level == "ERROR" or "supervisor" in text
        if wanted and stamp >= since - 0.01:  # times have milliseconds; `since` is taken just after the signal
            return stamp, text
    return None


def run_with_faults(command: list[str], run_dir: Path, faults: list[Fault], timeout_s: float,
                    env: dict[str, str] | None = None, poll_s: float = 0.2, hold: Path | None = None) -> ChaosReport:
    """Run ``command`` (a `relax train` with --use-health-check and --max-global-restart) and inject ``faults`` in
    order; returns when the run ends (or is killed at ``timeout_s``).

    With ``hold`` (a file path, passed to the run as $RELAX_CHAOS_HOLD), the file exists while the run must not
    move on: while the next fault is due but not sent yet, and while a detected engine fault waits for its
    relaunch. A reward that waits while it exists (tests.support.e2e_rewards:digit_fraction_held) then keeps every fault
    inside the run however slowly a loaded machine relaunches an engine; detection is never held back (the hold
    starts only after the fault is detected, so the run's traffic still reaches the dead or stopped engine)."""
    started = time.time()
    log = run_dir.parent / f"{run_dir.name}.stderr"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **(env or {}), **({"RELAX_CHAOS_HOLD": str(hold)} if hold is not None else {})}
    with log.open("w") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                   process_group=0)
    pending = list(faults)
    in_flight: Fault | None = None
    stopped: list[int] = []
    try:
        while process.poll() is None:
            if time.time() - started > timeout_s:
                os.killpg(process.pid, signal.SIGKILL)
                break
            step = _last_step(run_dir / "metrics.jsonl")
            if in_flight is not None:
                _follow(in_flight, run_dir, step)
                if in_flight.recovered:
                    in_flight = None
            if hold is not None:
                _set_hold(hold, _must_hold(in_flight, pending, step, run_dir))
            if in_flight is None and pending and step >= pending[0].after_step:
                state = _read_state(run_dir)
                fresh = state is not None and time.time() - state["time"] < 2.0  # the live child's, not a dead one's
                pid = _target_pid(state, pending[0].target) if fresh or is_engine(pending[0].target) else None
                if pid is not None:
                    try:
                        os.kill(pid, getattr(signal, pending[0].signal))
                    except ProcessLookupError:  # gone since the state was written: look again
                        pid = None
                if pid is not None:
                    in_flight = pending.pop(0)
                    in_flight.pid, in_flight.sent_at, in_flight.after_step = pid, time.time(), step
                    if in_flight.signal == "SIGSTOP":
                        stopped.append(pid)
            time.sleep(poll_s)
        if in_flight is not None:
            _follow(in_flight, run_dir, _last_step(run_dir / "metrics.jsonl"))
            # a fault after the last step: detected, and the restarted run found nothing left to train
            in_flight.recovered = in_flight.recovered or (in_flight.detection_s is not None
                                                          and process.returncode == 0)
    finally:
        if hold is not None:
            _set_hold(hold, False)
        for pid in stopped:  # a stopped process the restart left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if process.poll() is None:
            process.wait(30)
    warnings = [f"{level} {text}" for _, level, text in _log_lines(run_dir / "run.log")][-40:]
    return ChaosReport(process.returncode, time.time() - started, list(faults),
                       log.read_text(errors="replace")[-3000:], "\n".join(line[:300] for line in warnings))


def _must_hold(in_flight: Fault | None, pending: list[Fault], step: int, run_dir: Path) -> bool:
    if in_flight is None:
        return bool(pending) and step >= pending[0].after_step
    return (is_engine(in_flight.target) and in_flight.detection_s is not None
            and not _relaunched_after(run_dir / "run.log", in_flight))


def _set_hold(hold: Path, on: bool) -> None:
    if on:
        hold.touch()
    else:
        hold.unlink(missing_ok=True)


def _follow(fault: Fault, run_dir: Path, step: int) -> None:
    """Detection: the first error the run logged after the signal (for an engine: the first warning naming it);
    recovery: for an engine, the next step logged after the run logged it relaunched; for a role, the storage or
    the run, the first step beyond the fault's that the restarted run logged (a step the dying run still wrote, as
    a fully-async run can between the signal and its detection, is no recovery, and the next fault must not reach
    a run that is already ending)."""
    engine = is_engine(fault.target)
    run_log = run_dir / "run.log"
    if fault.detection_s is None:
        error = _first_error_after(run_log, fault.sent_at, mention=fault.target if engine else None)
        if error is not None:
            fault.detection_s = round(error[0] - fault.sent_at, 2)
            fault.detected_by = error[1][:300]
    if fault.detection_s is None:
        return
    if engine:
        recovered = _relaunched_after(run_log, fault) and step > fault.after_step
    else:
        restarted = _restarted_at(run_log, fault.sent_at)
        recovered = restarted is not None and _last_logged_step(run_log, restarted) > fault.after_step
    if recovered:
        fault.recovery_s = round(time.time() - fault.sent_at, 2)
        fault.recovered = True


def _restarted_at(run_log: Path, since: float) -> float | None:
    """When the supervisor logged its first restart after ``since``."""
    for stamp, _, text in _log_lines(run_log):
        if "supervisor" in text and "; restart " in text and stamp >= since:
            return stamp
    return None


def _last_logged_step(run_log: Path, since: float) -> int:
    """The highest step that run.log reports as done after ``since``."""
    try:
        lines = run_log.read_text(errors="replace").splitlines()
    except OSError:
        return -1
    steps = [-1]
    for line in lines:
        match = _STEP_LINE.match(line)
        if match and _stamp(match.group(1), match.group(2)) >= since:
            steps.append(int(match.group(3)))
    return max(steps)


def _relaunched_after(run_log: Path, fault: Fault) -> bool:
    return any(f"engine {fault.target} relaunched" in text and stamp >= fault.sent_at - 1
               for stamp, _, text in _log_lines(run_log))


def accounting(rows: list[dict], steps: int, groups_per_step: int, samples_per_group: int) -> dict:
    """The exactly-once check of a finished run's metrics: every step once, every group produced and consumed once."""
    trained = [row for row in rows if "data/consumed_groups" in row]
    by_step: dict[int, list[dict]] = {}
    for row in trained:
        by_step.setdefault(row["step"], []).append(row)
    lost = duplicated = 0
    for step in range(1, steps + 1):
        logged = by_step.get(step, [])
        consumed = sum(row["data/consumed_groups"] for row in logged)
        lost += max(0, groups_per_step - consumed)
        duplicated += max(0, consumed - groups_per_step)
        for row in logged:
            lost += max(0, row["data/produced_groups"] - row["data/consumed_groups"])
    return {"steps_logged": len(by_step), "steps_expected": steps,
            "samples_lost": lost * samples_per_group, "samples_duplicated": duplicated * samples_per_group,
            "outstanding_groups": sum(row.get("data/outstanding_groups", 0) for row in trained)}


def version_violations(rows: list[dict], max_staleness: int) -> list[str]:
    """Steps whose samples came from weights outside the staleness bound of the trainer's version at that step
    (``rollout/weight_version_min`` / ``_max``; the trainer holds version step - 1 when step `step` is generated
    and trained), or from later weights than the trainer's: a dead run's, served after a resume."""
    merged: dict[int, dict] = {}
    for row in rows:
        merged.setdefault(row["step"], {}).update(row)
    problems = []
    for step, row in sorted(merged.items()):
        if "rollout/weight_version_min" not in row:
            continue
        trainer, low, high = step - 1, row["rollout/weight_version_min"], row["rollout/weight_version_max"]
        if high > trainer or low < trainer - max_staleness:
            problems.append(f"step {step}: samples of versions {low:g}-{high:g}, trainer at {trainer}")
    return problems


def actor_resumes_scenario(transport: str):
    """The actor's Ray process SIGKILLed at seeded random steps, the run resumed each time (--max-staleness 0, so
    every step's metrics must equal the uninterrupted run's and every sample must come from the trainer's version
    at its step), with weights over ``transport``."""
    def scenario(steps: int, heartbeat_timeout_s: float) -> tuple[list[str], list[Fault], str]:
        import random

        points = sorted(random.Random(steps).sample(range(1, steps - 1), k=min(5, steps - 2)))
        faults = [Fault("actor", "SIGKILL", step) for step in points]
        command = ["--placement", "ray", "--fully-async", "--max-staleness", "0", "--save-interval", "1",
                   "--weight-sync-transport", transport, "--use-health-check", "--heartbeat-timeout-s",
                   str(heartbeat_timeout_s), "--max-global-restart", str(len(faults) + 1)]
        return command, faults, f"fully-async, --max-staleness 0, roles in Ray processes, weights over {transport}: " \
                                f"the actor SIGKILLed after steps {points}"

    return scenario


def ray_roles_scenario(steps: int, heartbeat_timeout_s: float) -> tuple[list[str], list[Fault], str]:
    """Roles in Ray processes, TransferQueue as the data plane: each kind of process killed or stopped."""
    every = max(2, steps // 8)
    faults = [Fault("rollout", "SIGKILL", every), Fault("storage", "SIGSTOP", 2 * every),
              Fault("actor", "SIGKILL", 3 * every), Fault("rollout", "SIGSTOP", 4 * every),
              Fault("storage", "SIGKILL", 5 * every), Fault("run", "SIGKILL", 6 * every),
              Fault("actor", "SIGSTOP", 7 * every)]
    command = ["--placement", "ray", "--fully-async", "--max-staleness", "1", "--save-interval", "2",
               "--use-health-check", "--heartbeat-timeout-s", str(heartbeat_timeout_s),
               "--max-global-restart", str(len(faults) + 1)]
    return command, faults, "fully-async, --max-staleness 1, roles in Ray processes, TransferQueue data plane"


def launched_engines_scenario(steps: int, heartbeat_timeout_s: float) -> tuple[list[str], list[Fault], str]:
    """Two `relax serve` engines the run starts (--use-fault-tolerance): each killed and stopped, and the run's
    own process killed (its successor starts its engines again on the same ports)."""
    from relax.distributed.process_group import free_port

    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    every = max(2, steps // 6)
    faults = [Fault(urls[0], "SIGKILL", every), Fault(urls[1], "SIGSTOP", 2 * every),
              Fault("run", "SIGKILL", 3 * every), Fault(urls[0], "SIGSTOP", 4 * every),
              Fault(urls[1], "SIGKILL", 5 * every)]
    command = ["--fully-async", "--max-staleness", "1", "--save-interval", "2", "--rollout-external",
               "--rollout-engine-protocol", "relax", "--rollout-external-engine-addrs", *urls,
               "--use-fault-tolerance", "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "2",
               "--use-health-check", "--heartbeat-timeout-s", str(heartbeat_timeout_s), "--max-global-restart", "2"]
    return command, faults, ("fully-async, --max-staleness 1, in-process trainer, two `relax serve` engines started "
                             "by the run (--rollout-engine-protocol relax --use-fault-tolerance)")


def ray_engines_scenario(steps: int, heartbeat_timeout_s: float) -> tuple[list[str], list[Fault], str]:
    """Roles in Ray processes, the rollout role's engines in `relax serve` processes it starts: each engine
    killed and stopped, and the rollout role killed (its engines die with it; the restarted run starts new ones)."""
    from relax.distributed.process_group import free_port

    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    every = max(2, steps // 5)
    faults = [Fault(urls[0], "SIGKILL", every), Fault(urls[1], "SIGSTOP", 2 * every),
              Fault("rollout", "SIGKILL", 3 * every), Fault(urls[0], "SIGSTOP", 4 * every)]
    command = ["--placement", "ray", "--fully-async", "--max-staleness", "1", "--save-interval", "2",
               "--rollout-external", "--rollout-engine-protocol", "relax", "--rollout-external-engine-addrs", *urls,
               "--use-fault-tolerance", "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "2",
               "--use-health-check", "--heartbeat-timeout-s", str(heartbeat_timeout_s), "--max-global-restart", "2"]
    return command, faults, ("fully-async, --max-staleness 1, roles in Ray processes, the rollout role's two "
                             "engines in `relax serve` processes it starts (--use-fault-tolerance)")


SCENARIOS = {"ray_roles": ray_roles_scenario, "launched_engines": launched_engines_scenario,
             "ray_engines": ray_engines_scenario, "actor_resumes_disk": actor_resumes_scenario("disk"),
             "actor_resumes_broadcast": actor_resumes_scenario("broadcast")}
# Scenarios whose metrics must equal an uninterrupted run's (their --max-staleness is 0): one runs beside them.
COMPARED = {"actor_resumes_disk", "actor_resumes_broadcast"}


def run_scenario(name: str, steps: int, heartbeat_timeout_s: float, run_dir: Path) -> dict:
    import yaml

    config = yaml.safe_load(CONFIG.read_text())
    groups, samples = int(config["rollout_batch_size"]), int(config["n_samples_per_prompt"])
    extra, faults, mode = SCENARIOS[name](steps, heartbeat_timeout_s)
    command = [sys.executable, "-m", "relax.cli.main", "train", "--config", str(CONFIG), "--num-rollout", str(steps),
               "--skip-eval-before-train", "--eval-interval", str(10 * steps), "--max-checkpoints", "2",
               "--dump-samples", "0", "--no-use-tensorboard", "--output-dir", str(run_dir), *extra]
    report = run_with_faults(command, run_dir, faults, timeout_s=60 * 60,
                             env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    counts = accounting(rows, steps, groups, samples)
    staleness = int(extra[extra.index("--max-staleness") + 1])
    violations = version_violations(rows, staleness)
    mismatches = None
    if name in COMPARED:  # the same run without faults: every step's metrics must be equal
        plain = [arg for arg in command if arg not in ("--use-health-check",)]
        plain = _without_option(_without_option(plain, "--max-global-restart"), "--heartbeat-timeout-s")
        reference_dir = run_dir.with_name(run_dir.name + "-reference")
        plain[plain.index("--output-dir") + 1] = str(reference_dir)
        subprocess.run(plain, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
                       capture_output=True, timeout=60 * 60)
        reference = [json.loads(line) for line in (reference_dir / "metrics.jsonl").read_text().splitlines() if line]
        mismatches = metric_mismatches(rows, reference)
    detections = [f.detection_s for f in report.faults if f.detection_s is not None]
    result = {
        "faults_injected": sum(f.sent_at is not None for f in report.faults),
        "recovered": sum(f.recovered for f in report.faults),
        "samples_lost": counts["samples_lost"], "samples_duplicated": counts["samples_duplicated"],
        "max_detection_s": max(detections, default=None),
        "version_violations": violations, "metric_mismatches": mismatches,
        "finished": report.returncode == 0 and counts["steps_logged"] == steps,
        "returncode": report.returncode, "wall_s": round(report.wall_s, 1), "steps": steps,
        "heartbeat_timeout_s": heartbeat_timeout_s, "accounting": counts, "mode": mode,
        "faults": [dict(asdict(f)) for f in report.faults],
    }
    if not result["finished"]:
        print(report.stderr_tail, file=sys.stderr)
    return result


def _without_option(command: list[str], name: str) -> list[str]:
    if name not in command:
        return command
    at = command.index(name)
    return command[:at] + command[at + 2:]


def metric_mismatches(mine: list[dict], theirs: list[dict], rel: float = 1e-4) -> list[str]:
    """Every (step, metric) whose value differs from the reference run's (timings and staleness counters aside)."""
    def merged(rows: list[dict]) -> dict[int, dict]:
        by_step: dict[int, dict] = {}
        for row in rows:
            by_step.setdefault(row["step"], {}).update(row)
        return by_step

    mine_by_step, theirs_by_step = merged(mine), merged(theirs)
    problems = [f"step {step}: missing" for step in theirs_by_step if step not in mine_by_step]
    for step, row in theirs_by_step.items():
        for key, value in row.items():
            if key.startswith(("perf/", "data/staleness")) or isinstance(value, bool) or \
                    not isinstance(value, (int, float)) or value != value:
                continue
            got = mine_by_step.get(step, {}).get(key)
            if got is None or abs(got - value) > rel * abs(value) + 1e-6:
                problems.append(f"step {step} {key}: {got} vs {value}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=10.0)
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--run-dir", type=Path, default=None, help="default: a temporary directory")
    args = parser.parse_args()
    if not (ROOT / "examples" / "quickstart" / "model").is_dir():
        raise SystemExit("build the quickstart first: python examples/quickstart/build_quickstart.py")
    import tempfile

    scenarios = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.scenarios:
            run_dir = (args.run_dir or Path(tmp)) / name
            scenarios[name] = run_scenario(name, args.steps, args.heartbeat_timeout_s, run_dir)
            print(name, json.dumps({k: scenarios[name][k] for k in ("faults_injected", "recovered", "samples_lost",
                                                                     "samples_duplicated", "max_detection_s",
                                                                     "version_violations", "metric_mismatches",
                                                                     "finished")}))
    for result in scenarios.values():
        result["command"] = "python -m benchmarks.chaos_cpu " + " ".join(sys.argv[1:])
    if args.out.exists():  # the file keeps each scenario's newest result: re-running some leaves the others
        scenarios = {**json.loads(args.out.read_text()).get("scenarios", {}), **scenarios}
    results = list(scenarios.values())
    detections = [r["max_detection_s"] for r in results if r["max_detection_s"] is not None]
    out = {  # the headline over every scenario, then each one
        "benchmark": "chaos_cpu",
        "faults_injected": sum(r["faults_injected"] for r in results),
        "recovered": sum(r["recovered"] for r in results),
        "samples_lost": sum(r["samples_lost"] for r in results),
        "samples_duplicated": sum(r["samples_duplicated"] for r in results),
        "max_detection_s": max(detections, default=None),
        "version_violations": sum(len(r.get("version_violations") or []) for r in results),
        "metric_mismatches": sum(len(r.get("metric_mismatches") or []) for r in results),
        "finished": all(r["finished"] for r in results),
        "command": "python -m benchmarks.chaos_cpu",  # each scenario says the command of its newest run
        "scenarios": scenarios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("faults_injected", "recovered", "samples_lost", "samples_duplicated",
                                          "max_detection_s", "finished")}, indent=2))


if __name__ == "__main__":
    main()
