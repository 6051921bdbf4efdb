"""Imported by every Python process started with this folder on its PYTHONPATH (tests/core/state/test_checkpoint_signals.py
puts it there for one `relax train`). With ``RELAX_TEST_SIGNAL_AT=<function>:<before|after>:<n>:<SIGNAL>`` the
process sends itself SIGNAL at the n-th call of ``relax.core.state.checkpoint.<function>``: a real signal at an exact
point of a checkpoint save, with no hook in Relax's own code. ``RELAX_TEST_SIGNAL_ONCE`` names a file that is
created when the signal is sent, so the run that a restart starts is left alone.

``RELAX_TEST_OOM_AT=<module>:<Class>.<method>:<n>`` (tests/backends/inference/test_embedded_recovery.py) makes the n-th call of that
method raise ``torch.OutOfMemoryError``, as the CUDA allocator does when a decode step cannot get memory.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import signal
import sys

_SPEC = os.environ.get("RELAX_TEST_SIGNAL_AT")
_MODULE = "relax.core.state.checkpoint"
_OOM_SPEC = os.environ.get("RELAX_TEST_OOM_AT")


def _armed(function: str, when: str, nth: int, signal_name: str):
    calls = 0
    once = os.environ["RELAX_TEST_SIGNAL_ONCE"]

    def fire() -> None:
        if os.path.exists(once):
            return
        with open(once, "w") as handle:
            handle.write(f"{function} {when} call {nth}: {signal_name} to pid {os.getpid()}\n")
        os.kill(os.getpid(), getattr(signal, signal_name))

    def wrap(original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            nonlocal calls
            calls += 1
            if when == "before" and calls == nth:
                fire()
            result = original(*args, **kwargs)
            if when == "after" and calls == nth:
                fire()
            return result

        return wrapper

    return wrap


def _raises_oom(nth: int):
    calls = 0

    def wrap(original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == nth:
                import torch

                raise torch.OutOfMemoryError(f"CUDA out of memory (injected at call {nth} of {original.__qualname__})")
            return original(*args, **kwargs)

        return wrapper

    return wrap


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Replaces ``attribute`` (a function, or ``Class.method``) of ``module`` by ``wrap(it)`` once it is imported."""

    def __init__(self, function: str, wrap, module: str = _MODULE) -> None:
        self.function, self.wrap, self.module = function, wrap, module

    def find_spec(self, name, path, target=None):
        if name != self.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute, function, wrap = spec.loader.exec_module, self.function, self.wrap

        def exec_module(module):
            execute(module)
            *owner_path, attribute = function.split(".")
            owner = module
            for part in owner_path:
                owner = getattr(owner, part)
            setattr(owner, attribute, wrap(getattr(owner, attribute)))

        spec.loader.exec_module = exec_module
        return spec


if _SPEC:
    _function, _when, _nth, _signal = _SPEC.split(":")
    sys.meta_path.insert(0, _PatchAfterImport(_function, _armed(_function, _when, int(_nth), _signal)))
if _OOM_SPEC:
    _module, _method, _nth = _OOM_SPEC.split(":")
    sys.meta_path.insert(0, _PatchAfterImport(_method, _raises_oom(int(_nth)), _module))
