"""The trainer's optimizer and learning-rate schedule: AdamW (fused on CUDA, foreach elsewhere) over the
parameters that train, with linear warmup then a constant or cosine rate."""

from __future__ import annotations

import math

import torch
from torch import nn

from relax.backends.training.settings import TrainSettings


def lr_lambda(step: int, warmup: int, total: int, style: str, min_ratio: float) -> float:
    """LR multiplier at optimizer step ``step`` (0-based): linear warmup, then constant or cosine."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if style == "constant":
        return 1.0
    progress = min(max(step - warmup, 0) / max(total - warmup, 1), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))



def build_optimizer(model: nn.Module, settings: TrainSettings) -> tuple[torch.optim.Optimizer,
                                                                       torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``model``'s parameters that require gradients, and its schedule (`lr_lambda`)."""
    fused = settings.fused_optimizer and settings.device.type == "cuda"
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=settings.lr, betas=settings.adam_betas,
        eps=settings.adam_eps, weight_decay=settings.weight_decay, **({"fused": True} if fused else {"foreach": True}),
    )
    min_ratio = settings.min_lr / settings.lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_lambda(step, settings.lr_warmup_steps, settings.total_optimizer_steps, settings.lr_decay_style,
                               min_ratio),
    )
    return optimizer, scheduler
