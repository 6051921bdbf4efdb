"""Pipeline parallelism (``--pipeline-model-parallel-size``): the decoder's layers in contiguous stages, one per rank
of the mesh's ``pp`` axis, run by `torch.distributed.pipelining`'s 1F1B schedule over packed micro-batches.

- `stage_layers`: which layers each stage holds (as even as the count allows, or upstream's
  ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` for the two ends, which also hold
  the embedding and the LM head);
- `keep_stage`: the Hugging Face model keeps its structure: the layers of other stages become parameter-free
  pass-throughs (`SkippedLayer`), and the token embedding (unless first) and the final norm and LM head (unless
  last) go. Every name stays the model's own (``model.layers.7.mlp.up_proj.weight``), so a DCP checkpoint saved at
  one layout loads at any other and weight sync renames nothing. A model that ties its LM head to its embedding
  (Qwen3 up to 4B) keeps the embedding on the last stage too, as the head's weight under the embedding's name: the two
  end stages hold one copy each, their gradients are summed (`PipelineRunner.sum_tied_gradients`), and the same
  AdamW step keeps them equal; a checkpoint holds it once, under the same names as without pipelining;
- `PipelineStageModel`: a stage's forward: token ids (first stage) or the previous stage's hidden states in; hidden
  states out, or on the last stage the log-probs and entropies at the response positions, the LM head chunked as
  without pipelining (no full-vocabulary logits);
- `PipelineRunner`: builds the schedule for a step's micro-batches with their shapes given (packed rows padded to
  one length: a stage's receive buffers have one shape per step), so no shape-inference forward runs; the loss is
  taken on the last stage, micro-batch by micro-batch, by the trainer's own loss code.

Not built yet (refused naming the flag): images / video / audio (the towers run in the multimodal model's top-level forward), routing replay and an
MoE auxiliary loss (both read state across the whole forward), padded micro-batches, and pipeline with context
parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from relax.backends.training.mesh import PP_FLAG
from relax.backends.training.response_model import (
    HeadRequest,
    language_model,
    packed_mask_placeholder,
    ties_embeddings,
)
from relax.backends.training.varlen_attention import PACKING_KWARG, use_packed_attention

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"


def stage_layers(num_layers: int, stages: int, first: int | None = None, last: int | None = None) -> list[range]:
    """The decoder layers of each stage: ``first`` / ``last`` layers on the two end stages when given, the rest
    spread evenly (earlier stages take the remainder)."""
    if stages > num_layers:
        raise ValueError(f"{PP_FLAG} {stages} exceeds the model's {num_layers} decoder layers: every stage needs one")
    counts: list[int | None] = [None] * stages
    for index, count, flag in ((0, first, FIRST_FLAG), (stages - 1, last, LAST_FLAG)):
        if count is not None:
            if stages == 1:
                raise ValueError(f"{flag} needs {PP_FLAG} > 1")
            if count < 1:
                raise ValueError(f"{flag} must be at least 1")
            counts[index] = count
    fixed = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    rest = num_layers - fixed
    if rest < len(free) or (not free and rest):
        raise ValueError(f"{FIRST_FLAG} / {LAST_FLAG} leave {rest} of the model's {num_layers} layers for "
                         f"{len(free)} other stages: each needs one, and all layers must be placed")
    for position, index in enumerate(free):
        counts[index] = rest // len(free) + (position < rest % len(free))
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


class SkippedLayer(nn.Module):
    """A decoder layer another stage holds: its hidden states pass through. It keeps the attributes the decoder's
    loop reads off a layer (its attention type)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for name in ("attention_type", "layer_idx", "layer_type"):
            if hasattr(layer, name):
                setattr(self, name, getattr(layer, name))

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


def keep_stage(hf_model: nn.Module, layers: range, first: bool, last: bool) -> None:
    """Strip ``hf_model`` to one stage in place: only ``layers`` of its decoder, the embedding if ``first`` (or if
    ``last`` and the head's weight is the embedding's), the final norm and LM head if ``last``."""
    decoder = language_model(hf_model)
    for index, layer in enumerate(decoder.layers):
        if index not in layers:
            decoder.layers[index] = SkippedLayer(layer)
    if not first and not (last and ties_embeddings(hf_model)):
        decoder.embed_tokens = None
    if not last:
        decoder.norm = nn.Identity()
        hf_model.set_output_embeddings(None)


class PipelineStageModel(nn.Module):
    """One stage of the policy (`ResponseLogitsModel` split by layers); ``hf_model`` keeps its name, so the state
    dict's keys are the unsplit model's."""

    def __init__(self, hf_model: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        # an end stage of a model whose head is its embedding: the embedding is on both end stages, kept equal
        self.tied = ties_embeddings(hf_model) and first != last
        keep_stage(hf_model, layers, first, last)
        self.hf_model = hf_model
        self.first, self.last = first, last
        use_packed_attention(language_model(hf_model))
        # The step's micro-batches (`PipelineRunner.run`): what a forward is given besides its activation, found by
        # the micro-batch's index (the schedule splits only tensors along their first dimension: packed rows'
        # boundaries, response positions and head requests differ from one micro-batch to the next).
        self.micro_batches: list[dict] = []

    def forward(self, activation: torch.Tensor, micro_batch: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``activation``: token ids ``[1, N]`` (first stage) or hidden states ``[1, N, H]`` of micro-batch
        ``micro_batch`` (its index, ``[1]`` on the host). Returns hidden states ``[1, N, H]``, or on the last stage
        ``(log_probs [M, K], entropy [M])`` (with the top-k log-probs and ids when the head asks for them)."""
        inputs = self.micro_batches[int(micro_batch)]
        entry = {"input_ids": activation} if self.first else {"inputs_embeds": activation}
        hidden = language_model(self.hf_model)(
            **entry, attention_mask=packed_mask_placeholder(activation.device), position_ids=inputs["position_ids"],
            use_cache=False, **{PACKING_KWARG: inputs["packing"]}).last_hidden_state
        if not self.last:
            return hidden
        head: HeadRequest = inputs["head"]
        out = head.apply(hidden.flatten(0, 1).index_select(0, inputs["predict_index"]),
                         self.hf_model.get_output_embeddings().weight)
        # plain tensors: the schedule detaches a last stage's outputs after its backward
        return (out.log_probs, out.entropy) + ((out.top_log_probs, out.top_ids) if head.top_k else ())


class PipelineRunner:
    """Runs a step's micro-batches through this rank's stage (`PipelineStageModel`, FSDP-wrapped or not) with the
    ranks of its pipeline group."""

    def __init__(self, stage: PipelineStageModel, group: dist.ProcessGroup, device: torch.device, hidden_size: int,
                 compute_dtype: torch.dtype, end_stages: dist.ProcessGroup | None = None):
        """``end_stages``: this pipeline's first and last stage (on those; None elsewhere), for a tied embedding."""
        self.stage, self.group, self.end_stages = stage, group, end_stages
        self.device, self.hidden_size, self.compute_dtype = device, hidden_size, compute_dtype

    @property
    def index(self) -> int:
        return self.group.rank()

    @property
    def stages(self) -> int:
        return self.group.size()

    @property
    def last_rank(self) -> int:
        """The global rank of this pipeline's last stage (where losses and log-probs are)."""
        return dist.get_global_rank(self.group, self.stages - 1)

    def _pipeline_stage(self, first: dict, grad: bool) -> PipelineStage:
        """The stage for micro-batches shaped like ``first``, its shapes given (no shape-inference forward)."""
        def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            # (a float one requires grad when there is a backward: the received activations' buffers take that)
            return torch.empty(*shape, dtype=dtype, device="meta").requires_grad_(dtype.is_floating_point and grad)

        tokens = first["input_ids"].shape[1]
        hidden = meta(1, tokens, self.hidden_size, dtype=self.compute_dtype)
        inputs = meta(1, tokens, dtype=torch.long) if self.stage.first else hidden
        outputs = hidden
        if self.stage.last:  # (the last stage's outputs go to the loss, not to a peer: their shapes may vary)
            positions, head = first["predict_index"].numel(), first["head"]
            outputs = (meta(positions, head.ids.shape[1]), meta(positions)) + \
                ((meta(positions, head.top_k), meta(positions, head.top_k, dtype=torch.long)) if head.top_k else ())
        return PipelineStage(self.stage, self.index, self.stages, self.device, input_args=inputs,
                             output_args=outputs, group=self.group)

    def run(self, inputs: list[dict],
            loss: Callable[[tuple[torch.Tensor, ...], int], torch.Tensor] | None) -> list[tuple[torch.Tensor, ...]]:
        """Forward (and with ``loss``, backward) of every micro-batch; ``inputs[i]`` holds micro-batch i's
        ``input_ids`` (the first stage's input), ``position_ids``, ``predict_index``, ``packing`` and ``head``, all
        rows of one length. ``loss(outputs, i)`` is taken on the last stage. Returns the last stage's outputs per
        micro-batch (none elsewhere)."""
        stage = self._pipeline_stage(inputs[0], grad=loss is not None)
        count = len(inputs)
        if loss is None:
            schedule = ScheduleGPipe(stage, count)
        else:  # gradients are the losses' sum: the trainer's loss divides by the global batch already
            schedule = Schedule1F1B(stage, count, loss_fn=lambda out, index: loss(out, int(index)),
                                    scale_grads=False)
        self.stage.micro_batches = inputs
        index = torch.arange(count)  # split into one index per micro-batch, the loss's "target" too
        try:
            schedule.step(*((torch.cat([mb["input_ids"] for mb in inputs]),) if self.stage.first else ()),
                          micro_batch=index, target=index if loss is not None else None,
                          return_outputs=loss is None)
            return list(stage.output_chunks) if self.stage.last else []
        finally:
            self.stage.micro_batches = []

    def sum_tied_gradients(self) -> None:
        """The tied embedding's gradient summed over the two end stages (its use as the embedding on the first, as
        the LM head on the last), so that both copies take the same step. Once per optimizer step."""
        if not self.stage.tied or self.end_stages is None:
            return
        weight = language_model(self.stage.hf_model).embed_tokens.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        local = weight.grad.to_local() if hasattr(weight.grad, "to_local") else weight.grad
        dist.all_reduce(local, group=self.end_stages)

    def counted_in_norm(self, parameter: torch.Tensor) -> bool:
        """Whether ``parameter`` counts in the gradient norm here: the tied embedding counts on the first stage
        only (the last holds the same gradient)."""
        return not (self.stage.tied and self.stage.last and
                    parameter is language_model(self.stage.hf_model).embed_tokens.weight)

    def broadcast_from_last(self, value: object) -> object:
        """``value`` of the last stage, on every stage of this pipeline."""
        holder = [value]
        dist.broadcast_object_list(holder, src=self.last_rank, group=self.group)
        return holder[0]

    def full_parameters(self, parameters: Sequence[tuple[str, torch.Tensor]],
                        whole: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every stage's parameters ``(name, full tensor)``, stage by stage, on every rank of the pipeline, gathered
        one at a time (``parameters``: this stage's, sharded or not; ``whole``: the full tensor of one of them, a
        collective over the stage's own ranks). Collective over the pipeline group: its ranks iterate together."""
        local = dict(parameters)
        everyone: list = [None] * self.stages
        dist.all_gather_object(everyone, [(name, tuple(t.shape), t.dtype) for name, t in parameters],
                               group=self.group)
        seen = set()  # (a tied embedding is on two stages: sent once)
        for index, entries in enumerate(everyone):
            source = dist.get_global_rank(self.group, index)
            for name, shape, dtype in entries:
                if name in seen:
                    continue
                seen.add(name)
                tensor = whole(local[name]).contiguous() if index == self.index else \
                    torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(tensor, src=source, group=self.group)
                yield name, tensor
