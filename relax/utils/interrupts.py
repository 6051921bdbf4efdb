"""Ctrl-C during a command's start-up, before the training loop's own handler exists.

Python turns SIGINT into a KeyboardInterrupt wherever the main thread happens to be, and during start-up that is
often inside a library's import or loader, which may wrap it in another error (transformers' lazy modules answer
"Could not import module ...") or lose it. So `relax` records the signal as well as raising it (`install`): a
command that ends on an error whose chain holds the interrupt, or that reaches the training loop after an
interrupt was received, ends as interrupted (exit 130) instead of printing a traceback or training on.
"""

from __future__ import annotations

import signal
import threading

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
