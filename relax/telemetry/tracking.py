"""Run-directory tracking: the metrics, TensorBoard events, W&B run, sample dumps and plots of one run.

Everything a run records goes under one directory (DESIGN.md §4)::

    run_dir/
      metrics.jsonl             one JSON object per logged step: {"step": 12, "rollout/reward_mean": 0.4, ...}
      tensorboard/              TensorBoard event files
      wandb/                    the W&B run (when enabled; offline runs too, with WANDB_MODE=offline)
                                (--use-clearml logs to a ClearML task instead of a folder here)
      samples/rollout_000012.jsonl   one Sample.to_dict() per line
      plots/*.png               the main curves, drawn on close()

``metrics.jsonl`` is the source of truth: it is plain text, flushed after every line, readable with
:func:`read_metrics` while the run is still going, and the plots are drawn from it. TensorBoard and W&B are views.
"""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
import re
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlparse

from relax.telemetry.metrics_file import METRICS_FILE, read_metrics, to_json_safe
from relax.telemetry.plots import plot_run

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
SAMPLES_DIR = "samples"
SAMPLE_DUMP_PATTERN = re.compile(r"rollout_(\d+)\.jsonl")

SECRET_NAME_PARTS = ("key", "token", "secret", "password")
REDACTED = "***"


CLEARML_FRAMEWORKS = ("matplotlib", "tensorflow", "tensorboard", "pytorch", "xgboost", "scikit", "fastai", "lightgbm",
                      "hydra", "detect_repository", "tfdefines", "joblib", "megengine", "catboost", "gradio")


def redact_secrets(config: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of ``config`` in which every value whose key names a secret is replaced by ``"***"``.

    A key names a secret when one of its words (split on ``_``, ``-``, ``.`` and spaces, case-insensitive) is
    ``key``, ``token``, ``secret`` or ``password``, at any depth, including dicts inside lists: ``api_key`` and
    ``hf_token`` are hidden, while ``tokenizer`` or ``max_tokens`` stay readable so a dumped config still reproduces
    the run.
    """
    return {name: REDACTED if _names_secret(name) else _redact_nested(value) for name, value in config.items()}


def _names_secret(name: object) -> bool:
    words = re.split(r"[_\-.\s]+", str(name).lower())
    return any(word in SECRET_NAME_PARTS for word in words)


def _redact_nested(value: Any) -> Any:
    if isinstance(value, dict):
        return redact_secrets(value)
    if isinstance(value, (list, tuple)):
        return [_redact_nested(item) for item in value]
    return value


class Tracker:
    """Records one training run into ``run_dir``: metrics, TensorBoard, W&B, sample dumps and plots.

    Create one tracker per run, in the process that owns the training loop (rank 0). On resume from a checkpoint at
    step ``s``, call :meth:`truncate_after` with ``s`` before logging, so the steps the killed run logged after its
    last checkpoint are replaced instead of duplicated. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        run_dir: Path,
        use_tensorboard: bool = True,
        use_wandb: bool = False,
        wandb_project: str | None = None,
        wandb_run_name: str | None = None,
        config: dict[str, Any] | None = None,
        metrics_service=None,
        clearml_project: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self._metrics_service = metrics_service  # relax.telemetry.metrics_service.MetricsService, or None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.samples_dir = self.run_dir / SAMPLES_DIR
        self._closed = False

        if self.metrics_path.exists() and not self.metrics_path.read_bytes().endswith(b"\n"):
            # A killed run left a torn last line; appending to it would merge it with the next, valid, line.
            self._rewrite_metrics(read_metrics(self.metrics_path))

        self._tensorboard = self._open_tensorboard() if use_tensorboard else None
        self._wandb_run = self._start_wandb(wandb_project, wandb_run_name, config) if use_wandb else None
        self._clearml_task = self._start_clearml(clearml_project, config) if clearml_project else None

    def _open_tensorboard(self, purge_from_step: int | None = None):
        # Imported here: torch.utils.tensorboard takes ~1.7 s to import, paid only by runs that use it.
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR), purge_step=purge_from_step)

    def _start_wandb(self, project: str | None, run_name: str | None, config: dict[str, Any] | None):
        try:
            import wandb
        except ImportError as error:
            raise ImportError(
                "W&B logging needs the wandb package: pip install relax-rl[wandb] (or turn W&B logging off)"
            ) from error
        problem = wandb_credentials_problem()
        if problem:  # wandb.init would prompt for a key, and without a terminal raise its UsageError
            raise ValueError(f"W&B logging: {problem}")
        # wandb.init reads WANDB_MODE itself, so WANDB_MODE=offline writes run_dir/wandb/offline-run-* without network.
        run = wandb.init(
            dir=str(self.run_dir),
            project=project,
            name=run_name,
            config=redact_secrets(config) if config else None,
        )
        # An evaluation beside fully-async training is logged when it lands, tagged with the version it ran on: W&B
        # draws the eval curves against that version (the plots in the run directory do the same).
        run.define_metric("eval/weight_version")
        run.define_metric("eval/*", step_metric="eval/weight_version")
        return run

    def _start_clearml(self, project: str, config: dict[str, Any] | None):
        try:
            from clearml import Task
        except ImportError as error:
            raise ImportError("ClearML logging needs the clearml package: pip install relax-rl[clearml] (or drop "
                              "--use-clearml)") from error
        if os.environ.get("CLEARML_OFFLINE_MODE", "").lower() in ("1", "true", "yes"):
            Task.set_offline(offline_mode=True)  # clearml reads the variable once, at import; honour it at any time
        # No automatic hooks: ClearML would otherwise patch torch.save, matplotlib and argparse of the whole process,
        # and it would store the repository's uncommitted diff in the task (code, and whatever secrets it holds).
        no_hooks = dict.fromkeys(CLEARML_FRAMEWORKS, False)
        task = Task.init(project_name=project, task_name=self.run_dir.name, reuse_last_task_id=False,
                         auto_connect_frameworks=no_hooks, auto_connect_arg_parser=False, auto_connect_streams=False,
                         auto_resource_monitoring=False)
        if config:
            task.connect_configuration(redact_secrets(config), name="relax config")
        return task

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` for ``step`` everywhere tracking is enabled.

        Values may be Python numbers, numpy scalars or one-element tensors. Non-finite values are kept: they are
        written as JSON null in ``metrics.jsonl`` and passed as NaN/inf to TensorBoard and W&B, so a diverging
        run shows where it diverged.
        """
        values = {name: float(value) for name, value in metrics.items()}
        row = {"step": step, **{name: value if math.isfinite(value) else None for name, value in values.items()}}
        # Opened per line (microseconds, once per step): each line reaches the OS as it is logged, so a kill loses at
        # most the line being written, and there is no file handle to keep open across truncate_after or close.
        with open(self.metrics_path, "a", encoding="utf-8") as metrics_file:
            metrics_file.write(json.dumps(row, allow_nan=False) + "\n")
        if self._metrics_service is not None:
            self._metrics_service.update(step, values)
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(name, value, global_step=step)
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)
        if self._clearml_task is not None:
            logger = self._clearml_task.get_logger()
            for name, value in values.items():  # "train/loss": the plot "train", its series "loss"
                title, _, series = name.rpartition("/")
                logger.report_scalar(title or name, series, value=value, iteration=step)

    def dump_samples(self, step: int, samples: list, max_samples: int | None = None) -> Path:
        """Write the first ``max_samples`` samples (all when ``None``) to ``samples/rollout_{step:06d}.jsonl``.

        Each line is one ``sample.to_dict()``, made JSON-safe by :func:`to_json_safe`. Returns the file written.
        """
        self.samples_dir.mkdir(exist_ok=True)
        dump_path = self.samples_dir / f"rollout_{step:06d}.jsonl"
        with open(dump_path, "w", encoding="utf-8") as dump_file:
            dump_file.writelines(
                json.dumps(to_json_safe(sample.to_dict()), ensure_ascii=False) + "\n"
                for sample in samples[:max_samples]
            )
        return dump_path

    def truncate_after(self, step: int) -> None:
        """Forget everything recorded after ``step``, the step of the checkpoint a run resumes from.

        Keeps the ``metrics.jsonl`` rows with ``"step" <= step`` (dropping a torn last line), deletes the sample dumps
        of later steps, and tells TensorBoard to hide its events after ``step``. W&B starts a new run on resume, so
        it has nothing to forget.
        """
        self._rewrite_metrics([row for row in read_metrics(self.metrics_path) if _step_of(row) <= step])

        if self.samples_dir.is_dir():
            for dump_path in self.samples_dir.iterdir():
                match = SAMPLE_DUMP_PATTERN.fullmatch(dump_path.name)
                if match and int(match.group(1)) > step:
                    dump_path.unlink()

        if self._tensorboard is not None:
            # purge_step writes a SessionLog.START at step + 1; TensorBoard then hides older events from that step on.
            self._tensorboard.close()
            self._tensorboard = self._open_tensorboard(purge_from_step=step + 1)

    def _rewrite_metrics(self, rows: list[dict[str, Any]]) -> None:
        # Written beside the file and renamed over it, so a kill during the rewrite leaves the old file whole.
        partial_path = self.metrics_path.with_name(METRICS_FILE + ".partial")
        with open(partial_path, "w", encoding="utf-8") as partial_file:
            partial_file.writelines(json.dumps(to_json_safe(row), allow_nan=False) + "\n" for row in rows)
        os.replace(partial_path, self.metrics_path)

    def close(self) -> list[Path]:
        """Flush and close every sink, then draw the plots from ``metrics.jsonl``; returns the PNG files written.

        Calling it again does nothing, so a ``with`` block around a loop that also closes the tracker is safe.
        """
        if self._closed:
            return []
        self._closed = True
        if self._metrics_service is not None:
            self._metrics_service.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
        if self._clearml_task is not None:
            self._clearml_task.close()
        # Imported here so that importing this module (every training process does) does not import matplotlib.
        return plot_run(self.run_dir)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _step_of(row: dict[str, Any]) -> float:
    """The row's step, or infinity for a row without a numeric step, so that truncation drops it."""
    step = row.get("step")
    return step if isinstance(step, (int, float)) and not isinstance(step, bool) else math.inf


class NullTracker:
    """The tracker of the other ranks of a multi-GPU run: rank 0 records the run, they record nothing."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        return None

    def dump_samples(self, step: int, samples: list, max_samples: int | None = None) -> None:
        return None

    def truncate_after(self, step: int) -> None:
        return None

    def close(self) -> list[Path]:
        return []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def wandb_credentials_problem() -> str | None:
    """Why ``wandb.init`` would stop for want of credentials (it prompts for an API key, and without a terminal
    raises after the run has started), or None: offline and disabled modes need none; ``WANDB_API_KEY``,
    ``WANDB_IDENTITY_TOKEN_FILE`` or a netrc entry for the W&B host (what ``wandb login`` writes) are
    credentials. Whether a key is valid only the server can say."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") \
            or os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true"):
        return None
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):  # None: ~/.netrc
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return (f"no W&B API key for {host}: set WANDB_API_KEY, run `wandb login`, or set WANDB_MODE=offline to log "
            "into the run directory only")
