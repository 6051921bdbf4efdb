"""Training backend on FSDP2 (`torch.distributed.fsdp.fully_shard`).

Every rank receives the whole global batch and trains on its share (strided, or balanced by tokens
with ``--balance-data``); loss denominators count the whole batch, so the gradient equals the
single-process one at any world size and with any split into micro-batches.

A micro-batch is a packed row of whole sequences (`packing`, attended apart by `varlen_attention`),
or with ``--no-sequence-packing`` a right-padded batch; it holds ``--micro-batch-size`` samples, or
with ``--use-dynamic-batch-size`` up to ``--max-tokens-per-gpu`` tokens. The LM head runs only at
response positions and chunk by chunk (`log_probs`), so no full float32 logits exist.

Precision: a trainable model keeps float32 master weights, gradients and AdamW state. Across processes it
computes with bf16 parameters through FSDP2's mixed precision; a single process keeps a plain module under
autocast, which saves FSDP's per-layer gathers, hooks and DTensor dispatch (~10% of a CPU step on the
quickstart model, benchmarks/README.md; 1.2x the tokens/s of FSDP2 at one process on the H200,
``fsdp_single_process``). A frozen model (reference, teacher) loads in the compute dtype. ``offload``/``reload`` move a trainer off the device between
phases (``--offload-train``). The training code is the same at every size.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.tensor import DTensor

from relax.algorithms.aggregation import Rescale, StepCounts
from relax.algorithms.loss import LossFn, MicroBatchTensors
from relax.backends.models.family import (
    MediaTokens,
    concat_inputs,
    forward_inputs,
    freeze_towers,
    load_model,
    load_score_model,
    rope_positions,
)
from relax.backends.models.registry import traits
from relax.backends.models.routing_replay import RoutingReplay, token_routes
from relax.backends.training.base import LogProbs, PerTokenOutputs, TrainBackend, TrainBatch
from relax.backends.training.checkpoint_state import load_state, save_state
from relax.backends.training.compiled_norm import rms_norm_forward
from relax.backends.training.context_parallel import ContextSlice, gather_response_outputs, split_packed
from relax.backends.training.fused_qk_rope import fuse_qk_norm_rope
from relax.backends.training.grouped_experts import set_master_weight_casts, use_grouped_experts
from relax.backends.training.layout import check_layout, trainer_uses
from relax.backends.training.liger import (
    apply_liger_kernels,
    checkpoint_context,
    liger_unavailable_reason,
    rope_scope,
)
from relax.backends.training.log_probs import TokenLogProbs
from relax.backends.training.lora import inject, is_adapter, merged_named_weights
from relax.backends.training.master_weights import MasterWeightCasts, embed_in_compute_dtype, use_master_weight_linears
from relax.backends.training.mesh import ParallelDims
from relax.backends.training.moe import moe_aux_loss
from relax.backends.training.optimizer import build_optimizer
from relax.backends.training.packing import (
    balanced_partition,
    pack_sequences,
    pad_packed,
    pad_responses,
    pad_sequences,
    padded_rows,
    plan_token_budget,
    response_mask,
    to_device,
)
from relax.backends.training.parallelize import apply_expert_parallel, apply_tensor_parallel, shard_model
from relax.backends.training.pipeline import PipelineRunner, PipelineStageModel, stage_layers
from relax.backends.training.response_model import (
    HeadRequest,
    ResponseLogitsModel,
    ResponseScoreModel,
    ResponseValueModel,
    language_model,
    ties_embeddings,
)
from relax.backends.training.settings import TrainSettings
from relax.backends.training.varlen_attention import PackedAttention
from relax.distributed.process_group import ensure_process_group, release_before_shutdown
from relax.distributed.weight_sync import bucketize

logger = logging.getLogger("relax")

# Optimizer steps in a row whose gradients held a NaN or an infinity, each skipped, before the run fails: one such
# step is an overflow or one bad batch; several in a row mean every step's inputs are broken (rewards, advantages,
# a custom loss) and skipping would only spend the run's time.
MAX_NONFINITE_STEPS_IN_A_ROW = 3


@dataclass
class _OpenStep:
    """An optimizer step between `begin_step` and `end_step`."""

    loss_fn: LossFn
    counts: StepCounts  # what the loss divides by (provisional while chunks still come)
    seen_samples: int = 0  # what the chunks held, all ranks together
    seen_tokens: int = 0
    totals: dict[str, torch.Tensor] = field(default_factory=dict)
    template: TrainBatch | None = None  # the last chunk, the pattern of a placeholder micro-batch
    reduced: bool = False  # whether the gradients were reduced over ranks after the last backward


class FSDPTrainBackend(TrainBackend):
    """Policy (``trainable=True``), frozen reference or teacher (``trainable=False``), PPO
    critic (``value_head=True``) or reward model (``score_head=True``: `ResponseScoreModel`). The critic and the
    reward model give one value per response token (``compute_values``) instead of log-probs."""

    def __init__(self, model_path: str | Path, settings: TrainSettings, trainable: bool = True,
                 value_head: bool = False, score_head: bool = False):
        ensure_process_group(settings.device)
        self.settings = settings
        self.trainable = trainable
        self.value_head = value_head or score_head
        self.score_head = score_head
        low_precision = settings.compute_dtype != torch.float32
        # A frozen model has no master weights to keep: it loads in the compute dtype (half the memory, no casts).
        load_dtype = settings.compute_dtype if not trainable and low_precision else torch.float32
        hf_model = load_score_model(model_path, load_dtype, settings.pad_token_id) if score_head else \
            load_model(model_path, load_dtype)
        self.dims = ParallelDims(dist.get_world_size(), tp=settings.tensor_model_parallel_size,
                                 ep=settings.expert_model_parallel_size, cp=settings.context_parallel_size,
                                 pp=settings.pipeline_model_parallel_size,
                                 dp_replicate=settings.data_parallel_replicate_size)
        check_layout(self.dims, hf_model.config, trainer_uses(settings, hf_model.config, trainable,
                                                              self.value_head))
        if settings.moe_grouped_gemm and (experts := use_grouped_experts(hf_model)):
            logger.info("mixture-of-experts: %d expert layers as grouped GEMMs in %s", experts,
                        str(settings.compute_dtype).removeprefix("torch."))
        unpackable = traits(hf_model.config).packing_unsupported
        if settings.sequence_packing and unpackable:
            logger.warning("%s trains on padded micro-batches, not packed rows: %s", type(hf_model).__name__,
                           unpackable)
            self.settings = settings = dataclasses.replace(settings, sequence_packing=False)
        self.lora = settings.lora if trainable else None
        self._add_adapters(hf_model)
        if settings.gradient_checkpointing and trainable:
            # non-reentrant, so that a block's recomputation can be given the context its forward had
            hf_model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": checkpoint_context})
            if self.lora is not None:  # frozen embeddings: checkpointed blocks need inputs that require grad
                hf_model.enable_input_require_grads()
        self._liger = self._use_kernels(hf_model)
        self._warned_oversized = False
        self._offloaded = False
        self._offloaded_state: list[tuple[dict, str]] = []
        media_ids = MediaTokens.of(hf_model.config).never_generated
        self._suppressed_ids = torch.tensor(media_ids, device=settings.device) if media_ids else None
        self._moe_aux = moe_aux_loss(hf_model, settings.moe_aux_loss_coef) if trainable and not self.value_head \
            else None
        self._routing = RoutingReplay(hf_model) if settings.routing_replay else None
        if self.dims.pp > 1:
            self.model = self._pipeline_stage(hf_model)
        else:
            self.model = ResponseScoreModel(hf_model) if score_head else \
                ResponseValueModel(hf_model) if value_head else ResponseLogitsModel(hf_model)
        if self._moe_aux is not None:
            self.model.record_router_logits = True
            logger.info("mixture-of-experts auxiliary loss: coefficient %g", self._moe_aux.coef)
        self._open_step: _OpenStep | None = None
        self._nonfinite_steps_in_a_row = 0
        self.model.to(settings.device)
        self.world_size = dist.get_world_size()
        self.sharded = self.world_size > 1  # collectives in every step
        # FSDP2 also at one process on CUDA when training in low precision: its mixed precision is the bf16
        # compute with float32 master weights that autocast over float32 parameters only approximates (slower:
        # every activation and residual stays float32).
        self.fsdp = self.sharded or (trainable and low_precision and settings.device.type == "cuda"
                                     and settings.fsdp_single_process)
        self._distribute(hf_model)
        # (after FSDP2, which puts parameters of its own in place of the module's)
        self._expert_parameters = [p for m in hf_model.modules() if getattr(m, "relax_expert_group", None)
                                   for p in m.parameters(recurse=False)]
        self._weight_casts: MasterWeightCasts | None = None
        if trainable and low_precision and not self.fsdp and settings.gradient_accumulation_fusion:
            self._weight_casts = MasterWeightCasts(settings.compute_dtype, settings.shared_input_linears)
            use_master_weight_linears(self.model, self._weight_casts)
            if settings.moe_grouped_gemm:
                set_master_weight_casts(self.model, self._weight_casts)
        if trainable and low_precision and not self.fsdp and settings.activations_in_compute_dtype:
            embed_in_compute_dtype(hf_model, settings.compute_dtype)
        self._set_trainable(hf_model)
        self.pipeline: PipelineRunner | None = None
        if self.dims.pp > 1:
            # a head tied to the embedding: its two copies (first and last stage) exchange gradients; every rank
            # builds the end stages' groups (the whole model was loaded everywhere: every rank knows)
            self.pipeline = PipelineRunner(self.model, self.dims.pp_group, settings.device,
                                           hf_model.config.get_text_config().hidden_size, settings.compute_dtype,
                                           self.dims.end_stages_group if self._tied_embedding else None)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if trainable:
            self.optimizer, self.scheduler = build_optimizer(self.model, settings)
        release_before_shutdown(self.release)

    def _add_adapters(self, hf_model: torch.nn.Module) -> None:
        """LoRA's adapters on the projections ``self.lora`` targets (none without ``--lora-rank``)."""
        if self.lora is None:
            return
        adapters = inject(hf_model, self.lora)
        total = sum(p.numel() for p in hf_model.parameters())
        logger.info("LoRA rank %d on %s (--lora-scope %s): %d adapter parameters, %.2f%% of %d",
                    self.lora.rank, self.lora.hf_targets(), self.lora.scope, adapters, 100 * adapters / total, total)

    def _use_kernels(self, hf_model: torch.nn.Module) -> bool:
        """liger-kernel's SwiGLU, RoPE and RMSNorm (or the compiled RMSNorm) and the fused query/key norms + RoPE in
        place of the model's modules, where ``--liger-kernel`` resolved on; whether liger's RoPE took over."""
        settings = self.settings
        if not settings.liger_kernel:
            return False
        if self.dims.tp > 1:
            logger.warning("liger-kernel's kernels are not used under tensor parallelism (they take no DTensors)")
            return False
        reason = liger_unavailable_reason(settings.device)
        if reason:
            raise RuntimeError(f"liger kernels asked for, but {reason}")
        if settings.rms_norm_kernel not in ("compiled", "liger"):
            raise ValueError(f"rms_norm_kernel must be 'compiled' or 'liger', not {settings.rms_norm_kernel!r}")
        counts = apply_liger_kernels(language_model(hf_model),
                                     rms_norm_forward if settings.rms_norm_kernel == "compiled" else None)
        fused = fuse_qk_norm_rope(language_model(hf_model)) \
            if settings.fused_qk_norm_rope and settings.rms_norm_kernel == "compiled" else 0
        logger.info("liger-kernel: %d SwiGLU MLPs%s; %d RMSNorms (%s); %d attention layers' query/key norms and "
                    "RoPE fused", counts["swiglu"], ", RoPE" if counts["rope"] else "", counts["rms_norm"],
                    settings.rms_norm_kernel, fused)
        return bool(counts["rope"])

    def _distribute(self, hf_model: torch.nn.Module) -> None:
        """The parallel layout: tensor-parallel plans, experts over their group, then FSDP2's shards."""
        if self.dims.tp > 1:
            apply_tensor_parallel(hf_model, self.dims, self.settings.sequence_parallel)
        if self.dims.ep > 1:
            apply_expert_parallel(hf_model, self.dims)
        if self.fsdp:
            shard_model(self.model, self.settings.compute_dtype, self.dims if self.sharded else None)

    def _set_trainable(self, hf_model: torch.nn.Module) -> None:
        """Training mode and which parameters take gradients: the adapters alone under LoRA, none when frozen, and
        the encoders of ``--freeze-vision-tower`` / ``--freeze-audio-tower`` never."""
        self.model.train(self.trainable)
        if self.lora is not None:
            for name, parameter in self.model.named_parameters():
                parameter.requires_grad_(is_adapter(name))
        else:
            self.model.requires_grad_(self.trainable)
        if self.trainable:
            frozen = freeze_towers(hf_model, self.settings.freeze_vision_tower, self.settings.freeze_audio_tower)
            if frozen:
                logger.info("froze %d encoder parameters (--freeze-vision-tower / --freeze-audio-tower)", frozen)

    def _pipeline_stage(self, hf_model) -> PipelineStageModel:
        """This rank's stage of the model (`pipeline`); what pipelining does not take yet was refused by
        `check_layout`."""
        self._tied_embedding = ties_embeddings(hf_model)
        stage, stages = self.dims.pp_rank, self.dims.pp
        layers = stage_layers(hf_model.config.get_text_config().num_hidden_layers, stages,
                              self.settings.decoder_first_pipeline_num_layers,
                              self.settings.decoder_last_pipeline_num_layers)[stage]
        logger.info("pipeline stage %d of %d: decoder layers %d-%d", stage, stages, layers.start, layers.stop - 1)
        return PipelineStageModel(hf_model, layers, first=stage == 0, last=stage == stages - 1)

    @property
    def adds_per_sample_loss(self) -> bool:
        """Whether the loss gets a term divided by the step's samples whatever the aggregation (MoE auxiliary)."""
        return self._moe_aux is not None

    # ---- memory between phases -------------------------------------------------------------
    @property
    def offloaded(self) -> bool:
        return self._offloaded

    def offload(self) -> None:
        """Move the weights and optimizer state to host memory (and drop the last step's gradients) while another phase uses the device
        (``--offload-train``); the next call that needs them brings them back (`reload`). Pinned host copies
        where the tensors are plain, so that both moves run at link speed; FSDP2's sharded parameters move with
        ``Module._apply``, which FSDP2 re-registers."""
        if self._offloaded or self.settings.device.type == "cpu":
            return
        self._offloaded = True

        def to_host(tensor: torch.Tensor) -> torch.Tensor:
            if isinstance(tensor, DTensor):
                # Its local shard moves, the sharding spec stays: what `DTensor.to("cpu")` makes, but pinned.
                # (`DTensor.from_local` would move the shard back to the mesh's device.)
                return DTensor(to_host(tensor._local_tensor), tensor._spec, requires_grad=tensor.requires_grad)
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            return host.copy_(tensor, non_blocking=True)

        if self.optimizer is not None:  # the next step starts from zero gradients: nothing to keep
            self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            self.model._apply(to_host)  # parameters and buffers
            self._offloaded_state = []
            for state in (self.optimizer.state.values() if self.optimizer is not None else ()):
                for key, value in state.items():
                    # fused AdamW keeps its step counts on the device, foreach on the host: move device tensors
                    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                        state[key] = to_host(value)
                        self._offloaded_state.append((state, key))
        torch.cuda.synchronize(self.settings.device)
        torch.cuda.empty_cache()

    def reload(self) -> None:
        if not self._offloaded:
            return
        device = self.settings.device
        with torch.no_grad():
            self.model._apply(lambda tensor: tensor.to(device, non_blocking=True))
            for state, key in self._offloaded_state:
                state[key] = state[key].to(device, non_blocking=True)
        self._offloaded_state = []
        self._offloaded = False

    def release(self) -> None:
        """Drop the model and optimizer (before the process group goes; `shutdown_process_group`). The backend
        cannot be used after it."""
        self.model = self.optimizer = self.scheduler = None

    @property
    def hf_config(self):
        return self.model.hf_model.config

    # ---- forward -------------------------------------------------------------------------
    def _model_inputs(self, mb: TrainBatch, row_length: int | None = None) -> tuple[dict[str, object], torch.Tensor]:
        """The model's keyword arguments for micro-batch ``mb`` (packed or padded) and the next-token
        ``targets`` ``[M]`` of its response positions, samples in order; ``row_length``: a packed row padded to it."""
        device = self.settings.device
        tokens = mb.tokens
        if self.score_head:
            # A reward model scores each response token at the token itself, not at the position before it: one
            # padding token after each sequence makes the positions that "predict" the response its own tokens
            # (causal attention: the appended token changes no earlier hidden state), so the score is read where
            # every other output is, and a context slice holds the positions it reads.
            appended = self.settings.pad_token_id or 0  # (any token: nothing before it attends to it)
            tokens = [list(t) + [appended] for t in mb.tokens]
        raw_media = concat_inputs(mb.multimodal) if mb.multimodal and any(mb.multimodal) else None
        if raw_media is not None and self.value_head:
            raise NotImplementedError("a critic on multimodal samples is not supported yet")
        if self.settings.sequence_packing:
            packed = pack_sequences(tokens, mb.response_lengths)
            length = row_length or packed.num_tokens
            if self.settings.sequence_parallel:  # each tensor-parallel rank holds an equal slice of the tokens
                length = -(-length // self.dims.tp) * self.dims.tp
            packed = pad_packed(packed, length)
            position_ids = to_device(packed.position_ids, device)
            if raw_media is not None:  # multimodal rope: 3-D positions of each sequence, concatenated
                input_ids, attention_mask, _, _ = pad_sequences(tokens, mb.response_lengths,
                                                                self.settings.pad_token_id)
                mask = to_device(attention_mask, device)
                positions = rope_positions(self.model.hf_model, to_device(input_ids, device), mask, raw_media)
                if positions is not None:
                    position_ids = positions[:, mask.bool()].unsqueeze(1)
            context = None
            if self.dims.cp > 1:  # this rank's slice of the row's tokens (`context_parallel`)
                if raw_media is not None:
                    raise NotImplementedError("--context-parallel-size with images, video or audio is not built yet")
                packed, context = split_packed(packed, self.dims.cp_group)
                position_ids = to_device(packed.position_ids, device)
            inputs = {"input_ids": to_device(packed.input_ids, device), "attention_mask": None,
                      "position_ids": position_ids, "predict_index": to_device(packed.predict_index, device),
                      "packing": PackedAttention.of(packed.cu_seqlens, packed.max_seqlen, device, context,
                                                    self.settings.attention_repeat_kv)}
            targets = packed.targets
        else:
            input_ids, attention_mask, predict_index, targets = pad_sequences(tokens, mb.response_lengths,
                                                                              self.settings.pad_token_id)
            inputs = {"input_ids": to_device(input_ids, device), "attention_mask": to_device(attention_mask, device),
                      "position_ids": None, "predict_index": to_device(predict_index, device)}
        if raw_media is not None:
            # float32 in; each family casts pixel values to its vision tower's dtype itself
            inputs["media"] = forward_inputs(self.model.hf_model, raw_media, inputs["input_ids"], device, torch.float32)
        return inputs, to_device(targets, device)

    def _routes_replayed(self, mb: TrainBatch):
        """Inside: the routers of ``mb``'s forward (and of its recomputation in backward) take the experts the
        engine recorded for its tokens, when the batch carries them (rollout routing replay)."""
        if self._routing is None or mb.routed_experts is None:
            return nullcontext()
        routes = token_routes(mb.routed_experts, [len(t) for t in mb.tokens], self._routing.shape,
                              self.settings.sequence_packing, self.settings.device)
        return self._routing.replaying(routes)

    def _autocast(self):
        """Models outside FSDP compute in ``compute_dtype`` through autocast (FSDP casts by itself)."""
        enabled = not self.fsdp and self.settings.compute_dtype != torch.float32
        stack = ExitStack()
        stack.enter_context(torch.autocast(self.settings.device.type, dtype=self.settings.compute_dtype,
                                           enabled=enabled))
        stack.enter_context(rope_scope(self._liger))
        return stack

    def _cast_once(self):
        """Each float32 weight cast to the compute dtype once inside (`MasterWeightCasts.scope`)."""
        return self._weight_casts.scope() if self._weight_casts is not None else nullcontext()

    def _per_token_outputs(self, batch: TrainBatch, entropy_grad: bool, top_k: int = 0) -> PerTokenOutputs:
        inputs, targets = self._model_inputs(batch)
        packing = inputs.get("packing")
        context = packing.context if packing is not None else None
        if self.value_head:
            with self._autocast():
                values = self.model(**inputs)
            if context is not None:
                values = gather_response_outputs(values, context)
            lengths = batch.response_lengths
            return PerTokenOutputs(pad_responses(values.float(), lengths), None,
                                   response_mask(lengths, self.settings.device))
        head = self._head_request(batch, targets, context, entropy_grad, top_k)
        with self._autocast():
            out = self.model(**inputs, head=head)
        return self._token_outputs(batch, out, context)

    def _head_request(self, batch: TrainBatch, targets: torch.Tensor, context: ContextSlice | None,
                      entropy_grad: bool, top_k: int) -> HeadRequest:
        """What the LM head computes for ``batch``: log-probs of the next tokens ``targets`` (and of the batch's
        ``gather_ids``), entropies, and the ``top_k`` most likely tokens."""
        ids = targets.unsqueeze(-1)
        if batch.gather_ids is not None:
            extra = torch.cat([g.long() for g in batch.gather_ids])
            if context is not None:
                extra = extra[context.rows]
            ids = torch.cat([ids, to_device(extra, self.settings.device)], dim=-1)
        return HeadRequest(ids, self.settings.temperature, self._suppressed_ids, self.settings.log_probs_chunk_size,
                           entropy_grad and torch.is_grad_enabled(), top_k, self.settings.compute_dtype,
                           self._weight_casts, self.settings.log_probs_keep_logits)

    def _token_outputs(self, batch: TrainBatch, out: TokenLogProbs, context: ContextSlice | None) -> PerTokenOutputs:
        """The head's flat outputs for ``batch`` as ``[B, R]`` rows (every context slice's response positions)."""
        lengths = batch.response_lengths
        whole = (lambda values: values) if context is None else \
            (lambda values: gather_response_outputs(values, context))
        log_probs = whole(out.log_probs)
        gathered = pad_responses(log_probs[:, 1:], lengths) if batch.gather_ids is not None else None
        top_log_probs = pad_responses(whole(out.top_log_probs), lengths) if out.top_log_probs is not None else None
        top_ids = pad_responses(whole(out.top_ids), lengths) if out.top_ids is not None else None
        return PerTokenOutputs(pad_responses(log_probs[:, 0], lengths), pad_responses(whole(out.entropy), lengths),
                               response_mask(lengths, self.settings.device), gathered, top_log_probs, top_ids)

    def _pipeline_inputs(self, micro_batches: list[TrainBatch], entropy_grad: bool, top_k: int = 0) -> list[dict]:
        """Each micro-batch's stage inputs (`PipelineRunner.run`), packed rows padded to the longest."""
        length = max(sum(len(t) for t in mb.tokens) for mb in micro_batches)
        entries = []
        for mb in micro_batches:
            inputs, targets = self._model_inputs(mb, row_length=length)
            entries.append({name: inputs[name] for name in ("input_ids", "position_ids", "predict_index", "packing")}
                           | {"head": self._head_request(mb, targets, None, entropy_grad, top_k)})
        return entries

    # ---- micro-batches -------------------------------------------------------------------
    def _rank_share(self, batch: TrainBatch) -> TrainBatch:
        """This data rank's share (the ranks of a tensor-parallel group get the same one)."""
        shares = self.dims.dp
        if shares == 1:
            return batch
        rank = self.dims.dp_rank
        if self.settings.balance_data:
            return batch.select(balanced_partition([len(t) for t in batch.tokens], shares)[rank])
        return batch.select(range(rank, len(batch), shares))

    def _plan(self, batch: TrainBatch, max_tokens: int | None, at_least: int = 1) -> list[list[int]]:
        if max_tokens is None:
            size = self.settings.micro_batch_size
            groups = [list(range(s, min(s + size, len(batch)))) for s in range(0, len(batch), size)]
            return groups + [[] for _ in range(at_least - len(groups))]
        lengths = [len(t) for t in batch.tokens]
        if max(lengths, default=0) > max_tokens and not self._warned_oversized:
            self._warned_oversized = True
            logger.warning("a sample of %d tokens exceeds the micro-batch budget of %d (--max-tokens-per-gpu / "
                           "--log-probs-max-tokens-per-gpu): it is computed alone; raise the budget if memory allows",
                           max(lengths), max_tokens)
        return plan_token_budget(lengths, max_tokens, at_least)

    def _micro_batches(self, batch: TrainBatch, max_tokens: int | None, same_count_on_all_ranks: bool,
                       at_least: int = 1) -> list[tuple[list[int], TrainBatch | None]]:
        """``(indices into batch, micro-batch)`` pairs, ``at_least`` of them; a micro-batch is None where this rank
        has nothing left while others still compute (FSDP's collectives need the same number of forwards
        everywhere)."""
        plan = self._plan(batch, max_tokens, at_least)
        if same_count_on_all_ranks and self.sharded:
            count = torch.tensor([len(plan)], device=self.settings.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            if int(count) > len(plan):
                plan = self._plan(batch, max_tokens, int(count))
        return [(group, batch.select(group) if group else None) for group in plan]

    @staticmethod
    def _placeholder(template: TrainBatch, pad_token_id: int) -> TrainBatch:
        """A two-token sample without loss tokens, for a rank's extra forward."""
        return TrainBatch(
            tokens=[[pad_token_id, pad_token_id]], response_lengths=[1], loss_masks=[[0]],
            fields={name: [torch.zeros_like(values[0][:1])] for name, values in template.fields.items()},
            gather_ids=None if template.gather_ids is None else [torch.zeros_like(template.gather_ids[0][:1])],
        )

    @torch.no_grad()
    def _forward_without_grad(self, batch: TrainBatch, top_k: int = 0) -> Iterator[tuple[int, int, int, PerTokenOutputs]]:
        """``(index in batch, row in its micro-batch, response length, outputs)`` per sample, in eval mode."""
        was_training = self.model.training
        self.model.eval()
        budget = self.settings.log_probs_max_tokens_per_gpu or self.settings.max_tokens_per_gpu
        try:
            if self.pipeline is not None:
                yield from self._pipeline_forward_without_grad(batch, budget, top_k)
                return
            with self._cast_once():
                for indices, mb in self._micro_batches(batch, budget, same_count_on_all_ranks=False):
                    with self._routes_replayed(mb):
                        outputs = self._per_token_outputs(mb, entropy_grad=False, top_k=top_k)
                    for row, (index, resp_len) in enumerate(zip(indices, mb.response_lengths)):
                        yield index, row, resp_len, outputs
        finally:
            self.model.train(was_training)

    def _pipeline_forward_without_grad(self, batch: TrainBatch, budget: int | None,
                                       top_k: int) -> Iterator[tuple[int, int, int, PerTokenOutputs]]:
        """`_forward_without_grad` through the pipeline: the last stage's outputs, sent to every stage."""
        micro_batches = self._micro_batches(batch, budget, same_count_on_all_ranks=False)
        chunks = [mb for _, mb in micro_batches]
        outputs = self.pipeline.run(self._pipeline_inputs(chunks, entropy_grad=False, top_k=top_k), None)
        per_token = [PerTokenOutputs(*(t.cpu() if t is not None else None
                                       for t in self._token_outputs(mb, TokenLogProbs(*out), None)))
                     for mb, out in zip(chunks, outputs)] if self.pipeline.stage.last else None
        per_token = self.pipeline.broadcast_from_last(per_token)
        for (indices, mb), out in zip(micro_batches, per_token):
            for row, (index, resp_len) in enumerate(zip(indices, mb.response_lengths)):
                yield index, row, resp_len, out

    def compute_log_probs(self, batch: TrainBatch, top_k: int = 0) -> LogProbs:
        """Per-sample log-probs and entropies (and log-probs at ``batch.gather_ids``, and the
        ``top_k`` most likely tokens); every rank computes the whole batch so that all ranks hold
        the same values without a gather."""
        if self.value_head:
            raise TypeError("a critic has no log-probs; use compute_values")
        self.reload()
        wanted = ["primary", "entropy"] + (["gathered"] if batch.gather_ids is not None else []) + \
            (["top_log_probs", "top_ids"] if top_k else [])
        columns: dict[str, list[torch.Tensor | None]] = {name: [None] * len(batch) for name in wanted}
        for index, row, resp_len, outputs in self._forward_without_grad(batch, top_k):
            for name in wanted:
                columns[name][index] = getattr(outputs, name)[row, :resp_len].cpu()
        return LogProbs(columns["primary"], columns["entropy"], columns.get("gathered"), columns.get("top_log_probs"),
                        columns.get("top_ids"))

    def compute_values(self, batch: TrainBatch) -> list[torch.Tensor]:
        """The critic's per-sample values ``[T_i]`` of the response tokens."""
        if not self.value_head:
            raise TypeError("this backend has no value head")
        self.reload()
        values: list[torch.Tensor | None] = [None] * len(batch)
        for index, row, resp_len, outputs in self._forward_without_grad(batch):
            values[index] = outputs.primary[row, :resp_len].cpu()
        return values

    # ---- training ------------------------------------------------------------------------
    def _micro_batch_tensors(self, mb: TrainBatch, response_mask: torch.Tensor, num_samples: int, num_tokens: int):
        """The loss mask and the per-token fields as ``[B, R, ...]``, padded on the host and copied once each."""
        device, width = self.settings.device, response_mask.shape[1]
        dtype = response_mask.dtype
        mask = to_device(padded_rows(mb.loss_masks, width, dtype), device)
        fields = {name: to_device(padded_rows(values, width, dtype), device) for name, values in mb.fields.items()}
        return MicroBatchTensors(mask=mask, fields=fields, global_num_samples=num_samples, global_num_tokens=num_tokens)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        self.begin_step(loss_fn, StepCounts(len(batch), batch.num_loss_tokens()))
        self.accumulate(batch, last=True)
        return self.end_step()

    def begin_step(self, loss_fn: LossFn, counts: StepCounts) -> None:
        """Open an optimizer step whose loss divides by ``counts`` (global: all chunks, all ranks); `accumulate`
        adds chunks of its batch, `end_step` applies it."""
        assert self.optimizer is not None and self.scheduler is not None, "a frozen backend cannot train"
        self.reload()
        self.optimizer.zero_grad(set_to_none=True)
        self._open_step = _OpenStep(loss_fn, counts)

    def accumulate(self, batch: TrainBatch, last: bool = False) -> None:
        """Forward and backward of ``batch`` (every rank is given the whole chunk and trains on its share) into the
        open step's gradients; ``last``: no chunk follows, so its last micro-batch reduces the gradients over
        ranks (otherwise `end_step` does)."""
        step = self._open_step
        if step is None:
            raise RuntimeError("accumulate() outside a step: call begin_step() first")
        # (a pipeline's 1F1B schedule needs a micro-batch per stage at least)
        micro_batches = self._micro_batches(self._rank_share(batch), self.settings.max_tokens_per_gpu,
                                            same_count_on_all_ranks=True, at_least=self.dims.pp)
        # rope_scope: a checkpointed layer recomputes in backward with the kernels it ran with
        with rope_scope(self._liger), self._cast_once():
            if self.pipeline is not None:  # (its schedule reduces the gradients after each run)
                totals, last = self._pipeline_gradients(batch, micro_batches, step.loss_fn, step.counts), True
            else:
                totals = self._accumulate_gradients(batch, micro_batches, step.loss_fn, step.counts, reduce=last)
        for name, value in totals.items():
            step.totals[name] = step.totals.get(name, 0.0) + value
        step.seen_samples += len(batch)
        step.seen_tokens += batch.num_loss_tokens()
        step.template, step.reduced = batch, last

    def end_step(self, loss_kind: str | None = None) -> dict[str, float]:
        """Apply the open step: reduce the gradients if the last chunk did not, rescale them and the metrics from
        the counts the step began with to those its chunks held (``loss_kind``: what the loss divides by; None when
        the counts were final), clip, and take the optimizer step; the step's metrics."""
        step, self._open_step = self._open_step, None
        if step is None or step.template is None:
            raise RuntimeError("end_step() of a step without data")
        rescale = None if loss_kind is None else \
            Rescale(step.counts, StepCounts(step.seen_samples, step.seen_tokens), loss_kind)
        if self.pipeline is not None:
            self.pipeline.sum_tied_gradients()
        if self.fsdp and not step.reduced:  # a forward and backward that adds nothing, to reduce over ranks
            with rope_scope(self._liger), self._cast_once():
                self._accumulate_gradients(step.template, [([], None)], step.loss_fn, step.counts, reduce=True)
        if rescale is not None and rescale.gradients != 1.0:
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(rescale.gradients)
        for parameter in self._expert_parameters:
            # FSDP averaged them over the data ranks outside their expert group; they already held the sum over the
            # group's tokens (the all-to-all's backward): an average over all data ranks, as the dense weights get.
            # (FSDP2's set_gradient_divide_factor says the same with NCCL's PreMulSum, which gloo lacks.)
            if parameter.grad is not None:
                parameter.grad.div_(self.dims.ep)
        grad_norm = self._clip_gradients()
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self._skip_nonfinite_step(grad_norm)
        else:
            self._nonfinite_steps_in_a_row = 0
            self.optimizer.step()
        with warnings.catch_warnings():  # (torch warns of a scheduler step before any optimizer step: a skipped one)
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()  # the schedule follows the steps taken or skipped, as a resumed run counts them
        result = self._all_reduce_sum(step.totals)  # (under a pipeline: on the last stage)
        if self.pipeline is not None:
            result = self.pipeline.broadcast_from_last(result)
        if rescale is not None:
            result = {name: value * rescale.metric(name) for name, value in result.items()}
        if skipped:
            result["skipped_nonfinite_grad"] = 1.0
        result["grad_norm"] = grad_norm
        result["lr"] = self.scheduler.get_last_lr()[0]
        return result

    def _skip_nonfinite_step(self, grad_norm: float) -> None:
        """A NaN or an infinity in the gradients (a loss that overflowed, NaN rewards or advantages): the optimizer
        would write it into every weight it updates, and the engine would sample from NaN weights from then on (a
        run had failed steps later, in sampling, on a token id past the vocabulary). Every rank sees the same global
        norm, so all skip together; the weights and the optimizer's state stay as they were."""
        self._nonfinite_steps_in_a_row += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self._nonfinite_steps_in_a_row >= MAX_NONFINITE_STEPS_IN_A_ROW:
            raise RuntimeError(f"the gradient norm was {grad_norm} at {self._nonfinite_steps_in_a_row} optimizer steps "
                               "in a row, each skipped: every step's loss is broken (look for NaN or infinite "
                               "rewards, advantages or a custom loss in the step's metrics); the weights were not "
                               "changed by those steps")
        logger.warning("optimizer step skipped: the gradient norm is %s (%d in a row; the run fails at %d); the "
                       "weights are unchanged", grad_norm, self._nonfinite_steps_in_a_row, MAX_NONFINITE_STEPS_IN_A_ROW)

    def measure_step_memory(self, token_counts: tuple[int, ...]) -> list[int] | None:
        """Peak bytes a micro-batch of each of ``token_counts`` tokens (one sample) needs above what the trainer holds
        between steps, as a step's second and later micro-batches see it: the gradients the earlier ones made, beside
        its own activations. On CUDA; None elsewhere, or for a pipeline (its stages hold several micro-batches). The
        probe of the run's memory plan (`relax.core.loops.memory_plan`): every rank calls it at the same point, as a
        step's collectives need. The weights do not change (the loss is zero); the gradients are dropped after.

        A first pass makes the gradients before any is measured: a step's first micro-batch frees its activations
        while its backward makes the gradients, so its peak holds only part of them, and a line through such peaks
        missed the gradients whole (15 GiB of float32 on the Qwen3-4B shape). Under FSDP the passes accumulate
        without reducing, as a step's micro-batches before its last do (their gradients unsharded), and a last pass
        reduces them so that FSDP lets its unsharded copies go."""
        device = self.settings.device
        if device.type != "cuda" or self.pipeline is not None or not self.trainable:
            return None
        generator = torch.Generator().manual_seed(0)
        self.model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device)  # between steps: no gradients
        peaks = []
        try:
            if self.fsdp:
                self.model.set_requires_gradient_sync(False)
            self._probe_pass(min(token_counts), generator)  # the gradients a step's first micro-batch leaves
            for count in token_counts:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                self._probe_pass(count, generator)
                torch.cuda.synchronize(device)
                peaks.append(torch.cuda.max_memory_allocated(device) - held)
            if self.fsdp:
                self.model.set_requires_gradient_sync(True)
                self._probe_pass(min(token_counts), generator)
        finally:
            if self.fsdp:
                self.model.set_requires_gradient_sync(True)
            self.model.zero_grad(set_to_none=True)
        return peaks

    def keep_logits(self, enabled: bool) -> None:
        """Whether the LM head keeps its chunks' logits for the backward from the next forward on (the memory plan
        decides `--log-probs-keep-logits auto`)."""
        if enabled and not self.settings.log_probs_chunk_size:
            raise ValueError("kept logits need a log-probs chunk size above 0")
        self.settings = dataclasses.replace(self.settings, log_probs_keep_logits=enabled)

    def _probe_pass(self, count: int, generator: torch.Generator) -> None:
        """`measure_step_memory`'s forward and backward of one text sample of ``count`` random tokens (every
        response token but the first), its loss zero. The ids are drawn from the input embedding's rows: a
        multimodal family's top-level config holds no vocabulary size (Qwen2.5-VL's is in its text config), and the
        probe that read it there failed on them, which left their runs unplanned."""
        vocab = self.model.hf_model.get_input_embeddings().num_embeddings
        ids = torch.randint(vocab, (count,), generator=generator).tolist()
        batch = TrainBatch(tokens=[ids], response_lengths=[count - 1], loss_masks=[[1] * (count - 1)])
        with rope_scope(self._liger), self._cast_once():
            outputs = self._per_token_outputs(batch, self.settings.entropy_grad)
            (outputs.primary.float().sum() * 0.0).backward()

    def _accumulate_gradients(self, batch: TrainBatch, micro_batches, loss_fn: LossFn, counts: StepCounts,
                              reduce: bool) -> dict[str, torch.Tensor]:
        """Forward and backward of every micro-batch (None: a placeholder); the summed metrics. ``reduce``: the
        last micro-batch reduces the accumulated gradients over ranks."""
        entropy_grad = self.settings.entropy_grad
        totals: dict[str, torch.Tensor] = {}
        for index, (_, mb) in enumerate(micro_batches):
            if self.fsdp:  # reduce gradients across ranks once, on the last micro-batch
                self.model.set_requires_gradient_sync(reduce and index == len(micro_batches) - 1)
            placeholder = mb is None
            if placeholder:
                mb = self._placeholder(batch, self.settings.pad_token_id)
            # through backward: checkpointed layers route again when they recompute
            with self._routes_replayed(mb):
                loss, metrics = self._micro_batch_loss(mb, loss_fn, entropy_grad, counts.samples, counts.tokens)
                if placeholder:  # a forward and backward for the collectives, adding nothing
                    loss = loss * 0.0
                    metrics = {name: value * 0.0 for name, value in metrics.items()}
                # Each data rank's loss is its share of the global mean (global denominators): the gradient
                # must be the sum over data ranks, and FSDP's reduction averages over them, hence the factor.
                (loss * self.dims.dp).backward()
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + value.detach().float()
        return totals

    def _pipeline_gradients(self, batch: TrainBatch, micro_batches, loss_fn: LossFn,
                            counts: StepCounts) -> dict[str, torch.Tensor]:
        """`_accumulate_gradients` through the pipeline: the last stage takes each micro-batch's loss as its outputs
        come (the metrics are summed there; the other stages return none)."""
        chunks = [mb if mb is not None else self._placeholder(batch, self.settings.pad_token_id)
                  for _, mb in micro_batches]
        totals: dict[str, torch.Tensor] = {}

        def loss(outputs: tuple[torch.Tensor, ...], index: int) -> torch.Tensor:
            mb = chunks[index]
            value, metrics = self._loss_of(mb, self._token_outputs(mb, TokenLogProbs(*outputs), None), loss_fn,
                                           counts.samples, counts.tokens)
            if micro_batches[index][1] is None:  # a placeholder: adds nothing
                value, metrics = value * 0.0, {name: v * 0.0 for name, v in metrics.items()}
            for name, v in metrics.items():
                totals[name] = totals.get(name, 0.0) + v.detach().float()
            return value * self.dims.dp  # (as `_accumulate_gradients`: FSDP averages over the data ranks)

        self.pipeline.run(self._pipeline_inputs(chunks, self.settings.entropy_grad), loss)
        return totals

    def _micro_batch_loss(self, mb: TrainBatch, loss_fn: LossFn, entropy_grad: bool, num_samples: int,
                          num_tokens: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self._loss_of(mb, self._per_token_outputs(mb, entropy_grad), loss_fn, num_samples, num_tokens)

    def _loss_of(self, mb: TrainBatch, outputs: PerTokenOutputs, loss_fn: LossFn, num_samples: int,
                 num_tokens: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        tensors = self._micro_batch_tensors(mb, outputs.response_mask, num_samples, num_tokens)
        if outputs.gathered is not None:
            tensors.fields["gathered_log_probs"] = outputs.gathered
        loss, metrics = loss_fn(tensors, outputs.primary, outputs.entropy)
        if self._moe_aux is not None and self.model.router_logits is not None:
            # the step's loss holds coef x the samples' mean auxiliary loss, as the families' own forward adds it
            routing, padding = self.model.router_logits
            self.model.router_logits = None
            aux = self._moe_aux(routing, padding) * (len(mb) / num_samples)
            loss = loss + self._moe_aux.coef * aux
            metrics = {**metrics, "moe_aux_loss": aux.detach()}
        return loss, metrics

    def _clip_gradients(self) -> float:
        """Clip to ``clip_grad`` (0: no clipping); the global norm. Gradients may live on different meshes (tensor-
        parallel weights on data x tensor, whole ones on data only): each mesh's norm is reduced on its own."""
        by_mesh: dict[object, list[torch.Tensor]] = {}
        for param in self.model.parameters():
            if param.grad is not None:
                by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
        counted = (lambda _: True) if self.pipeline is None else self.pipeline.counted_in_norm
        norms = []
        for params in by_mesh.values():
            grads = [p.grad for p in params if counted(p)]
            if not grads:
                continue
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device=self.settings.device)
        if self.pipeline is not None:  # each stage's weights are its own: the squares summed over the stages
            square = total.square()
            dist.all_reduce(square, group=self.dims.pp_group)
            total = square.sqrt()
        if self.settings.clip_grad > 0:
            for params in by_mesh.values():  # (one foreach over the gradients of one mesh at a time)
                torch.nn.utils.clip_grads_with_norm_(params, self.settings.clip_grad, total)
        return float(total)

    def _all_reduce_sum(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        if not totals:
            return {}
        names = sorted(totals)
        stacked = torch.stack([torch.as_tensor(totals[n], dtype=torch.float32) for n in names]).to(self.settings.device)
        if self.dims.dp > 1:  # over the data ranks (a tensor-parallel group's ranks hold the same sums)
            dist.all_reduce(stacked, group=self.dims.dp_group)
        return dict(zip(names, stacked.tolist()))

    # ---- weights -------------------------------------------------------------------------
    def named_parameters_for_sync(self, dtype: torch.dtype, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        if self.value_head:
            raise TypeError("a critic's weights are not synced to inference engines")
        self.reload()
        # Lazily gathered: with FSDP each parameter is unsharded only when its bucket is built.
        if self.lora is not None:  # the base model's names, adapters merged: engines need no LoRA support
            full = merged_named_weights(self.model.hf_model)
        elif self.pipeline is not None:  # every stage's, sent to all stages one by one
            full = self.pipeline.full_parameters(list(self.model.hf_model.named_parameters()), _whole)
        else:
            full = ((name, _whole(param)) for name, param in self.model.hf_model.named_parameters())
        yield from bucketize(full, bucket_bytes, dtype)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the unsharded HF state dict on CPU (every rank gets it)."""
        self.reload()
        if self.pipeline is not None:  # (every name of a tied weight, as the state dict has them)
            return {name: tensor.cpu().clone() for name, tensor in self.pipeline.full_parameters(
                list(self.model.hf_model.named_parameters(remove_duplicate=False)), _whole)}
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # At world size 1 on CPU the "gathered" tensors can alias the live parameters: copy them.
        return {name.removeprefix("hf_model."): tensor.clone() for name, tensor in state.items()}

    # ---- checkpoints ---------------------------------------------------------------------
    def save(self, directory: Path, include_optimizer: bool = True, asynchronous: bool = False) -> list[Future]:
        """Weights (and optimizer and LR schedule) into ``directory`` (`checkpoint_state.save_state`)."""
        self.reload()
        optimizer = self.optimizer if include_optimizer else None
        return save_state(Path(directory), self.model, optimizer, self.scheduler, self._state_dict_options(),
                          asynchronous)

    def load(self, directory: Path, include_optimizer: bool = True) -> None:
        self.reload()
        optimizer = self.optimizer if include_optimizer else None
        load_state(Path(directory), self.model, optimizer, self.scheduler, self._state_dict_options())

    def _state_dict_options(self) -> StateDictOptions:
        """A LoRA checkpoint holds the adapters only (the base weights are the --hf-checkpoint's): frozen weights
        are left out, and the load leaves them as they are."""
        if self.lora is not None:
            return StateDictOptions(ignore_frozen_params=True, strict=False)
        return StateDictOptions()


def _whole(parameter: torch.Tensor) -> torch.Tensor:
    """A parameter's full tensor (gathered from its shards: a collective over its mesh), without autograd."""
    return (parameter.full_tensor() if isinstance(parameter, DTensor) else parameter).detach()
