"""The check shared by the multimodal rope tests: a model's logits with the 3D positions Relax computes
(`rope_positions`) beside its own forward that computes them itself."""

from __future__ import annotations

import torch

from relax.backends.models.family import forward_inputs, rope_positions


def ours_and_native_logits(model, sample, **native_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of ``sample`` with our positions, and with the model's own (``native_kwargs`` go to that forward)."""
    ids = torch.tensor([sample.tokens])
    mask = torch.ones_like(ids)
    inputs = sample.multimodal_train_inputs
    kwargs = forward_inputs(model, inputs, ids, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask, position_ids=rope_positions(model, ids, mask, inputs),
                     **kwargs).logits
        model.model.rope_deltas = None  # the model caches positions between forwards
        native = model(input_ids=ids, attention_mask=mask, **kwargs, **native_kwargs).logits
        model.model.rope_deltas = None
    return ours, native
