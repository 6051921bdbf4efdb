"""The engine core's sampler off CUDA: one uniform per row, keyed by the request's seed and the token's index, and the
row's cumulative weights inverted (`CounterNoise.sample_rows`). Properties: the draws follow the weights, a zero
weight is never drawn whatever the rounding, a row's draw depends on its key alone, and top-k / top-p hold."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.backends.inference.base import SamplingParams
from relax.backends.inference.sampling import BatchSampling, CounterNoise, sample_next_tokens


def _noise(rows: int, seed0: int = 0, counter: int = 5) -> CounterNoise:
    return CounterNoise(torch.arange(seed0, seed0 + rows, dtype=torch.int64), torch.full((rows,), counter))


def test_draws_follow_the_weights_and_never_take_a_zero_weight():
    weights = torch.tensor([0.0, 1.0, 2.0, 0.0, 5.0, 0.0])
    draws = 40_000
    chosen = _noise(draws).sample_rows(weights.expand(draws, -1).contiguous())
    counts = torch.bincount(chosen, minlength=weights.numel()).double()
    assert counts[weights == 0].sum() == 0
    expected = weights.double() / weights.sum() * draws
    for count, mean in zip(counts[weights > 0], expected[weights > 0]):
        sigma = math.sqrt(mean * (1 - mean / draws))
        assert abs(count - mean) < 5 * sigma, (counts, expected)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.0, 1e-30, 1e-8, 0.3, 1.0, 7.0]), min_size=1, max_size=40),
       st.integers(0, 2**62), st.integers(0, 10_000))
def test_a_draw_is_always_a_token_with_weight(values, seed, counter):
    weights = torch.tensor(values, dtype=torch.float32)
    if not (weights > 0).any():
        weights[-1] = 1.0
    noise = CounterNoise(torch.tensor([seed]), torch.tensor([counter]))
    index = int(noise.sample_rows(weights[None])[0])
    assert weights[index] > 0


def test_a_target_rounded_up_to_the_total_takes_the_last_token_with_weight(monkeypatch):
    weights = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    noise = _noise(2)
    monkeypatch.setattr(noise, "uniforms", lambda: torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert noise.sample_rows(weights).tolist() == [1, 1]


def test_a_rows_draw_depends_on_its_key_alone_not_on_its_batch():
    torch.manual_seed(0)
    weights = torch.rand(16, 50)
    together = CounterNoise(torch.arange(16) * 11, torch.arange(16) + 3).sample_rows(weights)
    alone = [int(CounterNoise(torch.tensor([row * 11]), torch.tensor([row + 3])).sample_rows(weights[row:row + 1])[0])
             for row in range(16)]
    assert together.tolist() == alone
    scaled = CounterNoise(torch.arange(16) * 11, torch.arange(16) + 3).sample_rows(weights * 1000)
    assert scaled.tolist() == together.tolist()  # only the weights' proportions matter
    other_counter = CounterNoise(torch.arange(16) * 11, torch.arange(16) + 4).sample_rows(weights)
    assert other_counter.tolist() != together.tolist()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.floats(0.05, 1.0), st.integers(0, 2**40))
def test_top_k_and_top_p_hold_on_the_core_sampler(top_k, top_p, seed):
    torch.manual_seed(seed % 1000)
    logits = torch.randn(8, 30) * 3
    params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p) for _ in range(8)]
    tokens, log_probs = sample_next_tokens(logits, BatchSampling.from_params(params, "cpu"), _noise(8, seed0=seed))
    probs = logits.softmax(-1)
    for row, token in enumerate(tokens.tolist()):
        order = probs[row].argsort(descending=True).tolist()
        rank = order.index(token)
        assert rank < top_k
        mass_before = probs[row][order[:rank]].sum().item()
        assert rank == 0 or mass_before < top_p + 1e-6
        assert math.isclose(log_probs[row].item(), logits[row].log_softmax(-1)[token].item(), abs_tol=1e-5)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.0, 1e-30, 1e-8, 0.3, 1.0, 7.0]), min_size=6, max_size=6),
                min_size=1, max_size=8),
       st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.999999, 1.0]), min_size=8, max_size=8))
def test_sample_rows_is_the_first_index_past_the_target_else_the_last_with_weight(rows, uniforms):
    """The vectorised draw (no host synchronisation) against the rule written out row by row, uniforms up to 1.0
    included (the target at the total: rounding's case, where the draw is the index at which the sum reaches its
    total; a weight too small to change the sum, 1e-30 after 7.3, is passed over)."""
    weights = torch.tensor(rows, dtype=torch.float32)
    weights[:, -1] += (weights.sum(-1) == 0).float()  # every row has a weight
    noise = _noise(len(rows))
    chosen_uniforms = torch.tensor(uniforms[:len(rows)], dtype=torch.float64)
    noise.uniforms = lambda: chosen_uniforms
    expected = []
    for row, uniform in zip(weights.double(), chosen_uniforms.tolist()):
        cumulative = row.cumsum(0)
        passed = (cumulative > uniform * cumulative[-1]).nonzero().flatten().tolist()
        expected.append(passed[0] if passed else int((cumulative >= cumulative[-1]).nonzero().min()))
    assert noise.sample_rows(weights).tolist() == expected
