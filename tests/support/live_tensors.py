"""What holds the largest tensors still alive: for the GPU tests, which share one process and one device, a test
that leaves memory allocated is reported with the chains of objects that keep its largest tensors (`tests/conftest.py`).
On an H200 `-m gpu` run, tests of the multimodal smoke path and several model families each left 7-55 GiB allocated
after collection, and a later memory plan counted it as resident."""

from __future__ import annotations

import gc
import inspect
import sys
import threading
from collections.abc import Callable

import torch


def _thread_of(frame) -> str | None:
    """The name of the thread whose stack holds ``frame`` (a running frame is kept by its thread, not by an object)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    for ident, top in sys._current_frames().items():
        while top is not None:
            if top is frame:
                return names.get(ident, str(ident))
            top = top.f_back
    return None


def _running_frame_local(obj: object, own_stack: set[int]) -> list[str]:
    """Where a thread's running frame holds ``obj`` in a local: ``["local NAME of frame ..."]``, or nothing."""
    for top in sys._current_frames().values():
        frame = top
        while frame is not None:
            if id(frame) not in own_stack:
                name = next((key for key, value in frame.f_locals.items() if value is obj), None)
                if name is not None:
                    return [f"local {name} of {_describe(frame)}"]
            frame = frame.f_back
    return []


def _describe(holder: object) -> str:
    if isinstance(holder, dict):
        keys = [str(key) for key in list(holder)[:4]]
        return f"dict(keys {', '.join(keys)}{', ...' if len(holder) > 4 else ''})"
    if isinstance(holder, list | tuple):
        return f"{type(holder).__name__} of {len(holder)}"
    if inspect.isfunction(holder) or inspect.ismethod(holder):
        return f"{type(holder).__name__} {getattr(holder, '__qualname__', '?')}"
    if inspect.isframe(holder):
        thread = _thread_of(holder)
        return (f"frame {holder.f_code.co_qualname} ({holder.f_code.co_filename}:{holder.f_lineno})"
                + (f" running on thread {thread}" if thread else ""))
    if inspect.isgenerator(holder) or inspect.iscoroutine(holder) or inspect.isasyncgen(holder):
        return f"{type(holder).__name__} {holder.__qualname__}"
    return type(holder).__qualname__


def holder_chain(obj: object, depth: int = 5, skip: tuple = ()) -> list[str]:
    """The first referrer of ``obj``, then that one's, ``depth`` deep (the frames of this call's own stack and the
    ``skip`` objects left out). A frame off that stack (a suspended generator's, a stored traceback's, another
    thread's) is named with its function, line and thread, and the chain goes on from it."""
    own_stack, frame = set(), inspect.currentframe()
    while frame is not None:
        own_stack.add(id(frame))
        frame = frame.f_back
    chain, seen = [], {id(obj)}
    for _ in range(depth):
        # no list of referrers is kept from one step to the next: it would be the next object's first referrer
        holder = next((r for r in gc.get_referrers(obj)
                       if id(r) not in seen and id(r) not in own_stack and not any(r is s for s in skip)), None)
        if holder is None:  # a running frame's locals have no referrer object: look through the threads' stacks
            chain.extend(_running_frame_local(obj, own_stack))
            break
        obj = holder
        seen.add(id(obj))
        chain.append(_describe(obj))
    return chain


def _storage_bytes(tensor: torch.Tensor) -> int | None:
    """The bytes of a real tensor's storage; None for one without real storage (the fake tensors with symbolic
    sizes that `torch.compile` keeps in its caches: comparing their sizes evaluates guards, which failed)."""
    try:
        size = tensor.untyped_storage().nbytes()
    except Exception:  # noqa: BLE001 - a tensor subclass without a storage
        return None
    return size if type(size) is int else None


def live_tensor_report(keep: Callable[[torch.Tensor], bool], limit: int = 3) -> list[str]:
    """The ``limit`` largest live tensors that ``keep`` selects (by their storage's bytes), each with what holds
    it."""
    gc.collect()
    # (type(), not isinstance: isinstance reads `__class__`, which some proxies of torch answer with a warning)
    candidates = [(size, o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and keep(o)
                  if (size := _storage_bytes(o)) is not None]
    largest = [tensor for _, tensor in sorted(candidates, key=lambda pair: -pair[0])[:limit]]
    del candidates
    lines = []
    while largest:  # popped, so that this list is no holder of the tensor asked about
        tensor = largest.pop(0)
        chain = holder_chain(tensor, depth=10, skip=(largest,))
        lines.append(f"{tuple(tensor.shape)} {tensor.dtype} {tensor.untyped_storage().nbytes() / 2**30:.2f} GiB "
                     f"<- {' <- '.join(chain) or '(no referrer found)'}")
    return lines
