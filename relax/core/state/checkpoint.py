"""Checkpoints: one folder per saved step, written so that a kill, a full disk or flipped bytes never cost more
than the checkpoint being written.

Layout of ``<save>/``::

    latest_checkpointed_iteration.txt   step number of the newest complete checkpoint
    hf/                                  model config and tokenizer (for export and eval)
    iter_0000004/model_optim/            torch distributed checkpoint (DCP) of model + optimizer
    iter_0000004/lr_scheduler.pt
    iter_0000004/trainer_state.json      step, weight version, data position
    iter_0000004/rng_state.pt            Python, NumPy and torch RNG states
    iter_0000004/manifest.json           size and CRC-32 of every file above

A save writes ``iter_0000004.partial/``, records the manifest, fsyncs the files and the directory, renames it to
``iter_0000004`` and only then moves ``latest_checkpointed_iteration.txt``: whatever stops a save midway leaves
the previous checkpoint as the newest complete one. A load verifies the manifest first and falls back to the
newest older checkpoint that verifies, naming the damaged file (`select_checkpoint`). ``--max-checkpoints`` keeps
the newest K.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from relax.backends.models.family import load_model, model_from_config
from relax.backends.training import lora
from relax.utils.durable import fsync_path

# DCP's CheckpointException derives from BaseException: catch it beside the ordinary errors of a read or write.
IO_ERRORS = (Exception, CheckpointException)

LATEST_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_FORMAT = 1
PARTIAL_SUFFIX = ".partial"
HF_DIR = "hf"
_READ_CHUNK = 8 << 20
LOW_DISK_BYTES = 64 << 20  # below this a failed write is reported as a full disk (torch's writer hides the errno)

logger = logging.getLogger("relax")


class CheckpointError(RuntimeError):
    pass


def iteration_dir(root: Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def staging_dir(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before it is complete."""
    return Path(root) / f"iter_{step:07d}{PARTIAL_SUFFIX}"


def saved_steps(root: Path) -> list[int]:
    """Steps with a complete (renamed) checkpoint folder, oldest first."""
    steps = []
    for path in Path(root).glob("iter_*"):
        digits = path.name.removeprefix("iter_")
        if path.is_dir() and digits.isdigit():
            steps.append(int(digits))
    return sorted(steps)


# ---- writing -------------------------------------------------------------------------------------------------
def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _crc32_all(paths: list[Path]) -> list[int]:
    """CRC-32 of each file, in parallel threads (zlib releases the GIL)."""
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(paths)))) as pool:
        return list(pool.map(_crc32, paths))


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_manifest(directory: Path) -> dict[str, Any]:
    """Size and CRC-32 of every file under ``directory``, each file fsynced, the manifest written last."""
    files = _files(directory)
    crcs = _crc32_all(files)
    for path in files:
        fsync_path(path)
    manifest = {"format": CHECKPOINT_FORMAT, "files": {str(path.relative_to(directory)): {"size": path.stat().st_size, "crc32": crc}
                                       for path, crc in zip(files, crcs)}}
    _write_atomically(directory / MANIFEST_FILE, json.dumps(manifest, indent=1))
    for sub in sorted({path.parent for path in files} | {directory}):
        fsync_path(sub)
    return manifest


def begin_save(root: Path, step: int) -> Path:
    """A clean staging folder for ``step`` (a save that was killed before may have left one)."""
    staging = staging_dir(root, step)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def finish_save(root: Path, step: int, max_checkpoints: int | None = None) -> Path:
    """Seal the staged checkpoint of ``step``: manifest, fsync, rename, point ``latest`` at it, rotate."""
    root = Path(root)
    staging, final = staging_dir(root, step), iteration_dir(root, step)
    write_manifest(staging)
    replaced = None
    if final.exists():  # the same step saved again (after a fall-back to an older checkpoint): swap it out
        replaced = final.with_name(final.name + ".replaced")
        if replaced.exists():
            shutil.rmtree(replaced)
        os.replace(final, replaced)
    os.replace(staging, final)
    fsync_path(root)
    mark_latest(root, step)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    if max_checkpoints is not None:
        rotate(root, keep=max_checkpoints)
    return final


def abandon_save(root: Path, step: int) -> None:
    shutil.rmtree(staging_dir(root, step), ignore_errors=True)


def rotate(root: Path, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` complete checkpoints (never the one ``latest`` names); the removed steps."""
    root = Path(root)
    newest = read_latest_step(root)
    removed = []
    for step in saved_steps(root)[:-keep]:
        if step != newest:
            shutil.rmtree(iteration_dir(root, step), ignore_errors=True)
            removed.append(step)
    return removed


def describe_write_error(err: BaseException, directory: Path) -> str:
    """The cause first, in one line: an OSError anywhere in the chain (DCP wraps them, per rank) with the file it
    was writing; else a device with no room left; else the innermost error's first line."""
    seen, stack, innermost = set(), [err], err
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            reason = "no space left on device" if current.errno == errno.ENOSPC else \
                (current.strerror or os.strerror(current.errno)).lower()
            return f"{reason}, writing {current.filename or directory}"
        if not isinstance(current, CheckpointException):
            innermost = current
        stack.extend([current.__cause__, current.__context__])
        failures = getattr(current, "failures", None)  # CheckpointException: rank -> (exception, traceback)
        if isinstance(failures, dict):
            stack.extend(v[0] if isinstance(v, tuple) else v for v in failures.values())
    free = _free_bytes(directory)
    if free is not None and free < LOW_DISK_BYTES:
        return f"no space left on device ({free >> 20} MiB free), writing {directory}"
    first_line = (str(innermost).strip().splitlines() or [""])[0]
    return f"{type(innermost).__name__}: {first_line}, writing {directory}"


def _free_bytes(directory: Path) -> int | None:
    for path in (Path(directory), *Path(directory).parents):
        if path.exists():
            stats = os.statvfs(path)
            return stats.f_bavail * stats.f_frsize
    return None


def resolve_checkpoint_root(path: str | Path) -> Path:
    """Accept a checkpoint directory or a run directory that holds ``checkpoints/``."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such folder")
    for candidate in (path, path / "checkpoints"):
        if candidate.is_dir() and ((candidate / LATEST_FILE).is_file() or saved_steps(candidate)):
            return candidate
    raise CheckpointError(f"{path}: no checkpoint found (expected {LATEST_FILE} or iter_* folders in it or in its "
                          "checkpoints/)")


def read_latest_step(root: Path) -> int | None:
    """The step ``latest_checkpointed_iteration.txt`` names, or None when it is missing or unreadable."""
    try:
        return int((Path(root) / LATEST_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def mark_latest(root: Path, step: int) -> None:
    """Atomically point ``latest_checkpointed_iteration.txt`` at ``step`` (after it is complete)."""
    _write_atomically(Path(root) / LATEST_FILE, str(step))


# ---- reading -------------------------------------------------------------------------------------------------
def verify(directory: Path) -> str | None:
    """What is wrong with the checkpoint in ``directory`` (a file named), or None when every file matches its
    manifest. A checkpoint from before manifests (none in it) is taken as it is."""
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        state_path = directory / "trainer_state.json"
        try:  # a checkpoint from before manifests still has a readable trainer state: anything else is damage
            state = json.loads(state_path.read_text())
        except (OSError, ValueError):
            return f"{manifest_path}: missing, and {state_path} is unreadable"
        if not isinstance(state, dict) or state.get("checkpoint_format") is not None:
            return f"{manifest_path}: missing"
        if not (directory / "model_optim").is_dir():
            return f"{directory}: no model_optim/ in it"
        logger.warning("%s was written before checkpoints had manifests: not verified", directory)
        return None
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{manifest_path}: unreadable ({err})"
    for relative, expected in files.items():
        path = directory / relative
        if not path.is_file():
            return f"{path}: missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{path}: {size} bytes, the manifest says {expected['size']}"
    for (relative, expected), crc in zip(files.items(), _crc32_all([directory / r for r in files])):
        if crc != expected["crc32"]:
            return f"{directory / relative}: contents changed since it was saved (CRC-32 mismatch)"
    return None


@dataclass
class Selected:
    step: int
    directory: Path
    skipped: list[str] = field(default_factory=list)  # why each newer checkpoint was passed over


def select_checkpoint(root: Path, step: int | None = None, needs_optimizer: bool = False) -> Selected:
    """The newest complete checkpoint that verifies (or exactly ``step``), newest first from the complete folders,
    so a damaged newest one falls back to the one before it; raises naming every problem when none is usable."""
    root = Path(root)
    if step is not None:
        candidates = [step]
    else:
        candidates = sorted(set(saved_steps(root)) | {s for s in [read_latest_step(root)] if s is not None},
                            reverse=True)
    skipped: list[str] = []
    for candidate in candidates:
        directory = iteration_dir(root, candidate)
        if not directory.is_dir():
            skipped.append(f"{directory}: missing")
            continue
        problem = verify(directory)
        if problem is None and needs_optimizer and not (directory / "lr_scheduler.pt").is_file():
            problem = f"{directory}: holds no optimizer state (saved with --no-save-optim)"
        if problem is None:
            return Selected(candidate, directory, skipped)
        skipped.append(problem)
    saved = saved_steps(root)
    if step is not None and step not in saved:
        raise CheckpointError(f"{root}: no checkpoint of step {step} (saved steps: {saved or 'none'})")
    raise CheckpointError(f"{root}: no usable checkpoint: " + "; ".join(skipped or ["none saved"]))


# A vision-language or omni model's processor files: `AutoProcessor.from_pretrained` of an export needs them.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "chat_template.json", "chat_template.jinja")


def save_hf_metadata(root: Path, hf_config: Any, tokenizer: Any, model_dir: str | Path | None = None) -> None:
    """Model config, tokenizer and the processor files of ``model_dir`` (the base model folder), so export needs
    nothing else: written once, and again whenever what is there is not whole (a save killed while writing it),
    through a staging folder renamed into place."""
    target = Path(root) / HF_DIR
    if hf_metadata_problem(target) is None:
        return
    staging = target.with_name(HF_DIR + PARTIAL_SUFFIX)
    shutil.rmtree(staging, ignore_errors=True)
    hf_config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    for name in PROCESSOR_FILES if model_dir is not None else ():
        if (Path(model_dir) / name).is_file() and not (staging / name).exists():
            shutil.copyfile(Path(model_dir) / name, staging / name)
    for path in staging.iterdir():
        fsync_path(path)
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    fsync_path(Path(root))


def hf_metadata_problem(target: Path) -> str | None:
    config = target / "config.json"
    try:
        json.loads(config.read_text())
    except FileNotFoundError:
        return f"{config}: missing"
    except (OSError, ValueError) as err:
        return f"{config}: not valid JSON ({err}); a save was interrupted while writing it"
    return None


def save_trainer_state(directory: Path, state: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    state = {**state, "checkpoint_format": CHECKPOINT_FORMAT}  # so a missing manifest reads as damage
    (directory / "trainer_state.json").write_text(json.dumps(state, indent=2))
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        directory / "rng_state.pt",
    )


def load_trainer_state(directory: Path) -> dict[str, Any]:
    state_path, rng_path = directory / "trainer_state.json", directory / "rng_state.pt"
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{state_path}: cannot be read ({type(err).__name__}: {err})") from None
    try:
        rng = torch.load(rng_path, weights_only=False)
    except Exception as err:  # noqa: BLE001 - torch.load raises anything from EOFError to UnpicklingError
        raise CheckpointError(f"{rng_path}: cannot be read ({type(err).__name__}: {err})") from None
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return state


def load_hf_model_from_checkpoint(root: str | Path, step: int | None = None, dtype: torch.dtype = torch.float32,
                                  merge_adapters: bool = True):
    """A plain (unsharded) Hugging Face model with the weights of checkpoint ``step`` (default:
    the newest intact one). Needs no process group; used by `relax export` and `relax eval`. A LoRA run's
    checkpoint (adapters only) is loaded onto its base model, the adapters merged unless ``merge_adapters`` is
    False (then the model carries them, for `lora.save_adapter_folder`)."""
    from transformers import AutoConfig

    root = resolve_checkpoint_root(root)
    try:
        adapters = lora.read_metadata(root)
    except lora.BaseModelChangedError as error:
        raise CheckpointError(str(error)) from None
    selected = select_checkpoint(root, step)
    for problem in selected.skipped:
        logger.warning("skipping a damaged checkpoint: %s", problem)
    problem = hf_metadata_problem(root / HF_DIR)
    if problem:
        raise CheckpointError(f"{problem}; the next save of this run (relax train --load {root}) writes it again")
    if adapters is not None:
        settings, base = adapters
        model = load_model(base, torch.float32)
        lora.inject(model, settings)
        state = {f"hf_model.{name}": t for name, t in model.state_dict().items() if lora.is_adapter(name)}
    else:
        model = model_from_config(AutoConfig.from_pretrained(root / HF_DIR), torch.float32)
        state = {f"hf_model.{name}": tensor for name, tensor in model.state_dict().items()}
    checkpoint_dir = selected.directory / "model_optim"
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process reading is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, checkpoint_id=checkpoint_dir)
    except IO_ERRORS as err:  # DCP wraps every read failure in its own exceptions
        raise CheckpointError(f"{checkpoint_dir}: cannot be loaded ({type(err).__name__}: {err})") from None
    model.load_state_dict({name.removeprefix("hf_model."): t for name, t in state.items()}, strict=adapters is None)
    if adapters is not None and merge_adapters:
        lora.merge_into_base(model)
    return model.to(dtype), root / HF_DIR
