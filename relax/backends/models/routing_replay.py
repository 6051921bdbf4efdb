"""Mixture-of-experts routing recorded by the engine and replayed by the trainer: rollout routing replay ("R3",
upstream's ``--use-rollout-routing-replay``; SGLang's ``return_routed_experts``).

A router picks each token's top-k experts from scores that differ in the last bits between the engine's cached
decoding and the trainer's full forward (other kernels, other batch shapes, bf16). Where two experts are nearly
tied the two sides pick different experts, and the token's log-prob jumps: the trainer's policy is then not the
one that sampled the response. With replay, the engine records which experts every MoE layer chose for every
token it fed through the model, and the trainer's forward of the policy uses those experts; the routing weights
(and their gradient into the router) are still computed from the trainer's own router scores at those experts.

Routed experts of a sequence of ``T`` tokens: an integer tensor ``[T - 1, L, k]`` (token, MoE layer, slot), for
every token but the last (the last token is never fed to the model in rollout). ``-1`` marks a slot that was not
recorded; the trainer's own choice stands there. Over HTTP they travel as SGLang does: base64 of the int32 bytes
of that array, flattened, in ``meta_info["routed_experts"]``.

Routers are found by class (transformers' ``*TopKRouter`` / ``*TopkRouter`` modules, which return
``(router_logits, routing_weights, expert_indices)`` for the flattened tokens of a forward); in model order, the
l-th router is MoE layer l on both sides.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

NOT_RECORDED = -1


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's expert routers, in layer order (empty for a dense model)."""
    return [module for module in model.modules() if type(module).__name__.lower().endswith("topkrouter")]


def routing_shape(model: nn.Module) -> tuple[int, int]:
    """``(L, k)``: the number of MoE layers and of experts each token takes."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts routers: there is no routing to replay")
    return len(routers), int(routers[0].top_k)


def replayed_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The routing weights ``[N, k]`` that ``router`` gives the tokens whose scores are ``logits`` ``[N, E]`` when
    they go to ``experts`` ``[N, k]``: its own formula at other indices, so the same values as its forward when the
    indices are its own, and the same gradient into the router."""
    if hasattr(router, "e_score_correction_bias"):
        # DeepSeek-V3 / GLM: sigmoid scores; the correction bias only steers the choice, it is not in the weights
        weights = logits.float().sigmoid().gather(-1, experts)
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * router.routed_scaling_factor
    # Qwen MoE families: softmax over all experts, renormalised over the chosen ones (Qwen3-VL-MoE always does)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


class RoutingRecorder:
    """Records the experts every router of ``model`` chooses while `recording`: `take` returns those of the last
    forward as ``[N, L, k]`` (N: the forward's tokens, flattened as the model flattens ``[B, S]``)."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts routers to record")
        self._chosen: list[torch.Tensor | None] = [None] * len(self.routers)

    @contextmanager
    def recording(self) -> Iterator[RoutingRecorder]:
        handles = [router.register_forward_hook(self._hook(layer)) for layer, router in enumerate(self.routers)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, layer: int):
        def record(module, inputs, output):
            self._chosen[layer] = output[2]
        return record

    def take(self) -> torch.Tensor:
        if any(chosen is None for chosen in self._chosen):
            raise RuntimeError("a forward did not reach every router")
        chosen, self._chosen = self._chosen, [None] * len(self.routers)
        return torch.stack(chosen, dim=1)


class RoutingReplay:
    """Makes every router of ``model`` take given experts while `replaying` (forward and, with activation
    checkpointing, the recomputation in backward)."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts routers: there is no routing to replay")
        self.shape = (len(self.routers), int(self.routers[0].top_k))  # (L, k)
        self._routes: torch.Tensor | None = None  # [N, L, k]
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    @contextmanager
    def replaying(self, routes: torch.Tensor | None) -> Iterator[None]:
        """``routes`` ``[N, L, k]`` on the model's device (None: the routers choose)."""
        self._routes = routes
        try:
            yield
        finally:
            self._routes = None

    def _hook(self, layer: int):
        def replay(module, inputs, output):
            if self._routes is None:
                return None
            logits, weights, experts = output
            routes = self._routes[:, layer]
            if routes.shape[0] != experts.shape[0]:
                raise ValueError(f"routing replay: MoE layer {layer} routes {experts.shape[0]} tokens, but "
                                 f"{routes.shape[0]} token routes were given")
            recorded = (routes >= 0).all(dim=-1, keepdim=True)
            chosen = torch.where(recorded, routes.long(), experts)
            replayed = replayed_weights(module, logits, chosen)
            return logits, torch.where(recorded, replayed.to(weights.dtype), weights), chosen
        return replay


def token_routes(routed: Sequence[torch.Tensor], lengths: Sequence[int], shape: tuple[int, int], packed: bool,
                 device: torch.device) -> torch.Tensor:
    """The routes ``[N, L, k]`` of a micro-batch's tokens in the layout of its forward: sequences one after the
    other (``packed``), or right-padded rows of the longest length; ``-1`` at each sequence's last token and on
    padding. ``routed[i]`` holds sequence i's ``[lengths[i] - 1, ...]`` routes (any layout of that many values)."""
    layers, top_k = shape
    width = sum(lengths) if packed else max(lengths)
    rows = 1 if packed else len(lengths)
    routes = torch.full((rows, width, layers, top_k), NOT_RECORDED, dtype=torch.int16)
    offset = 0
    for index, (sequence, length) in enumerate(zip(routed, lengths, strict=True)):
        if sequence.numel() != (length - 1) * layers * top_k:
            raise ValueError(f"routing replay: a sample of {length} tokens carries {sequence.numel()} routed "
                             f"expert ids, not {length - 1} tokens x {layers} MoE layers x {top_k} experts (the "
                             "engine records every token but the last)")
        row, start = (0, offset) if packed else (index, 0)
        routes[row, start:start + length - 1] = sequence.reshape(length - 1, layers, top_k)
        offset += length
    return routes.reshape(rows * width, layers, top_k).to(device, non_blocking=True)


def encode_routes(routes: torch.Tensor) -> str:
    """SGLang's wire format: base64 of the int32 bytes, flattened."""
    return base64.b64encode(routes.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode_routes(payload: str) -> torch.Tensor:
    """The flat int16 routes of `encode_routes`' payload (the consumer knows ``(L, k)`` and reshapes)."""
    array = np.frombuffer(base64.b64decode(payload), dtype=np.int32)
    return torch.from_numpy(array.astype(np.int16))
