"""A model folder whose weights do not fit its config.json (a config edited by hand or copied from another size, a
shard that lost tensors) is refused naming the folder and the tensors, before anything loads: transformers had
raised "You set `ignore_mismatched_sizes` to `False`..." pointing at a log report (a traceback and exit 1, which a
supervised run takes for a machine fault), failed inside torch for an impossible size, and for tensors the files
lack **started them at random and went on**: a pretrained model partly noise, trained without a word.

The property: for any change of the config's shape fields and any tensors dropped from or added to the files,
`model_folder_problem` says nothing exactly when the model loads with every tensor it has taken from the files.
Likewise a tokenizer with more tokens than the model has embedding rows (another model's): its extra tokens had
failed inside the embedding mid-run (IndexError), the chat template's own special tokens at the first step."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from relax.backends.models.family import (
    load_model,
    load_reward_model,
    load_score_model,
    model_folder_problem,
    weights_problem,
)
from tests.support.tiny_assets import build_tiny_model_dir, build_tokenizer

SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "num_hidden_layers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fit") / "model"
    build_tiny_model_dir(folder)
    return folder


def _variant(model: Path, root: Path, config_changes: dict, dropped: list[str], added: dict[str, list[int]]) -> Path:
    folder = root / "variant"
    shutil.copytree(model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    tensors = load_file(folder / "model.safetensors")
    for name in dropped:
        tensors.pop(name)
    tensors.update({name: torch.zeros(shape) for name, shape in added.items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _every_tensor_from_the_files(model, folder: Path) -> bool:
    stored = load_file(folder / "model.safetensors")
    own = model.state_dict()
    if model.config.tie_word_embeddings:
        stored.setdefault("lm_head.weight", stored.get("model.embed_tokens.weight"))
    return all(name in stored and torch.equal(tensor, stored[name]) for name, tensor in own.items())


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # (a size 0 in the config)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(SHAPE_FIELDS), st.integers(-2, 130), max_size=2),
       untie=st.booleans(), drop=st.integers(0, 3), add_extra=st.booleans())
def test_a_folder_is_refused_exactly_when_its_weights_do_not_fill_the_model(model_dir, changes, untie, drop,
                                                                           add_extra):
    names = sorted(load_file(model_dir / "model.safetensors"))
    dropped = names[::7][:drop]  # the embedding, then layer tensors
    config_changes = {**changes, **({"tie_word_embeddings": False} if untie else {})}
    if "num_hidden_layers" in changes and changes["num_hidden_layers"] > 0:  # (a consistent layer list, or it is
        config_changes["layer_types"] = ["full_attention"] * changes["num_hidden_layers"]  # refused for that)
    with tempfile.TemporaryDirectory() as root:
        folder = _variant(model_dir, Path(root), config_changes, dropped,
                          {"mtp.layers.0.proj.weight": [4, 4]} if add_extra else {})
        problem = model_folder_problem(folder)  # never raises: a problem or None
        if problem is None:  # then the model loads, every tensor from the files (extra tensors are only logged)
            assert _every_tensor_from_the_files(load_model(folder, torch.float32), folder), config_changes
            return
        assert problem.startswith(str(folder)) and "Traceback" not in problem
        if "config.json cannot be read" in problem or "no model that can be built" in problem:
            return  # (the load fails inside transformers or torch, as it did before)
        with pytest.raises(ValueError) as refused:  # the load itself refuses alike (`relax serve`, `relax eval`)
            load_model(folder, torch.float32)
        assert str(refused.value) == problem


@pytest.mark.parametrize("change, says", [
    ({"vocab_size": 10}, "model.embed_tokens.weight [43, 64] in the files, [10, 64] by the config"),
    ({"hidden_size": 128}, "tensor(s) of other shapes"),
    ({"num_attention_heads": 3}, "model.layers.0.self_attn.o_proj.weight [64, 64] in the files, [64, 48]"),
    ({"hidden_size": -8}, "describes no model that can be built (RuntimeError: Trying to create tensor with negative"),
    ({"tie_word_embeddings": False}, "lack 1 tensor(s) the model needs (lm_head.weight); transformers would start"),
])
def test_the_refusal_names_the_tensors_and_their_shapes(model_dir, tmp_path, change, says):
    folder = _variant(model_dir, tmp_path, change, [], {})
    assert says in weights_problem(folder)


def test_a_score_head_may_be_new_only_where_training_makes_it(model_dir, tmp_path):
    """--loss-type rm and the critic put a new one-label head on a causal LM; --rm-path scores with a trained reward
    model's own head, so one without it (a causal LM, or a reward model whose head was lost) is refused."""
    assert model_folder_problem(model_dir, load_as="new_score_head") is None
    load_score_model(model_dir, torch.float32, pad_token_id=0)
    assert "lack 1 tensor(s) the model needs (score.weight)" in model_folder_problem(model_dir, load_as="reward_model")
    trained = tmp_path / "reward_model"
    load_score_model(model_dir, torch.float32, pad_token_id=0).save_pretrained(trained)
    assert model_folder_problem(trained, needs_tokenizer=False, load_as="reward_model") is None
    assert load_reward_model(trained, torch.float32).score.weight.shape == (1, 64)
    tensors = load_file(trained / "model.safetensors")
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, trained / "model.safetensors", metadata={"format": "pt"})
    for load_as in ("reward_model", "new_score_head"):
        assert "(model.layers.1.mlp.up_proj.weight)" in model_folder_problem(trained, False, load_as)
    with pytest.raises(ValueError, match="lack 1 tensor"):
        load_reward_model(trained, torch.float32)


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 80))
def test_a_tokenizer_is_refused_exactly_when_one_of_its_tokens_has_no_embedding_row(rows):
    tokenizer = build_tokenizer()
    with tempfile.TemporaryDirectory() as root:
        folder = build_tiny_model_dir(Path(root) / "model", tokenizer=tokenizer, vocab_size=rows)
        problem = model_folder_problem(folder)
        if problem is not None:
            assert len(tokenizer) > rows and f"its tokenizer has {len(tokenizer)} tokens, more than the model's " \
                f"{rows} embedding rows" in problem, problem
            return
        model = load_model(folder, torch.float32)  # every token the tokenizer can give goes through the model
        model(torch.arange(len(tokenizer)).unsqueeze(0))
