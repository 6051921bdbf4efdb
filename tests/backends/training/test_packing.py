"""The trainer's packer, token-budget micro-batches, packed attention and chunked log-probs: packed and
padded micro-batches, one big batch and many small ones, chunked and full logits all give the same
log-probs, losses and gradients (float32, atol 1e-5), on real tiny models."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.algorithms.loss import build_policy_loss_fn
from relax.algorithms.policy_loss import PolicyLossSettings
from relax.backends.training import varlen_attention
from relax.backends.training.base import TrainBatch
from relax.backends.training.fsdp import FSDPTrainBackend
from relax.backends.training.log_probs import token_log_probs
from relax.backends.training.packing import (
    balanced_partition,
    pack_sequences,
    pad_responses,
    pad_sequences,
    plan_token_budget,
)
from relax.backends.training.settings import TrainSettings

LOSS = build_policy_loss_fn(PolicyLossSettings(policy_loss="ppo_clip", eps_clip=0.2, eps_clip_high=0.28,
                                               eps_clip_c=None, aggregation="token-mean", entropy_coef=0.01))
ATOL = 1e-5


# ---- the packer ------------------------------------------------------------------------------

sequences = st.lists(st.integers(1, 12).flatmap(
    lambda n: st.tuples(st.lists(st.integers(0, 50), min_size=n, max_size=n), st.integers(0, n - 1))),
    min_size=1, max_size=6)


@given(sequences)
@settings(max_examples=60, deadline=None)
def test_packing_keeps_every_token_position_and_target(seqs):
    tokens = [t for t, _ in seqs]
    response_lengths = [r for _, r in seqs]
    packed = pack_sequences(tokens, response_lengths)
    assert packed.input_ids[0].tolist() == [tok for t in tokens for tok in t]
    assert packed.position_ids[0].tolist() == [i for t in tokens for i in range(len(t))]
    assert packed.cu_seqlens.tolist() == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens) + 1)]
    assert packed.max_seqlen == max(len(t) for t in tokens)
    assert packed.targets.tolist() == [tok for t, r in zip(tokens, response_lengths) for tok in t[len(t) - r:]]
    # each predicting position sits right before its target, inside the same sequence
    stream = packed.input_ids[0]
    assert torch.equal(stream[packed.predict_index + 1], packed.targets)
    # the padded layout finds the same targets
    _, _, _, padded_targets = pad_sequences(tokens, response_lengths, pad_token_id=0)
    assert torch.equal(padded_targets, packed.targets)
    flat = torch.arange(sum(response_lengths), dtype=torch.float32)
    padded = pad_responses(flat, response_lengths)
    for row, r in enumerate(response_lengths):
        start = sum(response_lengths[:row])
        assert padded[row, :r].tolist() == flat[start:start + r].tolist()
        assert not padded[row, r:].any()


def test_packing_refuses_a_sequence_without_a_prompt_token():
    with pytest.raises(ValueError, match="prompt needs at least one token"):
        pack_sequences([[1, 2, 3]], [3])


@given(st.lists(st.integers(1, 300), min_size=0, max_size=40), st.integers(1, 400), st.integers(1, 6))
@settings(max_examples=200, deadline=None)
def test_token_budget_plan_covers_every_sample_once_within_budget(lengths, budget, at_least):
    plan = plan_token_budget(lengths, budget, at_least)
    assert sorted(i for group in plan for i in group) == list(range(len(lengths)))
    assert len(plan) >= at_least
    for group in plan:
        load = sum(lengths[i] for i in group)
        assert load <= budget or len(group) == 1  # an oversized sequence rides alone
    fitting = [n for n in lengths if n <= budget]
    oversized = len(lengths) - len(fitting)
    if fitting and at_least <= oversized + 1:
        # never more than twice the lower bound (first-fit's guarantee), usually the bound itself
        lower = -(-sum(fitting) // budget)
        assert len(plan) - oversized <= max(2 * lower, 1)
    assert plan == plan_token_budget(lengths, budget, at_least)  # every rank plans alike


@given(st.lists(st.integers(1, 1000), min_size=0, max_size=50), st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_balanced_partition_is_exact_deterministic_and_balanced(costs, parts):
    groups = balanced_partition(costs, parts)
    assert len(groups) == parts
    assert sorted(i for g in groups for i in g) == list(range(len(costs)))
    loads = [sum(costs[i] for i in g) for g in groups]
    if costs:
        assert max(loads) - min(loads) <= max(costs)  # longest-first greedy's bound
    assert groups == balanced_partition(list(costs), parts)


# ---- chunked log-probs -----------------------------------------------------------------------

@given(st.integers(1, 40), st.integers(2, 30), st.integers(1, 9), st.integers(0, 3), st.floats(0.3, 2.0),
       st.booleans(), st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_chunked_log_probs_equal_full_logits_with_gradients(tokens, vocab, chunk, extra_ids, temperature,
                                                            suppress, seed):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 8, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, 8, generator=generator, dtype=torch.float64)
    ids = torch.randint(0, vocab, (tokens, 1 + extra_ids), generator=generator)
    suppressed = torch.tensor([vocab - 1]) if suppress and vocab > 2 else None
    if suppressed is not None:
        ids[ids == vocab - 1] = 0
    grad_lp = torch.randn(tokens, 1 + extra_ids, generator=generator, dtype=torch.float64)
    grad_ent = torch.randn(tokens, generator=generator, dtype=torch.float64)
    results = {}
    for chunk_size in (0, chunk):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = token_log_probs(h, w, ids, temperature=temperature, suppressed_ids=suppressed, chunk_size=chunk_size,
                              entropy_grad=True, top_k=min(2, vocab))
        ((out.log_probs * grad_lp).sum() + (out.entropy * grad_ent).sum()).backward()
        results[chunk_size] = (out, h.grad, w.grad)
    (full, h_full, w_full), (chunked, h_chunk, w_chunk) = results[0], results[chunk]
    for a, b in [(full.log_probs, chunked.log_probs), (full.entropy, chunked.entropy), (h_full, h_chunk),
                 (w_full, w_chunk), (full.top_log_probs, chunked.top_log_probs)]:
        torch.testing.assert_close(b, a, atol=1e-9, rtol=1e-9)
    assert torch.equal(full.top_ids, chunked.top_ids)


@given(st.integers(1, 30), st.integers(2, 20), st.integers(1, 9), st.integers(0, 2), st.booleans(), st.booleans(),
       st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_kept_logits_give_the_recomputing_heads_outputs_and_gradients_without_recomputing(
        tokens, vocab, chunk, extra_ids, entropy_grad, with_master, seed):
    """``keep_logits``: the backward takes each chunk's logits from the forward instead of running the head again
    (no `_logits` call in the backward), and every output and gradient (the hidden states', the head's, a float32
    master weight's) is the recomputing path's bit for bit; a forward without gradients keeps none."""
    from relax.backends.training import log_probs as head
    from relax.backends.training.master_weights import MasterWeightCasts

    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 8, generator=generator)
    weight = torch.randn(vocab, 8, generator=generator)
    ids = torch.randint(0, vocab, (tokens, 1 + extra_ids), generator=generator)
    grad_lp = torch.randn(tokens, 1 + extra_ids, generator=generator)
    grad_ent = torch.randn(tokens, generator=generator)
    chunks = -(-tokens // chunk)
    calls = []
    real_logits = head._logits

    def counted(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return real_logits(*args, **kwargs)

    results = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(head, "_logits", counted)
        for keep in (False, True):
            calls.clear()
            h = hidden.clone().requires_grad_()
            w = weight.clone().requires_grad_()
            # a float32 master weight whose gradient the head sums in itself (bf16 compute: the master path)
            casts = MasterWeightCasts(torch.bfloat16) if with_master else None
            out = head.token_log_probs(h, w, ids, chunk_size=chunk, entropy_grad=entropy_grad, keep_logits=keep,
                                       compute_dtype=torch.bfloat16 if with_master else None, weight_casts=casts)
            forward_calls = len(calls)
            loss = (out.log_probs.float() * grad_lp).sum()
            if entropy_grad:
                loss = loss + (out.entropy.float() * grad_ent).sum()
            loss.backward()
            results[keep] = (out.log_probs, out.entropy, h.grad, w.grad)
            assert forward_calls == chunks
            assert len(calls) - forward_calls == (0 if keep else chunks)
    for recomputed, kept in zip(results[False], results[True]):
        assert torch.equal(recomputed, kept)
    with torch.no_grad():  # nothing to keep for: the head's context is dropped with its outputs
        out = head.token_log_probs(hidden.clone().requires_grad_(), weight, ids, chunk_size=chunk, keep_logits=True)
    assert out.log_probs.grad_fn is None


def test_kept_logits_need_a_chunked_head():
    from relax.config import RelaxConfig

    with pytest.raises(ValueError, match="--log-probs-keep-logits on needs --log-probs-chunk-size above 0"):
        RelaxConfig(hf_checkpoint="m", prompt_data="p.jsonl", log_probs_keep_logits="on", log_probs_chunk_size=0)
    kept = RelaxConfig(hf_checkpoint="m", prompt_data="p.jsonl", log_probs_keep_logits="on")
    assert kept.log_probs_keep_logits == "on"
    # auto (the default) with an unchunked head recomputes: nothing to refuse
    assert RelaxConfig(hf_checkpoint="m", prompt_data="p.jsonl", log_probs_chunk_size=0).log_probs_keep_logits == "auto"


def test_entropy_gets_no_gradient_unless_asked():
    hidden = torch.randn(5, 4, requires_grad=True)
    weight = torch.randn(7, 4)
    out = token_log_probs(hidden, weight, torch.zeros(5, 1, dtype=torch.long), chunk_size=2, entropy_grad=False)
    assert not out.entropy.requires_grad and out.log_probs.requires_grad


# ---- packed vs padded on real models ---------------------------------------------------------

def _settings(**changes) -> TrainSettings:
    base = TrainSettings(device=torch.device("cpu"), compute_dtype=torch.float32, micro_batch_size=3, temperature=0.8,
                         pad_token_id=0, lr=1e-3, total_optimizer_steps=10, clip_grad=0.0, entropy_grad=True)
    return dataclasses.replace(base, **changes)


def _rl_batch(num_samples=7, seed=0, vocab=40, gather_k=0) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    tokens, response_lengths = [], []
    for i in range(num_samples):
        prompt, response = 2 + (i * 5) % 7, 1 + (i * 3) % 9  # lengths that differ a lot, as in RL
        tokens.append(torch.randint(3, vocab, (prompt + response,), generator=generator).tolist())
        response_lengths.append(response)
    loss_masks = [[1] * r for r in response_lengths]
    loss_masks[2][0] = 0
    fields = {
        "advantages": [torch.randn(r, generator=generator) for r in response_lengths],
        "old_log_probs": [-torch.rand(r, generator=generator) * 3 for r in response_lengths],
    }
    gather = [torch.randint(3, vocab, (r, gather_k), generator=generator) for r in response_lengths] \
        if gather_k else None
    return TrainBatch(tokens, response_lengths, loss_masks, fields, gather_ids=gather)


def _grads(backend):
    return {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}


def _assert_same_step(model_dir, batch, first: TrainSettings, second: TrainSettings, value_head=False, loss=LOSS):
    results = []
    for settings_ in (first, second):
        backend = FSDPTrainBackend(model_dir, settings_, value_head=value_head)
        metrics = backend.train_step(batch, loss)
        results.append((metrics, _grads(backend)))
    (m1, g1), (m2, g2) = results
    assert g1.keys() == g2.keys() and g1
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], atol=ATOL, rtol=1e-4, msg=name)
    for key in m1:
        if key != "lr":
            assert abs(m1[key] - m2[key]) <= ATOL * max(1.0, abs(m1[key])), key


def test_packed_and_padded_actor_agree_on_log_probs_entropy_top_k_and_gathered_ids(tiny_workspace):
    model_dir = tiny_workspace / "model"
    batch = _rl_batch(gather_k=3)
    outputs = []
    for packing in (False, True):
        backend = FSDPTrainBackend(model_dir, _settings(sequence_packing=packing), trainable=False)
        outputs.append(backend.compute_log_probs(batch, top_k=4))
    padded, packed = outputs
    for name in ("log_probs", "entropy", "gathered", "top_log_probs"):
        for a, b in zip(getattr(padded, name), getattr(packed, name)):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-5, msg=name)
    assert all(torch.equal(a, b) for a, b in zip(padded.top_ids, packed.top_ids))


def test_packed_and_padded_training_steps_give_equal_loss_and_gradients(tiny_workspace):
    _assert_same_step(tiny_workspace / "model", _rl_batch(), _settings(sequence_packing=False, log_probs_chunk_size=0),
                      _settings(sequence_packing=True, log_probs_chunk_size=4))


def test_packed_and_padded_critic_agree(tiny_workspace):
    from relax.algorithms.loss import build_value_loss_fn

    model_dir = tiny_workspace / "model"
    batch = _rl_batch()
    batch.fields["returns"] = [torch.randn(r) for r in batch.response_lengths]
    batch.fields["old_values"] = [torch.zeros(r) for r in batch.response_lengths]
    values = [FSDPTrainBackend(model_dir, _settings(sequence_packing=p), value_head=True).compute_values(batch)
              for p in (False, True)]
    for a, b in zip(*values):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-5)
    _assert_same_step(model_dir, batch, _settings(sequence_packing=False), _settings(sequence_packing=True),
                      value_head=True, loss=build_value_loss_fn(value_clip=0.2, aggregation="token-mean"))


def test_token_budget_micro_batches_give_the_gradient_of_one_big_batch(tiny_workspace):
    batch = _rl_batch(num_samples=9)
    longest = max(len(t) for t in batch.tokens)
    _assert_same_step(tiny_workspace / "model", batch, _settings(micro_batch_size=len(batch)),
                      _settings(max_tokens_per_gpu=longest + 3, log_probs_max_tokens_per_gpu=longest))


def test_token_budget_log_probs_come_back_in_batch_order(tiny_workspace):
    batch = _rl_batch(num_samples=9)
    model_dir = tiny_workspace / "model"
    whole = FSDPTrainBackend(model_dir, _settings(micro_batch_size=9), trainable=False).compute_log_probs(batch)
    budget = FSDPTrainBackend(model_dir, _settings(log_probs_max_tokens_per_gpu=14, max_tokens_per_gpu=20),
                              trainable=False).compute_log_probs(batch)
    for a, b in zip(whole.log_probs, budget.log_probs):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-5)


def test_packed_attention_keeps_sequences_apart(tiny_workspace):
    """A sequence's log-probs do not depend on what it is packed with."""
    model_dir = tiny_workspace / "model"
    batch = _rl_batch(num_samples=4)
    backend = FSDPTrainBackend(model_dir, _settings(micro_batch_size=4), trainable=False)
    together = backend.compute_log_probs(batch).log_probs
    alone = [backend.compute_log_probs(batch.select([i])).log_probs[0] for i in range(len(batch))]
    for a, b in zip(alone, together):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-5)


VIEW_BACKWARDS = {"TransposeBackward0", "SqueezeBackward0", "SqueezeBackward1", "ViewBackward0",
                  "UnsqueezeBackward0", "PermuteBackward0"}


@settings(max_examples=20, deadline=None)
@given(heads=st.sampled_from([(2, 1), (4, 2), (3, 3)]), lengths=st.lists(st.integers(1, 7), min_size=1, max_size=4))
def test_packed_attention_reaches_its_kernel_through_views_only(heads, lengths):
    """The ``[1, H, N, D]`` queries, keys and values become the kernel's ``[N, H, D]`` through views, so their
    gradients come back without a copy: indexing (``t[0]``) has a backward that zero-fills the whole input and
    copies the gradient into it, which cost a strided copy of every query, key and value gradient per layer on the
    GPU. The output is the kernel's, as a view."""
    (q_heads, kv_heads), total, dim = heads, sum(lengths), 8
    seen = {}

    def kernel(q, k, v, packing, scale, dropout):
        seen.update(q=q, k=k, v=v)
        return q * 2

    inputs = [torch.randn(1, h, total, dim, requires_grad=True) for h in (q_heads, kv_heads, kv_heads)]
    boundaries = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packing = varlen_attention.PackedAttention.of(boundaries, max(lengths), torch.device("cpu"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(varlen_attention, "_padded_attend", kernel)
        out, _ = varlen_attention.packed_attention_forward(torch.nn.Module(), *inputs, None, relax_packed=packing)
    assert out.shape == (1, total, q_heads, dim)
    for name, source in zip("qkv", inputs):
        node, path = seen[name].grad_fn, []
        while node is not None and not (hasattr(node, "variable") and node.variable is source):
            path.append(type(node).__name__)
            node = node.next_functions[0][0]
        assert node is not None and set(path) <= VIEW_BACKWARDS, (name, path)
        assert seen[name].untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
    out.sum().backward()
    torch.testing.assert_close(inputs[0].grad, torch.full_like(inputs[0], 2.0))


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(any),
       heads=st.sampled_from([(2, 1), (4, 2), (3, 3)]), widths=st.sampled_from([(8, 8), (8, 4), (4, 8)]),
       scale=st.floats(0.05, 1.0))
def test_padded_attention_equals_attention_sequence_by_sequence(lengths, heads, widths, scale):
    """The CPU path (sequences padded into buckets of similar lengths, kept apart by the mask) gives what causal
    SDPA run on each sequence alone gives: outputs and the gradients of queries, keys and values, in float64 to
    rounding; empty sequences, grouped-query heads and values narrower or wider than the keys included."""
    (q_heads, kv_heads), (dim, value_dim) = heads, widths
    boundaries = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packing = varlen_attention.PackedAttention.of(boundaries, max(lengths), torch.device("cpu"))
    total = sum(lengths)
    inputs = [torch.randn(total, h, d, dtype=torch.float64, requires_grad=True)
              for h, d in ((q_heads, dim), (kv_heads, dim), (kv_heads, value_dim))]
    copies = [t.detach().clone().requires_grad_() for t in inputs]
    exact = varlen_attention._per_sequence_attend(*inputs, packing, scale, 0.0)
    padded = varlen_attention._padded_attend(*copies, packing, scale, 0.0)
    torch.testing.assert_close(padded, exact, atol=1e-12, rtol=1e-12)
    upstream = torch.randn_like(exact)
    (exact * upstream).sum().backward()
    (padded * upstream).sum().backward()
    for mine, theirs in zip(copies, inputs):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-12, rtol=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=0, max_size=60))
def test_length_buckets_hold_every_sequence_once_and_bound_the_padding(lengths):
    """Each sequence is in one bucket, longest first; a bucket of several sequences, padded to its longest,
    computes at most `PADDING_WASTE` times the scores its sequences need."""
    buckets = varlen_attention.length_buckets(lengths)
    assert sorted(index for bucket in buckets for index in bucket) == list(range(len(lengths)))
    for bucket in buckets:
        longest = lengths[bucket[0]]
        assert all(lengths[index] <= longest for index in bucket)
        if len(bucket) > 1:
            assert len(bucket) * longest ** 2 <= varlen_attention.PADDING_WASTE * sum(lengths[i] ** 2 for i in bucket)
    if lengths and max(lengths) == min(lengths):
        assert len(buckets) == 1  # equal lengths: one call


def test_sliding_window_models_are_refused_with_the_flag_to_use():
    query = torch.randn(1, 2, 4, 8)
    packing = varlen_attention.PackedAttention.of(torch.tensor([0, 4]), 4, torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="--no-sequence-packing"):
        varlen_attention.packed_attention_forward(torch.nn.Module(), query, query, query, None, sliding_window=2,
                                                  relax_packed=packing)


def _media_batch(model_dir, kind: str, tmp_path, count: int = 3) -> TrainBatch:
    """Real media samples (files through the rollout's preparer), with responses of different lengths and
    a text-only sample among them."""
    import asyncio
    import json

    from transformers import AutoConfig, AutoTokenizer

    from relax.data.multimodal import MultimodalSettings
    from relax.data.sample import Sample
    from relax.rollout.generation.multimodal import MultimodalPreparer
    from tests.support.tiny_mm_assets import make_audio_rows, make_image_rows

    rows_path = (make_audio_rows if kind == "audio" else make_image_rows)(tmp_path, count)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    column = {"image": "images", "audio": "audios"}[kind]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    preparer = MultimodalPreparer(tokenizer, AutoConfig.from_pretrained(model_dir), model_dir, MultimodalSettings(),
                                  None, {}, pool_size=1, skip_bad_samples=False)
    samples = [Sample(index=i, prompt=row["prompt"],
                      multimodal_inputs={kind: [str(rows_path.parent / item) for item in row[column]]})
               for i, row in enumerate(rows)]
    ready, _ = asyncio.run(preparer.prepare(samples))
    preparer.close()
    generator = torch.Generator().manual_seed(1)
    tokens, lengths, media = [], [], []
    for i, sample in enumerate(ready):
        response = torch.randint(20, 200, (2 + 3 * i,), generator=generator).tolist()
        tokens.append(sample.tokens + response)
        lengths.append(len(response))
        media.append(sample.multimodal_train_inputs)
    tokens.append(tokenizer("higher lower")["input_ids"] + [30, 31, 32])  # a text-only sample in the same batch
    lengths.append(3)
    media.append(None)
    fields = {"advantages": [torch.randn(n, generator=generator) for n in lengths],
              "old_log_probs": [-torch.rand(n, generator=generator) for n in lengths]}
    return TrainBatch(tokens, lengths, [[1] * n for n in lengths], fields, multimodal=media)


@pytest.mark.parametrize("kind", ["image", "audio"])
def test_packed_and_padded_multimodal_steps_agree(kind, tmp_path):
    from tests.support.tiny_mm_assets import build_tiny_omni, build_tiny_vl

    model_dir = (build_tiny_omni if kind == "audio" else build_tiny_vl)(tmp_path)
    batch = _media_batch(model_dir, kind, tmp_path)
    _assert_same_step(model_dir, batch, _settings(sequence_packing=False, log_probs_chunk_size=0),
                      _settings(sequence_packing=True))


# ---- flags -------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, message", [
    (["--use-dynamic-batch-size"], "--use-dynamic-batch-size needs --max-tokens-per-gpu"),
    (["--max-tokens-per-gpu", "512"], "--max-tokens-per-gpu need --use-dynamic-batch-size"),
    (["--log-probs-max-tokens-per-gpu", "512"], "--log-probs-max-tokens-per-gpu need --use-dynamic-batch-size"),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "512", "--micro-batch-size", "2"],
     "drop --micro-batch-size"),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "100", "--rollout-max-prompt-len", "64",
      "--rollout-max-response-len", "64"], r"--max-tokens-per-gpu \(100\) must hold the longest sample \(128"),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "512", "--log-probs-max-tokens-per-gpu", "64",
      "--rollout-max-context-len", "300"], r"--log-probs-max-tokens-per-gpu \(64\) must hold"),
    (["--log-probs-chunk-size", "-1"], "log_probs_chunk_size|log-probs-chunk-size"),
])
def test_batching_flags_are_checked_up_front(extra, message):
    from relax.cli.args import parse_config
    from relax.config import ConfigError

    with pytest.raises((ConfigError, SystemExit, ValueError)) as info:
        parse_config(["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", *extra])
    if info.type is not SystemExit:
        assert __import__("re").search(message, str(info.value)), str(info.value)


def test_a_run_with_token_budget_micro_batches_trains_like_fixed_ones(tiny_workspace, tmp_path):
    """The same seeded run, fixed micro-batches vs token-budget ones (packed) vs padded rows: the same
    rollouts and, within float32 rounding, the same losses after two steps."""
    import asyncio

    from relax.cli.args import parse_config
    from relax.core.build import build_roles
    from relax.core.loops.sync import SyncController
    from relax.core.placement.in_process import InProcessPlacement
    from relax.telemetry.tracking import Tracker
    from tests.support.runs import tiny_train_args

    runs = {}
    variants = {
        "fixed": ["--micro-batch-size", "4"],
        "budget": ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "40", "--log-probs-max-tokens-per-gpu", "64"],
        "padded": ["--micro-batch-size", "4", "--no-sequence-packing", "--log-probs-chunk-size", "0"],
    }
    for name, extra in variants.items():
        args = [a for a in tiny_train_args(tiny_workspace, tmp_path / name, "--num-rollout", "2", "--seed", "3")]
        i = args.index("--micro-batch-size")
        del args[i:i + 2]
        cfg = parse_config(args + extra)
        roles = build_roles(cfg)
        with Tracker(cfg.output_dir, use_tensorboard=False) as tracker:
            controller = SyncController(cfg, InProcessPlacement(cfg, roles), tracker)
            runs[name] = [asyncio.run(controller.train_step(step)) for step in range(2)]
    for name in ("budget", "padded"):
        for reference, step in zip(runs["fixed"], runs[name]):
            assert step["rollout/reward_mean"] == reference["rollout/reward_mean"]
            for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm"):
                assert abs(step[key] - reference[key]) <= 1e-4 * max(1.0, abs(reference[key])), (name, key)
