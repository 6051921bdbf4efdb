"""Vectorized next-token sampling with per-row settings (temperature, top-k, top-p, greedy).

Every function works on a decode batch of ``B`` rows over a vocabulary of ``V`` ids and runs on
the logits' device without host synchronization.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch

from relax.backends.inference.base import SamplingParams

FLOAT32_TINY = torch.finfo(torch.float32).tiny


@dataclass
class BatchSampling:
    """The sampling settings of one decode batch, as device tensors aligned with the batch rows.

    The host-side flags let `sample_next_tokens` skip work no row needs (noise when every row is
    greedy, the vocabulary sort when no row filters) without reading the tensors back.
    """

    params: list[SamplingParams]
    temperature: torch.Tensor  # (B, 1) float32; 1.0 on greedy rows so that dividing by it is a no-op
    is_greedy: torch.Tensor  # (B,) bool; temperature == 0
    top_k: torch.Tensor  # (B, 1) int64; tokens of rank >= top_k are dropped; a huge value disables it
    top_p: torch.Tensor  # (B, 1) float32; +inf disables it (a cumulative sum never exceeds it)
    any_greedy: bool
    all_greedy: bool
    any_filter: bool

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str) -> BatchSampling:
        params = list(params)
        is_greedy = [p.temperature == 0 for p in params]
        no_top_k = torch.iinfo(torch.int64).max
        return cls(
            params=params,
            temperature=torch.tensor(
                [[1.0 if greedy else p.temperature] for p, greedy in zip(params, is_greedy)],
                dtype=torch.float32,
                device=device,
            ),
            is_greedy=torch.tensor(is_greedy, dtype=torch.bool, device=device),
            # A top_k beyond int64 (or the vocabulary) filters nothing, like no top_k.
            top_k=torch.tensor([[min(p.top_k, no_top_k) if p.top_k > 0 else no_top_k] for p in params], device=device),
            # A top_p below float32's smallest normal would round to 0 and drop every token: it keeps the first.
            top_p=torch.tensor(
                [[max(p.top_p, FLOAT32_TINY) if p.top_p < 1 else float("inf")] for p in params],
                dtype=torch.float32, device=device,
            ),
            any_greedy=any(is_greedy),
            all_greedy=all(is_greedy),
            any_filter=any(not greedy and (p.top_k > 0 or p.top_p < 1) for p, greedy in zip(params, is_greedy)),
        )

    def select_rows(self, rows: list[int]) -> BatchSampling:
        """The settings of the batch rows at positions ``rows`` (in that order)."""
        return BatchSampling.from_params([self.params[row] for row in rows], self.temperature.device)


class CounterNoise:
    """Noise for a batch whose every row has its own stream, keyed by the row's ``seeds [B]`` and ``counters [B]``
    (int64): a row's draw depends on its seed and counter only, never on the rows beside it or on how many
    draws came before. The engine core gives each request a seed and uses the token's position as the counter,
    so a seeded request samples the same tokens whatever shares its steps (continuous batching).

    A row needs one uniform, splitmix64 of its key, and the token is found by inverting the row's cumulative weights
    (`sample_rows`), on every device; the engine's CUDA graphs draw the same way in one read of the logits
    (`relax.backends.inference.triton_sampling.sample_tokens`). Noise for every vocabulary entry (an exponential race)
    cost more: on the 2-core CPU 64 x 4,096 weights 1.4 against 6.3 ms, 128 x 49,152 41 against 305 ms, 128 x 151,936
    97 against 937 ms (until 2026-12-03); on the H200 the graphs' sampler took 187 us a step at batch 256 over 151,936
    ids (until 2026-12-05).
    """

    def __init__(self, seeds: torch.Tensor, counters: torch.Tensor) -> None:
        self.seeds = seeds
        self.counters = counters

    def row_keys(self) -> torch.Tensor:
        """A 63-bit key per row mixing seed and counter (splitmix64's constants), (B,) int64."""
        key = self.seeds * -7046029254386353131 + self.counters * -4658895280553007687  # wraps, as intended
        key = key ^ (key >> 31)
        return key & 0x7FFFFFFFFFFFFFFF

    def uniforms(self) -> torch.Tensor:
        """One uniform in [0, 1) per row, from the row's key alone, (B,) float64."""
        bits = _splitmix64(self.row_keys())
        return ((bits >> 11) & ((1 << 53) - 1)).to(torch.float64) * 2.0**-53

    def sample_rows(self, weights: torch.Tensor) -> torch.Tensor:
        """One index per row of (B, V) non-negative weights (not necessarily normalized), drawn with probability
        proportional to its weight: the first index whose cumulative weight passes the row's uniform times the
        total. A zero weight adds nothing to the sum, so it is never the first to pass it; when rounding puts the
        target at the total, the answer is the index at which the sum reaches its total (the last whose weight
        counted). No host synchronization (the engine's eager CUDA path samples here while its next step is
        queued)."""
        cumulative = weights.cumsum(dim=-1, dtype=torch.float64)
        total = cumulative[:, -1:].contiguous()
        target = self.uniforms().to(weights.device)[:, None] * total
        index = torch.searchsorted(cumulative, target, right=True)
        # Rare: rounding put the target at the total, so no index passes it (V). The sum reaches its total at the
        # last weight that counted in it and stays flat after it: that index is the first to reach the total.
        last_weighted = torch.searchsorted(cumulative, total, right=False)
        return torch.where(index < weights.shape[1], index, last_weighted).squeeze(1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic; logical shifts written as masked ones)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * -4658895280553007687
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * -7723592293110705685
    return x ^ ((x >> 31) & ((1 << 33) - 1))


Randomness = Union[torch.Generator, CounterNoise]


def sample_next_tokens(
    logits: torch.Tensor, sampling: BatchSampling, generator: Randomness
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    ``logits`` is (B, V) in any float dtype. Returns the tokens, (B,) int64, and their log-probs,
    (B,) float32: ``log_softmax(logits / temperature)`` at the token, computed in fp32 before
    top-k/top-p filtering (plain ``log_softmax`` on greedy rows). ``generator`` (on the logits'
    device; or `CounterNoise`, a stream per row) supplies all randomness, so equal inputs and
    equally seeded generators give equal tokens.
    """
    scaled_logits = logits.float() / sampling.temperature
    log_normalizer = torch.logsumexp(scaled_logits, dim=-1, keepdim=True)
    if sampling.all_greedy:
        tokens = scaled_logits.argmax(dim=-1)
    else:
        tokens = _sample_from_scaled_logits(scaled_logits, log_normalizer, sampling, generator)
        if sampling.any_greedy:
            tokens = torch.where(sampling.is_greedy, scaled_logits.argmax(dim=-1), tokens)
    log_probs = scaled_logits.gather(1, tokens[:, None]).squeeze(1) - log_normalizer.squeeze(1)
    return tokens, log_probs


def _sample_from_scaled_logits(
    scaled_logits: torch.Tensor, log_normalizer: torch.Tensor, sampling: BatchSampling, generator: Randomness
) -> torch.Tensor:
    """Draw from softmax(scaled_logits) restricted by each row's top-k and top-p; (B,) int64."""
    if not sampling.any_filter:
        return _draw_indices((scaled_logits - log_normalizer).exp(), generator)
    # Filter in descending order, where top-k is a rank cut and top-p a cumulative-mass cut, then
    # sample a rank and map it back to a token id: one sort, no scatter.
    sorted_logits, sorted_token_ids = scaled_logits.sort(dim=-1, descending=True)
    ranks = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= sampling.top_k, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
    # The first token has zero mass before it, so every row keeps at least one token.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= sampling.top_p, 0.0)
    sampled_ranks = _draw_indices(sorted_probs, generator)
    return sorted_token_ids.gather(1, sampled_ranks[:, None]).squeeze(1)


def _draw_indices(probs: torch.Tensor, generator: Randomness) -> torch.Tensor:
    """Sample one index per row of (B, V) non-negative weights (not necessarily normalized): with `CounterNoise`,
    its one uniform per row inverted through the cumulative weights; with a generator, argmax(probs / E) for
    E ~ Exp(1), one elementwise pass and an argmax where ``torch.multinomial`` would sort."""
    if isinstance(generator, CounterNoise):
        return generator.sample_rows(probs)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    # A zero draw would turn a zero weight into 0/0 = NaN, which argmax would pick.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)
