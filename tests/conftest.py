import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_assets import build_tiny_model_dir, write_addition_data

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_workspace(tmp_path_factory) -> Path:
    """A tiny model folder plus train/test addition data."""
    root = tmp_path_factory.mktemp("tiny")
    build_tiny_model_dir(root / "model")
    write_addition_data(root / "train.jsonl", 64, seed=0)
    write_addition_data(root / "test.jsonl", 16, seed=1)
    return root


def tiny_train_args(workspace: Path, output_dir: Path, *extra: str) -> list[str]:
    return [
        "--hf-checkpoint", str(workspace / "model"), "--prompt-data", str(workspace / "train.jsonl"),
        "--eval-prompt-data", "held_out", str(workspace / "test.jsonl"),
        "--custom-rm-path", "tests.e2e_rewards:digit_fraction",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4",
        "--micro-batch-size", "4", "--lr", "1e-3", "--rollout-shuffle", "--output-dir", str(output_dir),
        *extra,
    ]


def run_relax(*args: str, timeout: float = 300, env: dict[str, str] | None = None,
              **popen_kwargs) -> subprocess.CompletedProcess:
    """`relax ...` in a subprocess from the repository root (so `tests.*` reward paths import); ``env`` adds
    variables to this process's environment."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "relax.cli.main", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, **popen_kwargs)


def pytest_collection_modifyitems(config, items):
    """`vllm` tests start real vLLM servers (minutes on a 2-core CPU, and a 3.5 GB venv): the default suite skips
    them; `RELAX_RUN_VLLM=1 bash scripts/test.sh tests/test_vllm_cpu.py` runs them (docs/engines.md)."""
    from relax.backends.inference.vllm_server import vllm_available, vllm_python

    if os.environ.get("RELAX_RUN_VLLM") != "1":
        skip = pytest.mark.skip(reason="real-vLLM test: set RELAX_RUN_VLLM=1 to run it")
    elif not vllm_available():
        skip = pytest.mark.skip(reason=f"no vLLM at {vllm_python()}: run `bash scripts/setup_vllm_cpu.sh`")
    else:
        return
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)
