"""examples/preference: the three stages' configs (DPO, the reward model, RL against it or an ensemble) parse into the
runs the docs describe, and the near misses of the pair builder are always wrong, well-formed answers."""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from examples.preference.build_pairs import near_miss
from relax.cli.args import parse_config
from relax.core.roles import roles_for_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "preference"


def test_the_three_stages_configs_parse_into_their_runs():
    dpo = parse_config(["--config", str(EXAMPLE / "dpo.yaml")])
    assert dpo.loss_type == "dpo" and "reference" in roles_for_config(dpo)
    rm = parse_config(["--config", str(EXAMPLE / "rm.yaml")])
    assert rm.loss_type == "rm" and roles_for_config(rm) == ("actor", "rollout")
    assert rm.samples_per_step == 2 * rm.rollout_batch_size == rm.train_batch_size
    rl = parse_config(["--config", str(EXAMPLE / "rl_rm.yaml")])
    assert rl.loss_type == "policy_loss" and rl.rm_path == ["runs/preference_rm/reward_model"]
    assert rl.rm_type is None and rl.eval_rm_type == "exact_match" and rl.use_kl_loss
    assert "reference" in roles_for_config(rl)  # the KL loss's
    ensemble = parse_config(["--config", str(EXAMPLE / "rl_rm_ensemble.yaml")])
    assert len(ensemble.rm_path) == 3 and ensemble.rm_ensemble_reduce == "min"
    # rl_rm.yaml with the ensemble as its reward, at the learning rate its figures were measured with (1e-5)
    kept_apart = {"rm_path", "rm_ensemble_reduce", "output_dir", "lr"}
    assert ensemble.model_dump(exclude=kept_apart) == rl.model_dump(exclude=kept_apart)
    assert ensemble.lr == 2 * rl.lr == 1e-5


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 1998), st.integers(0, 2**31))
def test_a_near_miss_is_a_different_number_of_the_same_length(total, seed):
    answer = str(total)
    wrong = near_miss(answer, random.Random(seed))
    assert wrong != answer and len(wrong) == len(answer) and wrong.isdigit()
    assert sum(a != b for a, b in zip(wrong, answer)) == 1
    assert len(wrong) == 1 or wrong[0] != "0"
