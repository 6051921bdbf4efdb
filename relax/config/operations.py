"""The run: its directory, checkpoints, trackers, health and fault tolerance (sections: run)"""

from __future__ import annotations

from pydantic import BaseModel

from relax.config.base import setting


class OperationsSettings(BaseModel):
    """The run: its directory, checkpoints, trackers, health and fault tolerance."""
    output_dir: str = setting(
        "runs/latest", "Run directory: resolved config, metrics.jsonl, TensorBoard, plots, samples, run.log.", "run",
        path=True,
    )
    save: str | None = setting(None, "Checkpoint directory (default: <output-dir>/checkpoints).", "run", path=True)
    load: str | None = setting(
        None, "Resume from the newest checkpoint in this checkpoint directory or run directory.", "run", path=True
    )
    save_interval: int | None = setting(
        None, "Save a checkpoint every this many rollout steps. The last step is always saved.", "run", ge=1)
    max_checkpoints: int | None = setting(
        None, "Keep only the newest this many checkpoints, deleting older ones after each save (default: keep all). "
        "Upstream's --rotate-ckpt rotates only with --async-save; this works with every save.", "run", ge=1,
    )
    async_save: bool = setting(
        False, "Write checkpoints in the background: the trainer's state is copied to host memory when the step is "
        "saved and written to disk while the next steps run; the checkpoint is sealed (manifest, rename, latest "
        "pointer, --max-checkpoints rotation) once its files are written. One save at a time (the next waits for "
        "it); the run waits for the last one before it ends. One trainer process (not under torchrun).", "run",
    )
    max_global_restart: int = setting(
        0, "Supervise the run from a parent process and restart it, at most this many times, when its process dies "
        "(killed, out of memory, a crash), resuming from its newest intact checkpoint (docs/fault_tolerance.md). "
        "Upstream's default is 3 with its health manager; 0 here runs without a supervisor.", "run", ge=0,
    )
    no_save_optim: bool = setting(False, "Save model weights only (such a checkpoint cannot resume training).", "run")
    overwrite: bool = setting(
        False,
        "Start afresh in an --output-dir that holds an earlier run, deleting that run's files (config, metrics, "
        "logs, plots, samples, TensorBoard events, checkpoints). Without it, such a directory is refused unless "
        "--load resumes the run in it.",
        "run",
    )
    notify_urls: str | None = setting(
        None, "Apprise URLs, comma separated (tgram://, slack://, mailto://, json:// ...), told when the run starts, "
        "finishes, is stopped or fails. Secret: never logged or saved, and redacted from the messages.", "run",
        secret=True,
    )
    stall_warning_s: float | None = setting(
        600.0, "Report a phase of a step (rollout, training, weight sync, evaluation, checkpoint, a wait for data) "
        "that has run this long, in the log and to --notify-urls, and again at every further multiple; none: never.",
        "run", gt=0,
    )
    use_health_check: bool = setting(
        False, "Watch the run's processes: roles in Ray processes send heartbeats, TransferQueue's actors are probed, "
        "and the state is kept in <output-dir>/health.json (`relax health`, --use-metrics-service). A role that is "
        "dead or sends no heartbeat for --heartbeat-timeout-s ends the run naming it, so --max-global-restart "
        "restarts it (upstream's HealthManager; docs/fault_tolerance.md).", "run",
    )
    heartbeat_timeout_s: float = setting(
        120.0, "Seconds without a heartbeat after which a role counts as hung (--use-health-check; upstream's "
        "HEARTBEAT_TIMEOUT).", "run", gt=0,
    )
    timeline_dump_dir: str | None = setting(
        None, "Write each step's phases as a Chrome trace (timeline.json, for Perfetto or chrome://tracing) here.",
        "run", path=True,
    )
    use_metrics_service: bool = setting(
        False, "Serve the run's metrics, restart count and engine health in Prometheus format on "
        "http://127.0.0.1:<--metrics-service-port>/metrics.", "run",
    )
    metrics_service_port: int = setting(9108, "Port of --use-metrics-service (127.0.0.1 only).", "run", ge=1,
                                       le=65535)
    use_tensorboard: bool = setting(True, "Write TensorBoard events into <output-dir>/tensorboard.", "run")
    use_wandb: bool = setting(False, "Log to Weights & Biases (set WANDB_MODE=offline to stay local).", "run")
    wandb_project: str | None = setting(None, "W&B project name.", "run")
    use_clearml: bool = setting(
        False, "Log to ClearML (a task named after --output-dir in --clearml-project; its server comes from "
        "~/.clearml.conf or CLEARML_* variables; CLEARML_OFFLINE_MODE=1 keeps a local session instead). "
        "pip install relax-rl[clearml].", "run",
    )
    clearml_project: str = setting("relax", "ClearML project of --use-clearml's task.", "run")
    dump_samples: int = setting(8, "Samples per rollout step written to <output-dir>/samples (0: none).", "run", ge=0)
