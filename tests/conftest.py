"""Fixtures of the whole suite (the tiny workspace every training test starts from) and the collection rules.
Helpers that tests import live in `tests/support/`."""

import os
from pathlib import Path

import pytest

from relax.utils.heap import freeze_long_lived_objects
from tests.support.tiny_assets import build_tiny_model_dir, write_addition_data

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_ALLOCATED_BEFORE = pytest.StashKey[int]()


@pytest.fixture(scope="session")
def tiny_workspace(tmp_path_factory) -> Path:
    """A tiny model folder plus train/test addition data."""
    root = tmp_path_factory.mktemp("tiny")
    build_tiny_model_dir(root / "model")
    write_addition_data(root / "train.jsonl", 64, seed=0)
    write_addition_data(root / "test.jsonl", 16, seed=1)
    return root


def pytest_collection_modifyitems(config, items):
    """The `slow` tests run first: `--dist loadgroup` hands tests out in collection order (after the xdist groups,
    largest first), and a long test that starts last is the suite's tail while the other workers idle; the longest
    of them mostly wait on processes (restarts, heartbeats), which the short tests' CPU work then fills.

    `vllm` tests start real vLLM servers (minutes on a 2-core CPU, and a 3.5 GB venv): the default suite skips
    them; `RELAX_RUN_VLLM=1 bash scripts/test.sh tests/backends/inference/test_vllm_cpu.py` runs them (docs/engines.md)."""
    from relax.backends.inference.remote.launched_vllm import vllm_available, vllm_python

    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the file order otherwise

    if os.environ.get("RELAX_RUN_VLLM") != "1":
        skip = pytest.mark.skip(reason="real-vLLM test: set RELAX_RUN_VLLM=1 to run it")
    elif not vllm_available():
        skip = pytest.mark.skip(reason=f"no vLLM at {vllm_python()}: run `bash scripts/setup_vllm_cpu.sh`")
    else:
        return
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """The test modules' imports (torch, transformers, Relax) live as long as the worker: later collections skip
    them (`relax.utils.heap`)."""
    freeze_long_lived_objects()


def pytest_runtest_setup(item):
    """`--dist loadgroup` (scripts/test.sh) keeps the tests of one `xdist_group` on one worker by appending the
    group to their node ids. A pytest that ignores that (9.2 with pytest-xdist 3.8: node ids became structured)
    would silently run the in-process Ray tests side by side, so such a test fails, saying why. A GPU test's
    allocated bytes are noted before it runs (`pytest_runtest_teardown`)."""
    if getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group") is not None \
            and "@" not in item.nodeid:
        pytest.fail(f"--dist loadgroup ignored this test's xdist_group: pytest {pytest.__version__} and this "
                    "pytest-xdist do not work together (pyproject.toml's test extra pins them)", pytrace=False)
    if item.get_closest_marker("gpu") is not None:  # what the test leaves allocated is measured against this
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            item.stash[_ALLOCATED_BEFORE] = torch.cuda.memory_allocated()


LEAK_REPORT_BYTES = 2**30


def pytest_runtest_teardown(item):
    """After a GPU test, what it left in reference cycles (engines hold their KV pools, trainers their optimizer
    state) goes before the next one measures free memory: the `-m gpu` tests share one process and one device, and
    a later test's memory plan counted 132 GiB of an earlier test's tensors as resident. What is still allocated
    after that (over 1 GiB more than before the test) is reported as a warning naming what holds the largest
    tensors (`tests/support/live_tensors.py`)."""
    if item.get_closest_marker("gpu") is None:
        return
    import gc
    import warnings

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated() - item.stash.get(_ALLOCATED_BEFORE, 0)
        if left > LEAK_REPORT_BYTES:
            from tests.support.live_tensors import live_tensor_report

            report = "\n  ".join(live_tensor_report(lambda tensor: tensor.is_cuda))
            warnings.warn(f"{item.nodeid} left {left / 2**30:.1f} GiB allocated after collection:\n  {report}",
                          stacklevel=1)
