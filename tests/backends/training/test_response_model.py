"""`response_model._response_hidden` on a model whose `base_model` is the model itself: transformers falls back to the
model where its `base_model_prefix` names no attribute (Qwen2.5-Omni's thinker under transformers 5.17), and the
"body" then returns the LM head's output, which has no hidden states. The memory plan's probe failed on it on the GPU
and the run went on unplanned; the trainer's text-only forwards and the critic take the head-bypassed path there."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from relax.backends.training.response_model import ResponseValueModel, _response_hidden
from tests.support.tiny_families import build_text_family


@pytest.fixture
def models(tmp_path):
    stock = transformers.AutoModelForCausalLM.from_pretrained(build_text_family("qwen3", tmp_path))
    whole = copy.deepcopy(stock)
    whole.base_model_prefix = "absent"  # as a family whose prefix names no attribute
    assert whole.base_model is whole and stock.base_model is not stock
    return stock, whole


def test_the_hidden_states_are_the_bodys_when_the_base_model_is_the_whole_model(models):
    stock, whole = models
    ids = torch.randint(stock.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    positions, predict = torch.arange(9).unsqueeze(0), torch.tensor([3, 4, 8])
    want, _ = _response_hidden(stock, stock.base_model, ids, None, positions, predict, None, None)
    got, _ = _response_hidden(whole, whole.base_model, ids, None, positions, predict, None, None)
    assert got.shape == (3, stock.config.hidden_size)
    torch.testing.assert_close(got, want)
    assert isinstance(whole.get_output_embeddings(), torch.nn.Linear)  # the head is put back after


def test_a_critic_on_such_a_model_reads_its_hidden_states(models):
    stock, whole = models
    critics = [ResponseValueModel(model) for model in (stock, whole)]
    for critic in critics:
        torch.nn.init.ones_(critic.value_head.weight)
    ids = torch.randint(stock.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    values = [critic(ids, None, torch.arange(7).unsqueeze(0), torch.tensor([2, 6])) for critic in critics]
    torch.testing.assert_close(values[1], values[0])
