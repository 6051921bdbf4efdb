"""Models built in several threads at once (the reward model scorer loads in a worker thread beside the trainer's and
the engine's loads) come out whole: transformers builds parameters on the meta device through process-wide patches,
and two interleaved constructions left one model with meta parameters and every later model of the process on meta
(a whole xdist worker's serving tests failed that way). Every construction path of Relax takes one lock
(`MODEL_CONSTRUCTION_LOCK`); these threads race every path against each other, round after round."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoConfig

from relax.backends.models.family import load_model, load_score_model, model_from_config
from relax.rollout.rewards.reward_model import RewardModelScorer
from tests.support.tiny_assets import build_tiny_model_dir

ROUNDS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny causal LM, and beside it (``reward_model``) a one-label reward model of it."""
    folder = tmp_path_factory.mktemp("concurrent") / "model"
    build_tiny_model_dir(folder)
    load_score_model(folder, torch.float32, pad_token_id=0).save_pretrained(folder.parent / "reward_model")
    return folder


def _devices(model) -> set[str]:
    return {tensor.device.type for tensor in [*model.parameters(), *model.buffers()]}


def test_models_built_in_several_threads_at_once_have_no_meta_parameters(model_dir):
    config = AutoConfig.from_pretrained(model_dir)
    builders = {
        "load_model": lambda: load_model(model_dir, torch.float32),
        "load_score_model": lambda: load_score_model(model_dir, torch.float32, pad_token_id=0),
        "model_from_config": lambda: model_from_config(config, torch.float32),
        "reward model scorer": lambda: _scorer_model(model_dir),
    }
    for round_index in range(ROUNDS):
        built: dict[str, set[str]] = {}
        errors: list[BaseException] = []

        def build(name, make):
            try:
                built[f"{name} (thread)"] = _devices(make())
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        threads = [threading.Thread(target=build, args=item) for item in builders.items()]
        for thread in threads:
            thread.start()
        built["load_model (main thread)"] = _devices(load_model(model_dir, torch.float32))
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert all(devices == {"cpu"} for devices in built.values()), (round_index, built)
        # Nothing of a construction outlived it: a module made now is made on the CPU.
        assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
        assert _devices(load_model(model_dir, torch.float32)) == {"cpu"}


def _scorer_model(model_dir):
    scorer = RewardModelScorer(model_dir.parent / "reward_model", "cpu", torch.float32)
    scorer._load()
    return scorer.model
