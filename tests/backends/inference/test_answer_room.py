"""The room a prompt and its answer share on a run's engine: the model's positions, or the embedded engine's KV pool
where --max-total-tokens makes it the smaller. A prompt that fit the positions but not a small pool reached the
engine mid-run, which refused it and ended the run; the rollout's parts now read the room from the settings, and
it must be the pool the engine really builds."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relax.backends.inference.answer_room import answer_room, pool_tokens
from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine
from relax.backends.models.family import load_model, read_tokenizer
from relax.config import RelaxConfig
from relax.core.run_settings import prompt_format
from relax.rollout.agentic.multi_turn import context_budget
from tests.support.tiny_assets import build_tiny_model_dir
from tests.support.tiny_families import TEXT_CONFIGS, build_text_family

POSITIONS = 256  # the tiny model's


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("room") / "model")


@pytest.fixture(scope="module")
def model_and_tokenizer(model_dir):
    return load_model(model_dir, torch.float32), read_tokenizer(model_dir)


def run_args(model_dir, **fields) -> types.SimpleNamespace:
    defaults = {"hf_checkpoint": str(model_dir), "max_total_tokens": None, "page_size": 16, "engine_core": "auto",
                "rollout_external": False, "rollout_max_context_len": None, "rollout_max_response_len": 8}
    return types.SimpleNamespace(**{**defaults, **fields})


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.integers(64, 600), page=st.integers(1, 256))
def test_the_pool_the_settings_name_is_the_pool_the_engine_builds(model_dir, model_and_tokenizer, tokens, page):
    if page > tokens:  # refused by the config (exit 2 naming both flags) and by the engine's settings
        with pytest.raises(ValueError, match=f"--max-total-tokens {tokens} holds no page of --page-size {page}"):
            CoreSettings(max_total_tokens=tokens, page_size=page)
        return
    engine = EmbeddedEngine(*model_and_tokenizer, core=CoreSettings(max_total_tokens=tokens, page_size=page))
    slots = engine.core.scheduler.max_sequence_tokens
    assert pool_tokens(run_args(model_dir, max_total_tokens=tokens, page_size=page)) == slots
    room = answer_room(run_args(model_dir, max_total_tokens=tokens, page_size=page))
    assert room.tokens == min(slots, POSITIONS)
    assert room.bound == (f"the engine's KV pool of {slots} token slots (--max-total-tokens)" if slots < POSITIONS
                          else f"the model's {POSITIONS} positions (max_position_embeddings)")


@pytest.mark.parametrize("fields", [{}, {"engine_core": "off"}, {"rollout_external": True}])
def test_without_a_pool_of_this_process_the_positions_are_the_room(model_dir, fields):
    """No --max-total-tokens (the engine sizes its pool from the free memory), the model-cache runner (no pool), an
    external server (its own): the model's positions."""
    args = run_args(model_dir, max_total_tokens=64 if fields else None, **fields)
    assert pool_tokens(args) is None
    assert answer_room(args).tokens == POSITIONS


def test_the_run_settings_hand_the_room_to_the_dataset_and_the_episodes(model_dir, tmp_path):
    cfg = RelaxConfig(hf_checkpoint=str(model_dir), prompt_data=str(tmp_path / "train.jsonl"), max_total_tokens=100,
                      page_size=16, rollout_max_response_len=8)
    assert prompt_format(cfg).answer_room.tokens == 96
    assert context_budget(cfg, prompt_length=90) == 96  # prompt + response would pass the pool
    assert context_budget(run_args(model_dir, rollout_max_context_len=1000), prompt_length=10) == POSITIONS


@pytest.mark.parametrize("family", [*TEXT_CONFIGS, "qwen3-yarn"])
def test_a_pool_is_named_exactly_where_the_engine_runs_the_model_on_its_paged_runner(family, tmp_path):
    """The families the paged runner does not run (experts, linear attention, MLA, sliding windows, a rope it does
    not compute) decode on the model-cache runner, which has no pool to bound a prompt."""
    if family == "qwen3-yarn":
        folder = build_tiny_model_dir(tmp_path / family, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 128})
    else:
        folder = build_text_family(family, tmp_path / family)
    engine = EmbeddedEngine(load_model(folder, torch.float32), read_tokenizer(folder),
                            core=CoreSettings(max_total_tokens=128))
    paged = engine.core.blocks is not None
    assert pool_tokens(run_args(folder, max_total_tokens=128)) == (128 if paged else None)
    assert family in ("llama", "qwen2", "qwen3") if paged else family not in ("llama", "qwen2", "qwen3")
