"""Load a user's reward function from ``--custom-rm-path``.

The function is imported when the run is configured, not at the first rollout, so a typo in
the path fails in seconds with the path and the reason instead of after the engines start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relax.utils.dotted_path import load_dotted_function


def load_custom_reward(path: str) -> Callable[..., Any]:
    """Import the reward function named by ``path`` (``pkg.module:fn`` or ``pkg.module.fn``).

    The function is called as ``fn(args, sample)`` (or ``fn(args, samples)`` with ``--group-rm``)
    and may be ``async def``. Raises ImportError or ValueError naming ``path`` and the reason.
    """
    return load_dotted_function(path, "--custom-rm-path")
