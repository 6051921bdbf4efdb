"""How each model family splits over a tensor-parallel group: which modules of its language model are column- or
row-parallel, and which stay whole. A family's row in the registry names its plan; the Hugging Face model and its
weights stay as they are (PyTorch's DTensor styles are put on its modules, no conversion).

The plan is Megatron's: in each attention block the query, key and value projections are split by output columns
(whole heads per rank) and the output projection by input rows (its result summed over the group); in each MLP the
gate and up projections by columns and the down projection by rows. Per-head norms (Qwen3's ``q_norm`` /
``k_norm``) see their rank's heads and sum their weight gradients over the group. Two all-reduces per layer in the
forward, two in the backward.

What stays whole (the same on every rank of the group, sharded only by FSDP over the data ranks):
- the token embedding (and an LM head that is the embedding); any other LM head is split by vocabulary outside the
  plan (`relax.backends.training.parallelize`, `relax.backends.training.vocab_parallel`);
- mixture-of-experts experts and routers: experts split over ranks by expert parallelism
  (``--expert-model-parallel-size``), not by tensor parallelism; shared experts are split like a dense MLP;
- multi-head latent attention (DeepSeek-V3): its rotary key part comes from the shared down projection straight
  into every head, so a head split needs that path's gradient summed over the group, which no DTensor style of the
  unchanged modules gives (measured: the single-process step is not reproduced);
- gated-DeltaNet (linear-attention) layers, whose convolution and recurrent state mix channels across heads in
  ways transformers' own plan gathers anyway;
- vision and audio towers: a few hundred million parameters next to a language model of billions, and their
  attention runs over image patches, not the packed text.
"""

from __future__ import annotations

from dataclasses import dataclass

COLWISE = "colwise"  # output features split (whole heads / MLP columns per rank); the output stays local
ROWWISE = "rowwise"  # input features split; the output summed over the group
HEADS_NORM = "heads_norm"  # a norm over each head's features: replicated weights, gradients summed over the group

_ATTENTION = {"layers.*.self_attn.q_proj": COLWISE, "layers.*.self_attn.k_proj": COLWISE,
              "layers.*.self_attn.v_proj": COLWISE, "layers.*.self_attn.o_proj": ROWWISE}
_QK_NORM = {"layers.*.self_attn.q_norm": HEADS_NORM, "layers.*.self_attn.k_norm": HEADS_NORM}
_MLP = {"layers.*.mlp.gate_proj": COLWISE, "layers.*.mlp.up_proj": COLWISE, "layers.*.mlp.down_proj": ROWWISE}
_SHARED_EXPERTS = {f"layers.*.mlp.{shared}.{proj}": style for shared in ("shared_expert", "shared_experts")
                   for proj, style in (("gate_proj", COLWISE), ("up_proj", COLWISE), ("down_proj", ROWWISE))}


@dataclass(frozen=True)
class ParallelPlan:
    name: str
    tensor: dict[str, str]  # module path under the language model (``*``: any one name) -> COLWISE / ROWWISE / ...
    summary: str  # what the plan splits, for docs/models.md


PLANS = {plan.name: plan for plan in (
    ParallelPlan("dense", {**_ATTENTION, **_MLP}, "attention heads, MLP columns"),
    ParallelPlan("dense_qk_norm", {**_ATTENTION, **_QK_NORM, **_MLP}, "attention heads (per-head norms), MLP columns"),
    ParallelPlan("moe", {**_ATTENTION, **_QK_NORM, **_MLP, **_SHARED_EXPERTS},
                 "attention heads, dense and shared-expert MLP columns; experts by expert parallelism"),
    ParallelPlan("mla_moe", {**_MLP, **_SHARED_EXPERTS},
                 "dense and shared-expert MLP columns; latent attention whole; experts by expert parallelism"),
    ParallelPlan("hybrid_linear", {**_ATTENTION, **_QK_NORM, **_MLP, **_SHARED_EXPERTS},
                 "full-attention heads, MLP columns; gated-DeltaNet layers whole"),
    ParallelPlan("none", {}, "nothing: tensor parallelism is refused"),
)}
