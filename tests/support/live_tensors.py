"""What holds the largest tensors still alive: for the GPU tests, which share one process and one device, a test
that leaves memory allocated is reported with the chains of objects that keep its largest tensors (`tests/conftest.py`).
On an H200 `-m gpu` run, tests of the multimodal smoke path and several model families each left 7-55 GiB allocated
after collection, and a later memory plan counted it as resident."""

from __future__ import annotations

import gc
import inspect
from collections.abc import Callable

import torch


def _describe(holder: object) -> str:
    if isinstance(holder, dict):
        keys = [str(key) for key in list(holder)[:4]]
        return f"dict(keys {', '.join(keys)}{', ...' if len(holder) > 4 else ''})"
    if isinstance(holder, list | tuple):
        return f"{type(holder).__name__} of {len(holder)}"
    if inspect.isfunction(holder) or inspect.ismethod(holder):
        return f"{type(holder).__name__} {getattr(holder, '__qualname__', '?')}"
    return type(holder).__qualname__


def holder_chain(obj: object, depth: int = 5, skip: tuple = ()) -> list[str]:
    """The first referrer of ``obj``, then that one's, ``depth`` deep (frames and the ``skip`` objects left out)."""
    chain, seen = [], {id(obj)}
    for _ in range(depth):
        # no list of referrers is kept from one step to the next: it would be the next object's first referrer
        holder = next((r for r in gc.get_referrers(obj)
                       if id(r) not in seen and not inspect.isframe(r) and not any(r is s for s in skip)), None)
        if holder is None:
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
