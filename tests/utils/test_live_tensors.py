"""The GPU tests' leak report (`tests/support/live_tensors.py`, used by `tests/conftest.py`): it names the largest
live tensors the predicate selects and the objects that hold them, here on CPU tensors."""

from __future__ import annotations

import threading

import torch

from tests.support.live_tensors import live_tensor_report


class _Engine:
    def __init__(self) -> None:
        self.pool = torch.zeros(1024, 257)


def test_the_report_names_the_largest_tensors_and_what_holds_them():
    registry = {"engines": [_Engine()]}  # a leak: a module-level registry keeps an engine and its pool
    marker = torch.zeros(1024, 255)
    small = torch.zeros(3, 257)
    lines = live_tensor_report(lambda t: t.shape[-1] in (255, 257) and t.numel() > 0, limit=2)
    assert len(lines) == 2
    # (the pool is held by the instance, or by its attribute dict where Python keeps one)
    assert lines[0].startswith("(1024, 257) torch.float32 0.00 GiB <- ") and "_Engine <- list of 1 <- " \
        "dict(keys engines)" in lines[0], lines[0]
    assert lines[1].startswith("(1024, 255)")  # held by this test's frame only: frames are left out
    assert all("(3, 257)" not in line for line in lines)  # the limit keeps the largest
    del registry, marker, small


def test_the_report_passes_over_fake_tensors_with_symbolic_sizes():
    """`torch.compile` keeps fake tensors whose sizes are symbols in its caches; comparing their storages' sizes
    evaluated shape guards, which raised inside the GPU tests' teardown. They are left out of the report."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    fakes = [mode.from_tensor(torch.zeros(n, 259), symbolic_context=context) for n in (36, 64)]
    real = torch.zeros(512, 259)
    lines = live_tensor_report(lambda t: t.shape[-1] == 259, limit=3)
    assert len(lines) == 1 and lines[0].startswith("(512, 259)"), lines
    del fakes, real


def test_a_frame_off_the_stack_is_named_with_its_function_and_thread():
    """A leak held by a suspended generator or by a local of a thread still running names them: the GPU smoke test's
    engine was held by a frame, which the report used to leave out, stopping short of the culprit."""

    def keeper():
        pool = torch.zeros(1024, 261)  # noqa: F841 - the suspended frame's local is the leak
        yield

    suspended = keeper()
    next(suspended)
    started, release = threading.Event(), threading.Event()

    def worker():
        pool = torch.zeros(2048, 261)  # noqa: F841 - the running frame's local is the leak
        started.set()
        release.wait(30)

    thread = threading.Thread(target=worker, name="leaky-worker")
    thread.start()
    try:
        assert started.wait(30)
        lines = live_tensor_report(lambda t: t.shape[-1] == 261, limit=2)
    finally:
        release.set()
        thread.join()
        suspended.close()
    assert "local pool of frame" in lines[0] and "worker" in lines[0] and "thread leaky-worker" in lines[0], lines
    assert "generator" in lines[1] and "keeper" in lines[1], lines
