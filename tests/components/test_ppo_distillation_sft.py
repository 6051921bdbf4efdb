"""PPO's critic, on-policy distillation and the SFT loss: formulas on hand-computed numbers,
the real value model and teacher scoring on a tiny model, config rules, and SFT end to end."""

import asyncio
import json
import math

import pytest
import torch

from relax.algorithms.advantages import AdvantageInputs
from relax.algorithms.distillation import opd_token_kl, penalize_advantages, sampled_token_kl, top_k_forward_kl
from relax.algorithms.loss import MicroBatchTensors, build_policy_loss_fn, build_sft_loss_fn, build_value_loss_fn
from relax.algorithms.policy_loss import PolicyLossSettings
from relax.algorithms.spec import get_algorithm
from relax.backends.inference.base import ScoreRequest
from relax.backends.inference.embedded import EmbeddedEngine
from relax.backends.training.base import TrainBatch
from relax.backends.training.fsdp import FSDPTrainBackend
from relax.backends.training.settings import TrainSettings
from relax.cli.args import parse_config
from relax.config import ConfigError
from relax.data.dataset import DatasetError, PromptFormat
from relax.data.sft_dataset import load_sft_samples
from tests.algorithms.test_algorithm_family import GOOD, _config_error
from tests.support.runs import run_relax, tiny_train_args
from tests.support.tiny_assets import build_tiny_model_dir, build_tokenizer


def _settings(**kwargs):
    return TrainSettings(device=torch.device("cpu"), compute_dtype=torch.float32, micro_batch_size=4, temperature=1.0,
                         pad_token_id=0, lr=1e-2, total_optimizer_steps=10, **kwargs)


# ---- PPO ------------------------------------------------------------------------------------
def test_ppo_gae_advantages_and_returns_by_hand():
    # one sample, mask [1, 1, 1], reward 1, V = [0.5, 0.25, 0.75], γ = 1, λ = 0.5; token rewards [0, 0, 1]
    # t=2: δ = 1 - 0.75 = 0.25, A = 0.25;  t=1: δ = 0.75 - 0.25 = 0.5, A = 0.5 + 0.5·0.25 = 0.625
    # t=0: δ = 0.25 - 0.5 = -0.25, A = -0.25 + 0.5·0.625 = 0.0625;  R = A + V = [0.5625, 0.875, 1.0]
    inputs = AdvantageInputs(rewards=torch.tensor([1.0]), group_size=1, response_masks=[torch.ones(3)],
                             gamma=1.0, lambd=0.5, values=[torch.tensor([0.5, 0.25, 0.75])])
    advantages, returns = get_algorithm("ppo").compute_advantages_and_returns(inputs)
    torch.testing.assert_close(returns[0], torch.tensor([0.5625, 0.875, 1.0]))
    # whitened over the 3 valid tokens: mean 0.3125, population variance 0.0546875
    raw = torch.tensor([0.0625, 0.625, 0.25])
    torch.testing.assert_close(advantages[0], (raw - 0.3125) / math.sqrt(0.0546875))


def test_ppo_rejects_non_finite_rewards_and_needs_values():
    spec = get_algorithm("ppo")
    with pytest.raises(ValueError, match="non-finite rewards"):
        spec.compute_advantages(AdvantageInputs(torch.tensor([float("nan")]), 1, [torch.ones(2)],
                                                values=[torch.zeros(2)]))
    with pytest.raises(ValueError, match="critic's values"):
        spec.compute_advantages(AdvantageInputs(torch.tensor([1.0]), 1, [torch.ones(2)]))


def test_ppo_fully_masked_sample_gets_zero_advantage_and_return():
    inputs = AdvantageInputs(torch.tensor([1.0, 0.0]), 1, [torch.zeros(2), torch.ones(2)],
                             values=[torch.tensor([3.0, 3.0]), torch.tensor([0.5, 0.5])])
    advantages, returns = get_algorithm("ppo").compute_advantages_and_returns(inputs)
    assert torch.equal(advantages[0], torch.zeros(2)) and torch.equal(returns[0], torch.zeros(2))


def test_value_loss_fn_clips_around_the_old_values():
    # V = [1, 2], V_old = [0.5, 0.5], R = [1.5, 0], clip 0.2 -> V_clip = [0.7, 0.7]
    # token 0: max((1-1.5)², (0.7-1.5)²) = 0.64 -> 0.32 (clipped term wins)
    # token 1: max((2-0)², (0.7-0)²) = 4 -> 2.0;  token-mean (0.32 + 2.0) / 2 = 1.16, clipfrac 0.5
    mb = MicroBatchTensors(mask=torch.ones(1, 2), fields={"old_values": torch.tensor([[0.5, 0.5]]),
                                                          "returns": torch.tensor([[1.5, 0.0]])},
                           global_num_samples=1, global_num_tokens=2)
    values = torch.tensor([[1.0, 2.0]], requires_grad=True)
    loss, metrics = build_value_loss_fn(0.2, "token-mean")(mb, values, None)
    assert loss.item() == pytest.approx(1.16)
    assert metrics["value_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # token 0's clipped value does not move with V (gradient 0); token 1: d/dV 0.5·(V-R)²/2 = (2-0)/2 = 1
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1.0]]))


def test_value_model_starts_at_zero_and_fits_returns(tiny_workspace):
    backend = FSDPTrainBackend(tiny_workspace / "model", _settings(), value_head=True)
    batch = TrainBatch(tokens=[[5, 6, 7, 8], [9, 10, 11]], response_lengths=[2, 1], loss_masks=[[1, 1], [1]])
    values = backend.compute_values(batch)
    assert [v.shape for v in values] == [torch.Size([2]), torch.Size([1])]
    assert all(torch.equal(v, torch.zeros_like(v)) for v in values)
    targets = [torch.tensor([1.0, 1.0]), torch.tensor([-1.0])]
    fields = {"returns": targets, "old_values": values}
    loss_fn = build_value_loss_fn(None, "token-mean")
    first = backend.train_step(TrainBatch(batch.tokens, batch.response_lengths, batch.loss_masks, fields), loss_fn)
    for _ in range(30):
        last = backend.train_step(TrainBatch(batch.tokens, batch.response_lengths, batch.loss_masks, fields), loss_fn)
    assert last["value_loss"] < 0.1 * first["value_loss"]
    with pytest.raises(TypeError, match="critic"):
        backend.compute_log_probs(batch)


# ---- on-policy distillation ----------------------------------------------------------------------
def test_sampled_token_divergences_by_hand():
    student, teacher = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert sampled_token_kl(student, teacher, "reverse_kl").item() == pytest.approx(1.0)
    # k3 with log_ratio 1: e^-1 - 1 + 1
    assert sampled_token_kl(student, teacher, "low_var_kl").item() == pytest.approx(math.exp(-1))
    with pytest.raises(ValueError, match="forward_kl"):
        opd_token_kl("forward_kl", "tail", student, teacher)


def test_top_k_forward_kl_norm_modes_by_hand():
    teacher = torch.log(torch.tensor([[0.5, 0.3]]))
    student = torch.log(torch.tensor([[0.25, 0.25]]))
    trunc = 0.5 * math.log(2) + 0.3 * math.log(1.2)
    assert top_k_forward_kl(student, teacher, "trunc").item() == pytest.approx(trunc, abs=1e-6)
    # tail bucket: teacher 0.2, student 0.5
    assert top_k_forward_kl(student, teacher, "tail").item() == pytest.approx(trunc + 0.2 * math.log(0.4), abs=1e-6)
    # renormalised: teacher [0.625, 0.375], student [0.5, 0.5]
    norm = 0.625 * math.log(1.25) + 0.375 * math.log(0.75)
    assert top_k_forward_kl(student, teacher, "norm").item() == pytest.approx(norm, abs=1e-6)
    # the tail form is an exact KL of coarsened distributions: zero iff they agree, never negative
    assert top_k_forward_kl(teacher, teacher, "tail").item() == pytest.approx(0.0, abs=1e-7)


def test_advantage_mode_subtracts_the_detached_kl():
    kl = torch.tensor([0.5, 2.0], requires_grad=True)
    out = penalize_advantages(torch.tensor([1.0, 1.0]), kl * torch.tensor([1.0, 0.0]), 0.1)
    torch.testing.assert_close(out, torch.tensor([0.95, 1.0]))
    assert not out.requires_grad


def test_loss_mode_adds_the_aggregated_kl_with_gradient():
    settings = PolicyLossSettings(policy_loss="ppo_clip", eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None,
                                  aggregation="token-mean", opd_loss_coef=0.5, opd_kl_type="reverse_kl")
    log_probs = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    mb = MicroBatchTensors(mask=torch.ones(1, 2), fields={"advantages": torch.zeros(1, 2),
                                                          "teacher_log_probs": torch.tensor([[-2.0, -0.5]])},
                           global_num_samples=1, global_num_tokens=2)
    loss, metrics = build_policy_loss_fn(settings)(mb, log_probs, torch.zeros(1, 2))
    assert metrics["opd_kl"].item() == pytest.approx(0.5)  # mean of [1, 0]
    assert loss.item() == pytest.approx(0.25)  # zero advantages: only 0.5 · 0.5
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[0.25, 0.25]]))


def test_engine_teacher_scores_equal_the_trainer_forward(tiny_workspace):
    model_dir = tiny_workspace / "model"
    engine = EmbeddedEngine.from_pretrained(str(model_dir))
    backend = FSDPTrainBackend(model_dir, _settings(), trainable=False)
    tokens = [[5, 6, 7, 8, 9], [10, 11, 12]]
    scores = asyncio.run(engine.score([ScoreRequest(tokens[0], 3, top_k=4), ScoreRequest(tokens[1], 1, top_k=4)]))
    trainer = backend.compute_log_probs(TrainBatch(tokens, [3, 1], [[1] * 3, [1]]), top_k=4)
    for output, log_probs, top_ids, top_log_probs in zip(scores, trainer.log_probs, trainer.top_ids,
                                                         trainer.top_log_probs):
        torch.testing.assert_close(torch.tensor(output.log_probs), log_probs, atol=1e-5, rtol=1e-5)
        assert torch.equal(torch.tensor(output.top_ids), top_ids)
        torch.testing.assert_close(torch.tensor(output.top_log_probs), top_log_probs, atol=1e-5, rtol=1e-5)
    # the student's log-probs at the teacher's top-k ids (what forward_kl trains through)
    gathered = backend.compute_log_probs(TrainBatch(tokens, [3, 1], [[1] * 3, [1]], gather_ids=trainer.top_ids))
    for at_ids, top_log_probs in zip(gathered.gathered, trainer.top_log_probs):
        torch.testing.assert_close(at_ids, top_log_probs)


def test_a_teacher_with_another_vocabulary_is_rejected_before_training(tiny_workspace, tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from relax.core.build import build_roles

    other = tmp_path / "other_teacher"
    Qwen3ForCausalLM(Qwen3Config(vocab_size=77, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)).save_pretrained(other)
    build_tokenizer().save_pretrained(other)
    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, "--num-rollout", "1", "--use-opd",
                                       "--teacher-hf-checkpoint", str(other)))
    with pytest.raises(ConfigError, match="--teacher-hf-checkpoint .*vocabulary of 77 tokens"):
        build_roles(cfg)


# ---- config rules --------------------------------------------------------------------------------
def test_critic_and_distillation_options_name_the_flags():
    message = _config_error("--critic-lr", "1e-5", "--lambd", "0.9")
    assert "--critic-lr, --lambd" in message and "--advantage-estimator ppo" in message
    assert "--use-opd" in _config_error("--opd-kl-type", "forward_kl")
    assert "--teacher-hf-checkpoint" in _config_error("--use-opd")
    message = _config_error("--use-opd", "--teacher-hf-checkpoint", "t", "--opd-kl-coef", "1", "--opd-loss-coef", "1")
    assert "--opd-kl-coef" in message and "--opd-loss-coef" in message
    # naming only the loss coefficient selects the loss mode; upstream's placement names are accepted
    cfg = parse_config(GOOD + ["--use-opd", "--teacher-hf-checkpoint", "t", "--opd-loss-coef", "0.5",
                               "--opd-type", "megatron"])
    assert (cfg.opd_kl_coef, cfg.opd_loss_coef, cfg.opd_type) == (0.0, 0.5, "trainer")
    assert parse_config(GOOD + ["--advantage-estimator", "ppo", "--n-samples-per-prompt", "1"]).lambd == 1.0


# ---- SFT ---------------------------------------------------------------------------------------------
def test_sft_conversation_masks_exactly_the_assistant_turns(tmp_path):
    tokenizer = build_tokenizer()
    rows = [{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
                          {"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]},
            {"input": "3+4=", "label": "7"}]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chat = load_sft_samples(f"{path}@[0:1]", tokenizer, PromptFormat(input_key="messages", apply_chat_template=True))
    (sample,) = chat
    assert tokenizer.decode(sample.prompt_tokens) == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    learned = [t for t, m in zip(sample.response_tokens, sample.loss_mask) if m]
    # each assistant turn's content, its end token and the template's newline after it
    assert tokenizer.decode(learned) == "2<|im_end|>\n4<|im_end|>\n"
    masked = [t for t, m in zip(sample.response_tokens, sample.loss_mask) if not m]
    assert tokenizer.decode(masked) == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    (plain,) = load_sft_samples(f"{path}@[1:2]", tokenizer, PromptFormat(input_key="input", label_key="label"))
    assert tokenizer.decode(plain.response_tokens) == "7<|im_end|>" and plain.loss_mask == [1, 1]
    with pytest.raises(DatasetError, match="row 2: missing target field 'answer'"):
        load_sft_samples(f"{path}@[1:2]", tokenizer, PromptFormat(input_key="input", label_key="answer"))


def test_sft_loss_is_the_masked_negative_log_likelihood():
    mb = MicroBatchTensors(mask=torch.tensor([[1, 1, 0]]), global_num_samples=1, global_num_tokens=2)
    loss, _ = build_sft_loss_fn("token-mean")(mb, torch.tensor([[-1.0, -3.0, -100.0]]), None)
    assert loss.item() == pytest.approx(2.0)


def test_sft_run_learns_the_targets_and_resumes(tiny_workspace, tmp_path):
    model_dir = build_tiny_model_dir(tmp_path / "model", seed=3)
    out = tmp_path / "sft_run"

    def train(steps, *extra):
        args = tiny_train_args(tiny_workspace, out, "--hf-checkpoint", str(model_dir), "--loss-type", "sft",
                               "--num-rollout", str(steps), "--rollout-batch-size", "16", "--lr", "3e-3",
                               "--eval-interval", "20", "--save-interval", "20", *extra)
        result = run_relax("train", *args)
        assert result.returncode == 0, result.stderr[-3000:]
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    metrics = train(40)
    nll = [m["train/nll"] for m in metrics if "train/nll" in m]
    assert len(nll) == 40 and sum(nll[-5:]) / 5 < 0.5 * sum(nll[:5]) / 5
    assert [m["step"] for m in metrics if "eval/accuracy" in m] == [0, 20, 40]
    resumed = train(44, "--load", str(out))  # continues at the saved data cursor, steps 41..44
    assert [m["step"] for m in resumed if "train/nll" in m] == list(range(1, 45))
