"""A user's function named by a dotted path on the command line (``--custom-rm-path pkg.module:fn``, the other
``--custom-*-path`` flags, environments and tools), imported when the run is configured so that a typo fails in
seconds, naming the flag, the path and the reason."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("relax")


class NotAFunctionError(ImportError, TypeError):
    """The path names something that is not callable. An ImportError, as every other failure to get the function
    is (the callers that turn those into a refusal naming the flag catch ImportError and ValueError), and a
    TypeError, as it was first raised."""


def _split_dotted_path(path: str, flag: str) -> tuple[str, str]:
    """``"pkg.module:fn"`` or ``"pkg.module.fn"`` -> ``("pkg.module", "fn")``."""
    module_name, separator, attribute = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not separator or not module_name or not attribute:
        raise ValueError(f"{flag} {path!r}: expected 'package.module:function' or 'package.module.function'")
    return module_name, attribute


# Relax's own modules that a saved config may name (a built-in environment, filter, reward or generate function)
# and that moved since: the old name still loads (a config.yaml written by an earlier Relax re-runs), with a
# warning naming the new one. Longest prefix first.
MOVED_MODULES = {
    "relax.engine.rollout": "relax.rollout.generation",
    "relax.engine": "relax.rollout",
}


def current_module_name(module_name: str) -> str:
    """``module_name``, or where it lives now if it is one of Relax's moved modules (`MOVED_MODULES`)."""
    for old, new in MOVED_MODULES.items():
        if module_name == old or module_name.startswith(old + "."):
            moved = new + module_name[len(old):]
            logger.warning("%s is now %s (a setting written by an earlier Relax); loading it from there",
                           module_name, moved)
            return moved
    return module_name


def load_dotted_function(path: str, flag: str) -> Callable[..., Any]:
    """Import the function named by ``path`` (``pkg.module:fn`` or ``pkg.module.fn``) for the
    option ``flag``; errors name the flag, the path and the reason."""
    module_name, attribute = _split_dotted_path(path, flag)
    module_name = current_module_name(module_name)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        hint = " (is its directory on PYTHONPATH?)" if isinstance(err, ModuleNotFoundError) else ""
        raise ImportError(
            f"{flag} {path!r}: importing {module_name!r} failed: {type(err).__name__}: {err}{hint}"
        ) from err
    try:
        function = getattr(module, attribute)
    except AttributeError:
        raise ImportError(f"{flag} {path!r}: module {module_name!r} has no attribute {attribute!r}") from None
    if not callable(function):
        raise NotAFunctionError(f"{flag} {path!r}: {attribute!r} is a {type(function).__name__}, not a function")
    return function
