"""The paged KV pool's storage: one layer's keys and values, in the model's dtype or in FP8 (``--kv-cache-dtype``).

Decode at batch 256 reads every sequence's K/V at every step: on the Qwen3-4B shape that is 4.5 ms of a ~10 ms
step at the card's bandwidth, more than the weights. ``fp8_e4m3`` (SGLang's and vLLM's name) stores each key and
value vector of a head in one byte per entry with a float32 scale of its own (``amax / 448``, computed when the
vector is written), so the attention reads half the bytes and no calibration is needed: a head vector's scale
follows its own values, whatever the weights. The scales cost 4 bytes per 128-entry vector (3%). Readers
dequantize (``fp8 * scale``) in registers (the Triton decode kernel) or when gathering (prefill, the CPU path); the
keys' scale multiplies the scores and the values' scale the probabilities. The FP8 pool stores its values by page
(`LayerKV`), the layout in which the decode kernel reads them without going byte by byte.

The trainer's forward keeps its bf16 K/V: the difference is part of the train/rollout mismatch ``--use-tis``
corrects and reports (`train/tis_mismatch_kl`), as for ``--rollout-fp8``'s weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax.backends.inference.engine_core.fp8_format import FP8, quantize_rows

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def check_kv_cache_dtype(cache_dtype: str) -> None:
    if cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {cache_dtype!r}")


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, cache_dtype: str) -> int:
    """Bytes one token's K/V takes in the pool, every layer (the FP8 scales included)."""
    if cache_dtype == "fp8_e4m3":
        return 2 * layers * kv_heads * (head_dim + 4)
    return 2 * layers * kv_heads * head_dim * dtype.itemsize


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H, D]`` as FP8 with one float32 scale per head vector ``[T, H]`` (``x ~ fp8 * scale``): each head
    vector a row of `quantize_rows`."""
    quantized, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return quantized.view(x.shape), scale.view(x.shape[:-1])


def values_by_page(values: torch.Tensor, page: int) -> torch.Tensor:
    """Slot-major ``values [slots, Hkv, D]`` in the layout an FP8 pool keeps them: ``[blocks, Hkv, D, page]``."""
    slots, kv_heads, dim = values.shape
    return values.view(slots // page, page, kv_heads, dim).permute(0, 2, 3, 1).contiguous()


@dataclass
class LayerKV:
    """One layer's pool: ``keys [slots, Hkv, D]``; ``values`` the same, or ``[blocks, Hkv, D, page]`` when ``page``
    is set (the FP8 pool's: a page's values of one dim contiguous, so that the decode kernel reads them in pairs of
    tokens, as the second product wants them, rather than byte by byte); with FP8 also ``key_scales``/
    ``value_scales [slots, Hkv]`` float32."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None
    page: int | None = None

    @property
    def quantized(self) -> bool:
        return self.key_scales is not None

    @property
    def values_by_page(self) -> bool:
        return self.page is not None

    def _value_index(self, slots: torch.Tensor) -> tuple:
        """Index of the values at ``slots``: ``values[index]`` is ``[*slots.shape, Hkv, D]`` in either layout."""
        if self.page is None:
            return (slots,)
        return (slots // self.page, slice(None), slice(None), slots % self.page)

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values [T, Hkv, D]`` at ``slots [T]``."""
        if self.quantized:
            keys, key_scales = quantize_heads(keys)
            values, value_scales = quantize_heads(values)
            self.key_scales.index_copy_(0, slots, key_scales)
            self.value_scales.index_copy_(0, slots, value_scales)
            # FP8 as bytes: indexing kernels are not built for the float8 dtypes
            keys, values = keys.view(torch.uint8), values.view(torch.uint8)
        key_pool, value_pool = self._raw()
        key_pool.index_copy_(0, slots, keys)
        if self.page is None:
            value_pool.index_copy_(0, slots, values)
        else:
            value_pool[self._value_index(slots)] = values

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V at ``slots`` (any shape ``S``): ``[*S, Hkv, D]`` in ``dtype``."""
        key_pool, value_pool = self._raw()
        keys, values = key_pool[slots], value_pool[self._value_index(slots)]
        if not self.quantized:
            return keys, values
        return ((keys.view(FP8).float() * self.key_scales[slots][..., None]).to(dtype),
                (values.view(FP8).float() * self.value_scales[slots][..., None]).to(dtype))

    def _raw(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pools as indexing kernels take them (FP8 as bytes)."""
        if self.quantized:
            return self.keys.view(torch.uint8), self.values.view(torch.uint8)
        return self.keys, self.values


class KVPool:
    """Every layer's `LayerKV` over ``slots`` token slots (``page`` slots a block), one allocation for the keys
    and one for the values. An FP8 pool stores its values by page (`LayerKV`)."""

    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 cache_dtype: str, device: torch.device, page: int = 16) -> None:
        check_kv_cache_dtype(cache_dtype)
        quantized = cache_dtype == "fp8_e4m3"
        if quantized and slots % page:
            raise ValueError(f"an FP8 KV pool holds whole pages: {slots} slots are not a multiple of {page}")
        kind = FP8 if quantized else dtype
        self.page = page if quantized else None
        self.keys = torch.zeros((layers, slots, kv_heads, head_dim), dtype=kind, device=device)
        value_shape = (layers, slots // page, kv_heads, head_dim, page) if quantized else self.keys.shape
        self.values = torch.zeros(value_shape, dtype=kind, device=device)  # zeros: every slot reads finite
        # ones: a slot never written reads as zeros either way
        self.scales = torch.ones((layers, 2, slots, kv_heads), dtype=torch.float32, device=device) \
            if quantized else None
        self.layers = [LayerKV(self.keys[layer], self.values[layer],
                               *((self.scales[layer, 0], self.scales[layer, 1]) if quantized else (None, None)),
                               page=self.page)
                       for layer in range(layers)]

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.keys, self.values, self.scales) if x is not None)

    def copy_slots(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy the K/V (and scales) of slots ``source`` into slots ``target``, every layer."""
        keys, values = (x.view(torch.uint8) for x in (self.keys, self.values)) if self.scales is not None \
            else (self.keys, self.values)
        keys[:, target] = keys[:, source]
        if self.page is None:
            values[:, target] = values[:, source]
        else:
            page = self.page
            values[:, target // page, :, :, target % page] = values[:, source // page, :, :, source % page]
        if self.scales is not None:
            self.scales[:, :, target] = self.scales[:, :, source]
