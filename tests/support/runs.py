"""The real `relax` command in a subprocess, on the tiny workspace of `tests/conftest.py` (``tiny_workspace``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
# A subprocess's limit: far above any run's expected time (a few minutes at most), so that a loaded machine (the
# suite beside other work, at many times the cores' load) slows a test down and never fails it; a hung run still ends.
SUBPROCESS_TIMEOUT_S = 1800


def tiny_train_args(workspace: Path, output_dir: Path, *extra: str) -> list[str]:
    """`relax train` arguments of a small GRPO run on the tiny model and its addition data."""
    return [
        "--hf-checkpoint", str(workspace / "model"), "--prompt-data", str(workspace / "train.jsonl"),
        "--eval-prompt-data", "held_out", str(workspace / "test.jsonl"),
        "--custom-rm-path", "tests.support.e2e_rewards:digit_fraction",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4",
        "--micro-batch-size", "4", "--lr", "1e-3", "--rollout-shuffle", "--output-dir", str(output_dir),
        *extra,
    ]


def run_relax(*args: str, timeout: float = SUBPROCESS_TIMEOUT_S, env: dict[str, str] | None = None,
              **popen_kwargs) -> subprocess.CompletedProcess:
    """`relax ...` in a subprocess from the repository root (so `tests.*` reward paths import); ``env`` adds
    variables to this process's environment."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "relax.cli.main", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, **popen_kwargs)
