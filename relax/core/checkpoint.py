"""Checkpoints: one folder per saved step, written so that a crash never leaves a half checkpoint
marked as the newest.

Layout of ``<save>/``::

    latest_checkpointed_iteration.txt   step number of the newest complete checkpoint
    hf/                                  model config and tokenizer (for export and eval)
    iter_0000004/model_optim/            torch distributed checkpoint (DCP) of model + optimizer
    iter_0000004/lr_scheduler.pt
    iter_0000004/trainer_state.json      step, weight version, data position
    iter_0000004/rng_state.pt            Python, NumPy and torch RNG states
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

LATEST_FILE = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    pass


def iteration_dir(root: Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def resolve_checkpoint_root(path: str | Path) -> Path:
    """Accept a checkpoint directory or a run directory that holds ``checkpoints/``."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        if (candidate / LATEST_FILE).is_file():
            return candidate
    raise CheckpointError(f"{path}: no checkpoint found (expected {LATEST_FILE} in it or in its checkpoints/)")


def latest_step(root: Path) -> int:
    return int((Path(root) / LATEST_FILE).read_text().strip())


def save_hf_metadata(root: Path, hf_config: Any, tokenizer: Any) -> None:
    """Model config and tokenizer, once per checkpoint directory, so export needs nothing else."""
    target = Path(root) / "hf"
    if not (target / "config.json").is_file():
        hf_config.save_pretrained(target)
        tokenizer.save_pretrained(target)


def save_trainer_state(directory: Path, state: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "trainer_state.json").write_text(json.dumps(state, indent=2))
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        directory / "rng_state.pt",
    )


def mark_latest(root: Path, step: int) -> None:
    """Atomically point ``latest_checkpointed_iteration.txt`` at ``step`` (after it is complete)."""
    tmp = Path(root) / (LATEST_FILE + ".tmp")
    tmp.write_text(str(step))
    os.replace(tmp, Path(root) / LATEST_FILE)


def load_trainer_state(directory: Path) -> dict[str, Any]:
    state = json.loads((directory / "trainer_state.json").read_text())
    rng = torch.load(directory / "rng_state.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return state


def load_hf_model_from_checkpoint(root: str | Path, step: int | None = None, dtype: torch.dtype = torch.float32):
    """A plain (unsharded) Hugging Face model with the weights of checkpoint ``step`` (default:
    the newest). Needs no process group; used by `relax export` and `relax eval`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = resolve_checkpoint_root(root)
    step = latest_step(root) if step is None else step
    if not (iteration_dir(root, step) / "model_optim").is_dir():
        saved = sorted(int(p.name.removeprefix("iter_")) for p in root.glob("iter_*") if p.name[5:].isdigit())
        raise CheckpointError(f"{root}: no checkpoint of step {step} (saved steps: {saved or 'none'})")
    config = AutoConfig.from_pretrained(root / "hf")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {f"hf_model.{name}": tensor for name, tensor in model.state_dict().items()}
    dcp.load({"model": state}, checkpoint_id=iteration_dir(root, step) / "model_optim")
    model.load_state_dict({name.removeprefix("hf_model."): t for name, t in state.items()})
    return model.to(dtype), root / "hf"
