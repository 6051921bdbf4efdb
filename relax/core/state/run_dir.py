"""The run directory (`--output-dir`): one run per directory.

A directory that holds an earlier run (its metrics or checkpoints) is refused, naming it, unless the new run
resumes that one (`--load` into its checkpoints) or `--overwrite` is given, which deletes the earlier run's files
first. Without this, a second run appends its steps to the first one's metrics.jsonl and saves its checkpoints
beside the first one's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from relax.config import ConfigError, RelaxConfig, flag
from relax.core.state import checkpoint

# What `relax train` writes into a run directory (README "What a run leaves behind").
RUN_FILES = ("config.yaml", "metrics.jsonl", "run.log")
RUN_FOLDERS = ("tensorboard", "plots", "samples", "checkpoints", "engine_weights", "weight_sync", "wandb")


def holds_a_run(directory: Path, save_dir: Path) -> bool:
    return (directory / "metrics.jsonl").is_file() or (save_dir / checkpoint.LATEST_FILE).is_file()


def resumes_in_place(cfg: RelaxConfig) -> bool:
    """Whether ``--load`` continues the run whose checkpoints this run saves to (also one that ended before its
    first checkpoint: `loads_a_run_without_checkpoints`)."""
    if not cfg.load:
        return False
    try:
        loaded = checkpoint.resolve_checkpoint_root(cfg.load)
    except checkpoint.CheckpointError:
        return loads_a_run_without_checkpoints(cfg)
    return loaded.resolve() == cfg.save_dir.resolve()


def loads_a_run_without_checkpoints(cfg: RelaxConfig) -> bool:
    """``--load`` names this run's own directory (``--output-dir`` or its ``--save``), which holds no checkpoint yet:
    the run ended before its first save. Resuming it starts it again from its first step, in place: its run.log
    (with the error that ended it) is kept, what it recorded after step 0 is dropped."""
    if not cfg.load:
        return False
    target = Path(cfg.load).resolve()
    if target not in {Path(cfg.output_dir).resolve(), cfg.save_dir.resolve()}:
        return False
    try:
        checkpoint.resolve_checkpoint_root(cfg.load)
    except checkpoint.CheckpointError:
        return True
    return False


def prepare_run_dir(cfg: RelaxConfig) -> bool:
    """Check (and with --overwrite, clear) ``--output-dir`` before a run writes into it; returns whether this
    created the directory (so a start-up failure can take it away again)."""
    directory = Path(cfg.output_dir)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{flag('output_dir')} {directory}: exists and is not a directory")
    if holds_a_run(directory, cfg.save_dir) and not resumes_in_place(cfg):
        if not cfg.overwrite:
            raise ConfigError(
                f"{flag('output_dir')} {directory} already holds a run (metrics.jsonl or checkpoints); resume it with "
                f"{flag('load')} {directory}, start afresh there with {flag('overwrite')} (deletes that run's files), "
                f"or choose another {flag('output_dir')}")
        clear_run_files(directory, cfg.save_dir)
    created = not directory.exists()
    _make_folder(directory, "output_dir")
    # The folders elsewhere that the run writes into, made now: a place nobody can write to fails before the first
    # step, naming its flag, not at the first save, timeline event or weight push (with a traceback).
    elsewhere = [(cfg.save_dir, "save")] if cfg.save else []
    elsewhere += [(Path(getattr(cfg, name)), name) for name in ("timeline_dump_dir", "rollout_weights_dir")
                  if getattr(cfg, name)]
    for folder, name in elsewhere:
        try:
            _make_folder(folder, name)
        except ConfigError:
            if created:
                directory.rmdir()
            raise
    return created


def _make_folder(directory: Path, name: str) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"{flag(name)} {directory}: cannot make the folder ({error.strerror or error})") from None


def clear_run_files(directory: Path, save_dir: Path) -> None:
    """Delete what a run wrote (nothing else: the directory may hold the user's own files)."""
    for name in RUN_FILES:
        (directory / name).unlink(missing_ok=True)
    for name in RUN_FOLDERS:
        shutil.rmtree(directory / name, ignore_errors=True)
    if save_dir.is_dir():  # a --save elsewhere: only the checkpoints in it
        for path in [*save_dir.glob("iter_*"), save_dir / checkpoint.HF_DIR,
                     save_dir / (checkpoint.HF_DIR + checkpoint.PARTIAL_SUFFIX)]:
            shutil.rmtree(path, ignore_errors=True)
        (save_dir / checkpoint.LATEST_FILE).unlink(missing_ok=True)


def remove_if_unused(directory: Path, created: bool) -> None:
    """After a failed start: take away a directory this start created, if it holds only what the start wrote."""
    if not created or not directory.is_dir():
        return
    if {p.name for p in directory.iterdir()} <= {"config.yaml", "run.log"}:
        shutil.rmtree(directory, ignore_errors=True)
