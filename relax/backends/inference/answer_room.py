"""The token slots a prompt and its answer share on a run's own engine: the model's positions, or the embedded
engine's KV pool where ``--max-total-tokens`` makes it the smaller.

The engine ends a sequence with "length" at either bound (SGLang caps max_new_tokens at its pool alike) and refuses
a prompt that leaves no room for one answer token, so the rollout's parts ask first: the dataset drops such prompts
at load (counted), the multi-turn loop and the agent gateway cap an episode's context there. A prompt that passed
the positions but not a small pool had reached the engine mid-run, which refused it and ended the run.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from relax.backends.inference.engine_core.decoder import unsupported_reason
from relax.backends.models.family import cached_config, model_from_config, model_positions
from relax.backends.models.registry import traits
from relax.data.dataset import AnswerRoom


def answer_room(args: Any) -> AnswerRoom | None:
    """The room of the run ``args`` (a `RelaxConfig`, or any object with its fields: a custom generate function's
    ``args``); None where neither bound is known."""
    return _answer_room(getattr(args, "hf_checkpoint", None), pool_tokens(args))


def pool_tokens(args: Any) -> int | None:
    """The most tokens one sequence can hold in the KV pool ``--max-total-tokens`` asks of this process's paged
    engine (whole pages of ``--page-size``, as the engine builds it); None where the pool is sized from the device's
    free memory, or the engine is another's (``--rollout-external``) or the model-cache runner (which has no pool)."""
    tokens = getattr(args, "max_total_tokens", None)
    if not tokens or getattr(args, "rollout_external", False) or getattr(args, "engine_core", "auto") == "off":
        return None
    if not _paged(getattr(args, "hf_checkpoint", None)):
        return None
    page = getattr(args, "page_size", 16)
    return tokens // page * page


@functools.lru_cache(maxsize=16)
def _paged(model_path: str | None) -> bool:
    """Whether the engine runs the folder's model on the paged runner: the engine's own test, on the model built on
    the meta device (no memory, no weights read)."""
    config = cached_config(model_path)
    if config is None or not traits(config).engine_core:
        return False
    with torch.device("meta"):  # (on a copy: building a model writes into its config)
        return unsupported_reason(model_from_config(copy.deepcopy(config), torch.bfloat16)) is None


@functools.lru_cache(maxsize=16)
def _answer_room(model_path: str | None, pool: int | None) -> AnswerRoom | None:
    rooms = []
    positions = model_positions(model_path)
    if positions is not None:
        rooms.append(AnswerRoom.of_positions(positions))
    if pool is not None:
        rooms.append(AnswerRoom(pool, f"the engine's KV pool of {pool} token slots (--max-total-tokens)"))
    return min(rooms, key=lambda room: room.tokens, default=None)
