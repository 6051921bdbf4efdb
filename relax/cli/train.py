"""`relax train`: parse and check the settings, supervise (--max-global-restart) or prepare the run directory, run the
training (`relax.core.run.train`), and say how it ended."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from relax.cli.args import parse_config
from relax.cli.common import (
    build_notifier,
    cause_first,
    flag_of,
    quiet_libraries,
    resolved_config_text,
    setup_logging,
    with_model_folders,
)
from relax.config import ConfigError
from relax.core.preflight import preflight
from relax.core.run import first_eval_accuracy, reward_failures, train
from relax.core.state.run_dir import prepare_run_dir
from relax.core.state.supervisor import SUPERVISED_ENV, supervise
from relax.telemetry.notify import Notifier

# What the supervisor's forkserver imports once for its children (--max-global-restart): this command and the training
# stack under it.
SUPERVISED_PRELOAD = ("relax.cli.main", "relax.cli.train", "relax.core.build", "matplotlib.figure")


def supervised_child(argv: list[str]) -> int:
    """A supervised child: ``relax train ARGV`` as ``python -m relax.cli.main train ARGV`` runs it."""
    from relax.cli.main import main

    return main(["train", *argv])


def cmd_train(argv: list[str]) -> int:
    cfg = with_model_folders(parse_config(argv, prog="relax train"))
    run_dir = Path(cfg.output_dir)
    primary = int(os.environ.get("RANK", "0")) == 0  # under torchrun, rank 0 writes the run directory
    quiet_libraries()
    preflight(cfg)  # settings that fail without loading anything fail here, before a run directory exists
    if cfg.max_global_restart and not os.environ.get(SUPERVISED_ENV):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(f"{flag_of('max_global_restart')} supervises one process; under torchrun use its own "
                              "--max-restarts")
        return supervise(argv, cfg, build_notifier(cfg), supervised_child, SUPERVISED_PRELOAD)
    created = prepare_run_dir(cfg) if primary else False
    setup_logging(run_dir if primary else None)
    config_text = resolved_config_text(cfg)
    if primary:
        (run_dir / "config.yaml").write_text(config_text)
    notifier = build_notifier(cfg) if primary else Notifier([])

    def announce() -> None:
        print(f"resolved config ({run_dir / 'config.yaml'}):\n{config_text}", file=sys.stderr)

    try:
        result = train(cfg, run_dir, primary, created, notifier, announce)
    except BaseException as err:
        if not isinstance(err, KeyboardInterrupt):
            notifier.failed(str(run_dir), cause_first(err))
        raise
    if result.stopped_after_step is not None:
        if primary:
            print(f"stopped by {result.signal_name} after step {result.stopped_after_step}, checkpoint saved; "
                  f"continue with the same command plus --load {cfg.save_dir}", file=sys.stderr)
        return result.exit_code
    if not primary:
        return 0
    report_end(run_dir, result.last, result.last_checkpoint)
    return reward_failures_verdict(run_dir)


def report_end(run_dir: Path, last: dict[str, float], last_checkpoint: Path | None) -> None:
    """The held-out accuracy before and after, what the run directory holds, the final checkpoint."""
    first = first_eval_accuracy(run_dir)
    if "eval/accuracy" in last and first is not None:
        what = "pair accuracy" if any(key.endswith("/pair_accuracy") for key in last) else "accuracy"
        print(f"held-out {what}: {first:.3f} before training -> {last['eval/accuracy']:.3f} after "
              f"({100 * (last['eval/accuracy'] - first):+.1f} points)")
    written = [name for name in ("metrics.jsonl", "plots/", "tensorboard/", "samples/")
               if (run_dir / name.rstrip("/")).exists()]
    print(f"run directory: {run_dir} ({', '.join(written)})")
    print(f"final checkpoint: {last_checkpoint} (relax export {run_dir} OUT_DIR writes a Hugging Face folder)")


def reward_failures_verdict(run_dir: Path) -> int:
    """A run whose reward failed says so at its end (each failure scored 0, so the run learned nothing from those
    samples): a warning when some rewards failed, exit 1 when every one did (the reward is broken, not the model)."""
    failed, scored = reward_failures(run_dir)
    if not failed:
        return 0
    where = f"see {run_dir / 'run.log'} for each distinct error"
    if failed >= scored:
        print(f"relax train: error: the reward failed on every sample ({failed} of {scored}), each scored 0: the run "
              f"learned nothing from its rewards; {where}", file=sys.stderr)
        return 1
    print(f"relax train: warning: the reward failed on {failed} of {scored} samples (each scored 0); {where}",
          file=sys.stderr)
    return 0
