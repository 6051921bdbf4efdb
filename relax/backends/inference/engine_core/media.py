"""A multimodal prompt's inputs to the core: its media features, its 3D rope and the key of its cached blocks.

The vision-language and omni models the core runs (`relax.backends.models.registry.ENGINE_CORE_MULTIMODAL_TYPES`) differ from a text model
only before their language model: the towers encode the media, the features replace the placeholder tokens'
embeddings, and each prompt token gets a (temporal, height, width) rope position. `MediaEncoder` runs the
model's own forward up to its language model and takes what that receives (a forward pre-hook stops the call
there), so the merge and the positions are the family's own code, whatever its release. The core then
prefills the prompt from those embeddings and rope tables, and decodes it as text: every later token sits at
``index + rope_delta`` on all three axes, where multimodal rope equals plain rope.

Prompt blocks are shared by content (`block_manager`), and a placeholder token says nothing about its image:
`MediaPrompt.key_tokens` is the prompt with every placeholder replaced by a value derived from a hash of the
request's media tensors, as SGLang pads image tokens with the image's hash. Blocks before the first placeholder
(a system prompt) stay shared across images; every block from it on is keyed by the media too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

from relax.backends.models.family import MediaTokens, forward_inputs


@dataclass(frozen=True)
class MediaPrompt:
    rows: torch.Tensor  # [M] int64 (device): the prompt positions that hold media features
    features: torch.Tensor  # [M, hidden], the model dtype (device)
    cos: torch.Tensor  # [L, head_dim]: the rope of each prompt position (its 3D position)
    sin: torch.Tensor
    rope_delta: int  # a token at index i >= L sits at rope position i + rope_delta
    key_tokens: tuple[int, ...]  # the prompt's tokens for block keys, placeholders replaced by the media's hash

    @property
    def length(self) -> int:
        return len(self.key_tokens)


class _Reached(Exception):
    def __init__(self, kwargs: dict) -> None:
        super().__init__()
        self.kwargs = kwargs


def media_key(inputs: dict[str, torch.Tensor]) -> int:
    """A 62-bit hash of the processor tensors (names, dtypes, shapes and bytes)."""
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(inputs):
        tensor = torch.as_tensor(inputs[name]).detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return int.from_bytes(digest.digest(), "little") >> 2


class MediaEncoder:
    """``encode(input_ids, inputs) -> MediaPrompt`` for a model whose language model is ``text_model``."""

    def __init__(self, model: nn.Module, text_model: nn.Module) -> None:
        self.model = model
        self.text_model = text_model
        self.placeholder_ids = frozenset(MediaTokens.of(model.config).ids)

    @torch.inference_mode()
    def encode(self, input_ids: list[int], inputs: dict[str, torch.Tensor]) -> MediaPrompt:
        parameter = next(self.model.parameters())
        ids = torch.tensor([input_ids], dtype=torch.long, device=parameter.device)
        kwargs = forward_inputs(self.model, inputs, ids, parameter.device, parameter.dtype)
        handle = self.text_model.register_forward_pre_hook(self._stop, with_kwargs=True)
        try:
            self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **kwargs)
        except _Reached as reached:
            received = reached.kwargs
        else:
            raise RuntimeError(f"{type(self.model).__name__} did not call its language model")
        finally:
            handle.remove()
        embeds, positions = received.get("inputs_embeds"), received.get("position_ids")
        if embeds is None or positions is None or positions.dim() != 3 or positions.shape[-1] != len(input_ids):
            raise RuntimeError(f"{type(self.model).__name__} gave its language model no embeddings or 3D positions")
        positions = positions[-3:]  # some releases put the text positions first, as a fourth row
        cos, sin = self.text_model.rotary_emb(embeds, positions)
        if cos.dim() != 3:
            raise RuntimeError(f"{type(self.text_model.rotary_emb).__name__} does not fold the rope axes itself")
        rows = [i for i, token in enumerate(input_ids) if token in self.placeholder_ids]
        marker = -1 - media_key(inputs)  # negative: never a real token id
        key_tokens = tuple(marker if token in self.placeholder_ids else token for token in input_ids)
        row_tensor = torch.tensor(rows, dtype=torch.long, device=parameter.device)
        return MediaPrompt(rows=row_tensor, features=embeds[0, row_tensor].clone(), cos=cos[0], sin=sin[0],
                           rope_delta=int(positions.max()) + 1 - len(input_ids), key_tokens=key_tokens)

    @staticmethod
    def _stop(module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise _Reached(kwargs)


def merge_media(embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                spans: list[tuple[int, int, int, MediaPrompt]]) -> None:
    """Write each span's media features and prompt rope into a prefill's packed ``embeds [T, hidden]`` and
    ``cos``/``sin [T, D]``, in place. A span ``(offset, start, end, media)``: the sequence's tokens
    ``start..end`` sit at packed rows ``offset..``."""
    for offset, start, end, media in spans:
        stop = min(end, media.length)
        if start >= stop:
            continue
        cos[offset:offset + stop - start] = media.cos[start:stop]
        sin[offset:offset + stop - start] = media.sin[start:stop]
        inside = (media.rows >= start) & (media.rows < stop)
        embeds.index_copy_(0, media.rows[inside] - start + offset, media.features[inside])
