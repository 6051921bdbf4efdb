"""The auxiliary load-balancing loss of mixture-of-experts models (``--moe-aux-loss-coef``, issue 18): the family's own
loss over the router logits, added with the family's coefficient or the flag's, and refused where a family has none."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from relax.backends.training.fsdp import FSDPTrainBackend
from relax.cli.main import main
from tests.backends.training.test_packing import LOSS, _rl_batch, _settings
from tests.support.runs import tiny_train_args
from tests.support.tiny_families import build_text_family


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_text_family("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3_moe")


def _step(model_dir, coef, packing=True):
    torch.manual_seed(0)
    backend = FSDPTrainBackend(model_dir, dataclasses.replace(_settings(sequence_packing=packing, micro_batch_size=16),
                                                              moe_aux_loss_coef=coef))
    metrics = backend.train_step(_rl_batch(), LOSS)
    gates = {n: p.detach().clone() for n, p in backend.model.hf_model.named_parameters() if ".gate." in n}
    return metrics, gates


@pytest.mark.parametrize("packing", [True, False])
def test_the_loss_is_the_familys_own_and_moves_the_routers(moe_dir, packing):
    metrics, gates = _step(moe_dir, 0.5, packing)
    batch = _rl_batch()
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_dir)
    longest = max(len(t) for t in batch.tokens)
    ids = torch.tensor([t + [0] * (longest - len(t)) for t in batch.tokens])
    mask = torch.tensor([[1] * len(t) + [0] * (longest - len(t)) for t in batch.tokens])
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    assert float(metrics["moe_aux_loss"]) == pytest.approx(float(expected), rel=1e-4)
    _, without = _step(moe_dir, 0.0, packing)
    assert any(not torch.equal(gates[name], without[name]) for name in gates)  # the aux term reaches the routers


def test_the_default_follows_the_config_and_zero_turns_it_off(moe_dir, tmp_path):
    metrics, gates = _step(moe_dir, None)  # the tiny config keeps output_router_logits off
    assert "moe_aux_loss" not in metrics
    assert all(torch.equal(gates[n], t) for n, t in _step(moe_dir, 0.0)[1].items())
    config = transformers.AutoConfig.from_pretrained(moe_dir)
    config.output_router_logits, config.router_aux_loss_coef = True, 0.25
    config.save_pretrained(moe_dir)
    try:
        metrics, _ = _step(moe_dir, None)
        assert float(metrics["moe_aux_loss"]) > 0
    finally:
        config.output_router_logits = False
        config.save_pretrained(moe_dir)


def test_a_family_without_the_loss_is_refused(tiny_workspace, tmp_path, capsys):
    model = build_text_family("deepseek_v3", tmp_path / "deepseek_v3")
    args = tiny_train_args(tiny_workspace, tmp_path / "run", "--moe-aux-loss-coef", "0.01", "--num-rollout", "1")
    args[args.index("--hf-checkpoint") + 1] = str(model)
    assert main(["train", *args]) == 2
    assert "--moe-aux-loss-coef 0.01: DeepseekV3ForCausalLM defines no auxiliary load-balancing loss" in \
        capsys.readouterr().err
