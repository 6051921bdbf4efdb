"""Ctrl-C during a command's start-up, before the training loop's own handler exists.

Python turns SIGINT into a KeyboardInterrupt wherever the main thread happens to be, and during start-up that is
often inside a library's import or loader, which may wrap it in another error (transformers' lazy modules answer
"Could not import module ...") or lose it. So `relax` records the signal as well as raising it (`install`): a
command that ends on an error whose chain holds the interrupt, or that reaches the training loop after an
interrupt was received, ends as interrupted (exit 130) instead of printing a traceback or training on.

Some imports must not be interrupted at all: a KeyboardInterrupt raised while torch's native modules initialise
can abort the interpreter (SIGABRT, a fatal-error dump; seen once in the suite when Ctrl-C landed inside
``import torch``). The command's imports therefore run `deferred`: a SIGINT is recorded and acted on as soon as they
end (a second or two later).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_received: list[int] = []


def install() -> None:
    """Record SIGINT and raise KeyboardInterrupt, as Python's default handler does (main thread only, and only
    where that default is in place: an ignored SIGINT stays ignored)."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _record_and_interrupt)


def _record_and_interrupt(signal_number, frame) -> None:
    _received.append(signal_number)
    raise KeyboardInterrupt


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Inside, a SIGINT is only recorded; on leaving, a recorded one raises KeyboardInterrupt (module doc). Only
    where `install`'s handler is in place (main thread): elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not _record_and_interrupt:
        yield
        return
    signal.signal(signal.SIGINT, _record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, _record_and_interrupt)
    raise_if_received()


def _record(signal_number, frame) -> None:
    _received.append(signal_number)


def received() -> bool:
    """Whether a SIGINT came since `install`."""
    return bool(_received)


def raise_if_received() -> None:
    """Raise KeyboardInterrupt if a SIGINT came (one a library swallowed): before work that would ignore it."""
    if _received:
        raise KeyboardInterrupt


def caused_by_interrupt(error: BaseException) -> bool:
    """Whether ``error`` or an error in its chain (cause or context) is a KeyboardInterrupt."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, KeyboardInterrupt):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False
