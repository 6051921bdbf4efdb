"""Whether a trainer's parallel layout can be built for a model and what the trainer is asked to do with it: one
pure check, run by the trainer before it lays the model out and by the run's preflight (`relax.core.preflight`)
before any model loads, so that a layout that cannot be built is refused with the same words in both places and
the run fails at once, with exit status 2, rather than after loading the model.

What is refused: sizes that do not divide the processes, the heads, the key-value heads or the experts
(`ParallelDims.check`); tensor parallelism for a family without a plan; more pipeline stages than decoder layers
or a layer split that does not place every layer (`pipeline.stage_layers`); and the combinations not built yet
(docs/parallelism.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from relax.backends.models.family import MediaTokens
from relax.backends.models.registry import traits
from relax.backends.training.mesh import CP_FLAG, PP_FLAG, SP_FLAG, TP_FLAG, ParallelDims
from relax.backends.training.moe import aux_loss_coef
from relax.backends.training.parallelize import tensor_parallel_plan
from relax.backends.training.pipeline import stage_layers
from relax.backends.training.settings import TrainSettings


@dataclass(frozen=True)
class LayoutUses:
    """What the trainer of one role does that a layout may not take yet."""

    sequence_packing: bool = True  # as asked (a family that cannot pack turns it off: `check_layout` knows)
    sequence_parallel: bool = False
    lora: bool = False  # adapters on this role's model (a trainable one)
    routing_replay: bool = False
    moe_aux_loss: bool = False
    value_head: bool = False  # a critic or a reward model
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers


def trainer_uses(settings: TrainSettings, config, trainable: bool, value_head: bool) -> LayoutUses:
    """What a trainer of these settings does with the model of ``config``: a frozen model (the reference) takes no
    adapters and no auxiliary loss, a value head no auxiliary loss."""
    return LayoutUses(
        sequence_packing=settings.sequence_packing, sequence_parallel=settings.sequence_parallel,
        lora=trainable and settings.lora is not None, routing_replay=settings.routing_replay,
        moe_aux_loss=trainable and not value_head and aux_loss_coef(config, settings.moe_aux_loss_coef) != 0,
        value_head=value_head, first_stage_layers=settings.decoder_first_pipeline_num_layers,
        last_stage_layers=settings.decoder_last_pipeline_num_layers)


def check_layout(dims: ParallelDims, config, uses: LayoutUses) -> None:
    """Raise ValueError naming the flag and the reason when ``dims`` cannot be built for the model of ``config`` (a
    transformers config) doing ``uses``."""
    dims.check(config)
    if dims.tp > 1:
        tensor_parallel_plan(config)  # the family has one
    packed = uses.sequence_packing and traits(config).packing_unsupported is None
    multimodal = bool(MediaTokens.of(config).never_generated)

    def refuse(prefix: str, reasons: dict[str, bool]) -> None:
        refused = [reason for reason, applies in reasons.items() if applies]
        if refused:
            raise ValueError(f"{prefix} {', '.join(refused)} (docs/parallelism.md)")

    padded = "padded micro-batches (--no-sequence-packing, or a family that cannot pack)"
    media = "images, video or audio (a multimodal family)"
    if uses.lora and dims.tp > 1:
        raise ValueError(f"--lora-rank with {TP_FLAG} > 1 is not supported yet: the adapters would wrap the "
                         "projections the plan splits")
    if dims.cp > 1:
        refuse(f"{CP_FLAG} {dims.cp} splits packed rows; not built yet with",
               {padded: not packed, "routing replay": uses.routing_replay,
                "a mixture-of-experts auxiliary loss": uses.moe_aux_loss})
    if uses.sequence_parallel:
        refuse(f"{SP_FLAG}: not built with", {padded: not packed, media: multimodal,
                                              f"{TP_FLAG} 1 (nothing to split the tokens over)": dims.tp == 1,
                                              PP_FLAG: dims.pp > 1, CP_FLAG: dims.cp > 1})
    if dims.pp > 1:
        refuse(f"{PP_FLAG} {dims.pp}: not built yet with",
               {padded: not packed, media: multimodal, "routing replay": uses.routing_replay,
                "a mixture-of-experts auxiliary loss": uses.moe_aux_loss,
                "a critic or reward model (value head)": uses.value_head, "LoRA": uses.lora})
        stage_layers(config.get_text_config().num_hidden_layers, dims.pp, uses.first_stage_layers,
                     uses.last_stage_layers)
