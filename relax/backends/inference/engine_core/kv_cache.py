"""The paged KV pool's storage: one layer's keys and values, in the model's dtype or in FP8 (``--kv-cache-dtype``).

Decode at batch 256 reads every sequence's K/V at every step: on the Qwen3-4B shape that is 4.5 ms of a ~10 ms
step at the card's bandwidth, more than the weights. ``fp8_e4m3`` (SGLang's and vLLM's name) stores each key and
value vector of a head in one byte per entry with a float32 scale of its own (``amax / 448``, computed when the
vector is written), so the attention reads half the bytes and no calibration is needed: a head vector's scale
follows its own values, whatever the weights. The scales cost 4 bytes per 128-entry vector (3%). Readers
dequantize (``fp8 * scale``) in registers (the Triton decode kernel) or when gathering (prefill, the CPU path); the
keys' scale multiplies the scores and the values' scale the probabilities, so the products stay in bf16.

The trainer's forward keeps its bf16 K/V: the difference is part of the train/rollout mismatch ``--use-tis``
corrects and reports (`train/tis_mismatch_kl`), as for ``--rollout-fp8``'s weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax.backends.inference.engine_core.fp8_format import FP8, quantize_rows
from relax.utils.memory import free_bytes, total_bytes

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def check_kv_cache_dtype(cache_dtype: str) -> None:
    if cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {cache_dtype!r}")


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, cache_dtype: str) -> int:
    """Bytes one token's K/V takes in the pool, every layer (the FP8 scales included)."""
    if cache_dtype == "fp8_e4m3":
        return 2 * layers * kv_heads * (head_dim + 4)
    return 2 * layers * kv_heads * head_dim * dtype.itemsize


def pool_problem(tokens: int, token_bytes: int, device: torch.device, whole_device: bool = False) -> str | None:
    """Why a pool of ``tokens`` cannot be allocated on ``device`` (more bytes than are free now; with
    ``whole_device``, than a CUDA device has at all), or None."""
    on_whole = whole_device and device.type == "cuda"
    room = total_bytes(device) if on_whole else free_bytes(device)
    need = tokens * token_bytes
    if room is None or need <= room:
        return None
    return (f"a KV pool of {tokens:,} tokens takes {need / 2**30:.1f} GiB ({token_bytes:,} bytes a token) and "
            f"{room / 2**30:.1f} GiB {'is all' if on_whole else 'are free'} on {device}")


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H, D]`` as FP8 with one float32 scale per head vector ``[T, H]`` (``x ~ fp8 * scale``): each head
    vector a row of `quantize_rows`."""
    quantized, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return quantized.view(x.shape), scale.view(x.shape[:-1])


@dataclass
class LayerKV:
    """One layer's pool: ``keys``/``values [slots, Hkv, D]``; with FP8 also ``key_scales``/``value_scales
    [slots, Hkv]`` float32."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.key_scales is not None

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values [T, Hkv, D]`` at ``slots [T]``."""
        if not self.quantized:
            self.keys.index_copy_(0, slots, keys)
            self.values.index_copy_(0, slots, values)
            return
        keys, key_scales = quantize_heads(keys)
        values, value_scales = quantize_heads(values)
        self.key_scales.index_copy_(0, slots, key_scales)
        self.value_scales.index_copy_(0, slots, value_scales)
        # FP8 as bytes: indexing kernels are not built for the float8 dtypes
        self.keys.view(torch.uint8).index_copy_(0, slots, keys.view(torch.uint8))
        self.values.view(torch.uint8).index_copy_(0, slots, values.view(torch.uint8))

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V at ``slots`` (any shape ``S``): ``[*S, Hkv, D]`` in ``dtype``."""
        if not self.quantized:
            return self.keys[slots], self.values[slots]
        # in torch operations; on CUDA the attention gathers an FP8 pool with `triton_ops.gather_dequantized`
        keys, values = self.keys.view(torch.uint8)[slots].view(FP8), self.values.view(torch.uint8)[slots].view(FP8)
        return ((keys.float() * self.key_scales[slots][..., None]).to(dtype),
                (values.float() * self.value_scales[slots][..., None]).to(dtype))


class KVPool:
    """Every layer's `LayerKV` over ``slots`` token slots, in one allocation per kind."""

    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 cache_dtype: str, device: torch.device) -> None:
        check_kv_cache_dtype(cache_dtype)
        quantized = cache_dtype == "fp8_e4m3"
        self.kv = torch.zeros((layers, 2, slots, kv_heads, head_dim), dtype=FP8 if quantized else dtype,
                              device=device)
        # ones: a slot never written reads as zeros either way
        self.scales = torch.ones((layers, 2, slots, kv_heads), dtype=torch.float32, device=device) \
            if quantized else None
        self.layers = [LayerKV(self.kv[layer, 0], self.kv[layer, 1],
                               *((self.scales[layer, 0], self.scales[layer, 1]) if quantized else ()))
                       for layer in range(layers)]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + (self.scales.numel() * 4 if self.scales is not None else 0)

    def copy_slots(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy the K/V (and scales) of slots ``source`` into slots ``target``, every layer."""
        data = self.kv.view(torch.uint8) if self.scales is not None else self.kv
        data[:, :, target] = data[:, :, source]
        if self.scales is not None:
            self.scales[:, :, target] = self.scales[:, :, source]
