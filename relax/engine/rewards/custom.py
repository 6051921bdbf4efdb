"""Load a user's reward function from ``--custom-rm-path``.

The function is imported when the run is configured, not at the first rollout, so a typo in
the path fails in seconds with the path and the reason instead of after the engines start.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def _split_dotted_path(path: str, flag: str = "--custom-rm-path") -> tuple[str, str]:
    """``"pkg.module:fn"`` or ``"pkg.module.fn"`` -> ``("pkg.module", "fn")``."""
    module_name, separator, attribute = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not separator or not module_name or not attribute:
        raise ValueError(f"{flag} {path!r}: expected 'package.module:function' or 'package.module.function'")
    return module_name, attribute


def load_custom_reward(path: str) -> Callable[..., Any]:
    """Import the reward function named by ``path`` (``pkg.module:fn`` or ``pkg.module.fn``).

    The function is called as ``fn(args, sample)`` (or ``fn(args, samples)`` with ``--group-rm``)
    and may be ``async def``. Raises ImportError or TypeError naming ``path`` and the reason.
    """
    return load_dotted_function(path, "--custom-rm-path")


def load_dotted_function(path: str, flag: str) -> Callable[..., Any]:
    """Import the function named by ``path`` (``pkg.module:fn`` or ``pkg.module.fn``) for the
    option ``flag``; errors name the flag, the path and the reason."""
    module_name, attribute = _split_dotted_path(path, flag)
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
        raise TypeError(f"{flag} {path!r}: {attribute!r} is a {type(function).__name__}, not a function")
    return function
