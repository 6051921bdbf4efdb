"""The RL algorithm: estimator, losses, KL, the critic and on-policy distillation (sections: algorithm, critic, distillation)"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, field_validator

from relax.algorithms import ALGORITHM_SPECS
from relax.algorithms.aggregation import LossAggregation
from relax.config.base import OPD_TYPE_ALIASES, KLType, setting


class AlgorithmSettings(BaseModel):
    """The RL algorithm: estimator, losses, KL, the critic and on-policy distillation."""
    advantage_estimator: str = setting("grpo", "RL algorithm (see docs/algorithms.md).", "algorithm")
    eps_clip: float = setting(0.2, "PPO clip range below 1: ratio ≥ 1 - eps_clip.", "algorithm", gt=0, lt=1)
    eps_clip_high: float | None = setting(
        None, "PPO clip range above 1 (DAPO clip-higher); default eps_clip.", "algorithm", gt=0
    )
    eps_clip_c: float | None = setting(
        None, "Dual-clip constant (> 1): bounds the loss of negative-advantage tokens at -eps_clip_c * A.", "algorithm", gt=1
    )
    use_kl_loss: bool = setting(False, "Add a KL penalty against the frozen initial model to the loss.", "algorithm")
    kl_loss_coef: float = setting(0.0, "Weight of the KL loss.", "algorithm", ge=0)
    kl_loss_type: KLType = setting("k1", "KL estimator: k1, k2, k3 or low_var_kl (k3 clamped to [-10, 10]).", "algorithm")
    entropy_coef: float = setting(0.0, "Weight of the entropy bonus (subtracted from the loss).", "algorithm", ge=0)
    calculate_per_token_loss: bool = setting(
        False,
        "Average the loss over all tokens of the batch (token-mean) instead of per sample first "
        "(seq-mean-token-mean, the default). Upstream's alias for `--loss-agg-mode token-mean`.",
        "algorithm",
    )
    loss_agg_mode: LossAggregation | None = setting(
        None,
        "How per-token losses become one loss: seq-mean-token-mean (mean per sample, then over samples), "
        "token-mean (over all tokens), seq-mean-token-sum (sum per sample, mean over samples) or "
        "seq-mean-token-sum-norm (Dr.GRPO: sum per sample divided by --rollout-max-response-len). "
        "Default: token-mean with --calculate-per-token-loss, else seq-mean-token-mean.",
        "algorithm",
    )
    kl_coef: float = setting(
        0.0,
        "Weight of the KL penalty put in the reward (per token, -kl_coef * k1 KL against the initial model); "
        "used by reinforce_plus_plus. Exclusive with --kl-loss-coef.",
        "algorithm",
        ge=0,
    )
    gamma: float = setting(1.0, "Discount of the REINFORCE++ return G_t = r_t + gamma * G_{t+1}.", "algorithm",
                          ge=0, le=1)
    sapo_tau_pos: float = setting(1.0, "SAPO gate temperature for positive-advantage tokens.", "algorithm", gt=0)
    sapo_tau_neg: float = setting(1.05, "SAPO gate temperature for non-positive-advantage tokens.", "algorithm", gt=0)

    m2po_kl2_budget: float = setting(
        0.01, "M2PO budget on the mean squared log-ratio of harmful tokens.", "algorithm", gt=0
    )

    m2po_miniclip_low: float = setting(0.3, "M2PO: smallest clip range below 1.", "algorithm", gt=0, lt=1)

    m2po_miniclip_high: float = setting(0.5, "M2PO: smallest clip range above 1.", "algorithm", gt=0)
    use_tis: bool = setting(
        False,
        "Truncated importance sampling: weight each token's policy loss by clamp(exp(old - rollout log-prob), "
        "--tis-clip-low, --tis-clip), correcting the inference engine / trainer mismatch.",
        "algorithm",
    )
    tis_clip: float = setting(2.0, "Upper bound of the TIS weight.", "algorithm", gt=0)
    tis_clip_low: float = setting(0.0, "Lower bound of the TIS weight.", "algorithm", ge=0)
    use_rollout_routing_replay: bool = setting(
        False,
        "Rollout routing replay (R3), for mixture-of-experts models: the engine records the experts each MoE layer "
        "chose for every token, and the actor's forwards (old log-probs and training) route each token to those "
        "experts, so the trained policy is the one that sampled (routing weights still come from the trainer's "
        "router scores). Needs an in-process engine (its model-cache runner, where MoE families run, records them) or "
        "relax serve / SGLang servers that return routed experts.",
        "algorithm",
    )
    disable_grpo_std_normalization: bool = setting(
        False, "Dr.GRPO: subtract the group mean but do not divide by the group std.", "algorithm"
    )
    custom_advantage_function_path: str | None = setting(
        None, "module:function computing the advantages in place of --advantage-estimator's normalizer and "
        "advantage function: fn(inputs) -> one [T] tensor per sample, from relax.algorithms.advantages."
        "AdvantageInputs with the raw rewards; the estimator's policy loss, critic and whitening stay. It reads the "
        "whole step (never streamed group by group).", "algorithm",
    )
    custom_policy_loss_function_path: str | None = setting(
        None, "module:function in place of --advantage-estimator's policy loss: fn(settings, log_probs, "
        "old_log_probs, advantages, mask) -> relax.algorithms.policy_loss.PolicyLossTerms, per token [B, T]; "
        "aggregation, TIS, the KL loss and the entropy bonus apply around it as for every loss.", "algorithm",
    )
    loss_type: Literal["policy_loss", "sft", "dpo", "rm"] = setting(
        "policy_loss",
        "policy_loss: RL with --advantage-estimator. sft: supervised fine-tuning (negative log-likelihood of "
        "the dataset's responses, --label-key or the assistant turns of chat rows) on the same trainer. dpo: "
        "preference training on pairs (--chosen-key, --rejected-key) with --dpo-loss. rm: a reward model (a scalar "
        "head on the model, Bradley-Terry loss) on the same pairs, evaluated by its held-out pair accuracy; "
        "`relax export` writes it for AutoModelForSequenceClassification and --rm-path (docs/training_modes.md).",
        "algorithm",
    )
    center_rewards_coefficient: float = setting(
        0.0, "--loss-type rm: adds this times (r_chosen + r_rejected)^2 to each pair's loss, keeping the scores "
        "centred on 0 (TRL's center_rewards_coefficient; 0: off).", "algorithm", ge=0)
    dpo_loss: Literal["sigmoid", "ipo", "simpo"] = setting(
        "sigmoid", "The preference loss of --loss-type dpo: sigmoid (DPO), ipo, or simpo (reference-free, "
        "length-normalised; no reference model is loaded).", "algorithm",
    )
    dpo_beta: float = setting(0.1, "β of the preference loss: the strength of the implicit KL to the reference "
                              "(IPO's τ; SimPO's reward scale).", "algorithm", gt=0)
    dpo_label_smoothing: float = setting(
        0.0, "Conservative DPO: the assumed share of flipped preference labels (sigmoid and simpo).", "algorithm",
        ge=0, lt=0.5,
    )
    simpo_gamma: float = setting(0.0, "SimPO's target reward margin γ (--dpo-loss simpo).", "algorithm", ge=0)
    critic_lr: float | None = setting(None, "Learning rate of the critic (default --lr).", "critic", gt=0)
    num_critic_only_steps: int = setting(
        0, "Rollout steps at the start that train only the critic (the policy waits for fitted values).",
        "critic", ge=0,
    )
    value_clip: float | None = setting(
        0.2, "Clip range of the value update around the old values (PPO value clipping).", "critic", ge=0
    )
    lambd: float = setting(1.0, "GAE's lambda (1: Monte-Carlo returns minus the value baseline).", "critic",
                          ge=0, le=1)
    use_opd: bool = setting(
        False,
        "On-policy distillation: penalise the student's divergence from a teacher on the student's own "
        "samples, in the advantage (--opd-kl-coef) or as a loss term (--opd-loss-coef).",
        "distillation",
    )
    opd_type: Literal["trainer", "engine", "megatron", "sglang"] = setting(
        "trainer",
        "Where the teacher runs: `trainer` (a frozen forward beside the policy, sharded like it) or `engine` (an "
        "inference engine that scores the tokens). Upstream's names `megatron` and `sglang` are accepted for them.",
        "distillation",
    )
    teacher_hf_checkpoint: str | None = setting(
        None, "Hugging Face folder (or GGUF file) of the teacher; it must share the student's tokenizer.",
        "distillation", path=True
    )
    opd_kl_type: Literal["reverse_kl", "forward_kl", "low_var_kl"] = setting(
        "reverse_kl",
        "Divergence per response token: reverse_kl (log p_s - log p_t on the sampled token), low_var_kl (k3 "
        "estimator of the reverse KL, clamped to [-10, 10]), forward_kl (KL(teacher || student) over the "
        "teacher's top --opd-log-prob-top-k tokens).",
        "distillation",
    )
    opd_kl_coef: float = setting(
        1.0, "Advantage mode: A_t <- A_t - opd_kl_coef * KL_t (detached).", "distillation", ge=0
    )
    opd_loss_coef: float = setting(
        0.0, "Loss mode: loss += opd_loss_coef * agg(KL_t). Setting it alone switches --opd-kl-coef to 0.",
        "distillation", ge=0,
    )
    opd_log_prob_top_k: int = setting(20, "Teacher top-k of forward_kl.", "distillation", ge=1)
    opd_norm_mode: Literal["tail", "norm", "trunc"] = setting(
        "tail",
        "forward_kl over the top-k: tail (one extra bucket holds the rest of the mass: an exact KL of the "
        "coarsened distributions), norm (renormalise both over the top-k) or trunc (top-k terms only).",
        "distillation",
    )

    @field_validator("advantage_estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        if value not in ALGORITHM_SPECS:
            raise ValueError(f"unknown estimator {value!r}; choose one of {sorted(ALGORITHM_SPECS)}")
        return value

    @field_validator("opd_type", mode="before")
    @classmethod
    def _upstream_opd_type(cls, value: Any) -> Any:
        return OPD_TYPE_ALIASES.get(value, value)
