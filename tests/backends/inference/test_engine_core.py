"""The engine core (issue 15): the block pool under random joins, aborts and finishes; continuous batching that
gives a seeded request the same tokens whatever shares its steps; shared prompt blocks; preemption."""

from __future__ import annotations

import asyncio
import random
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine
from relax.backends.inference.engine_core.block_manager import RESERVED_BLOCK, BlockManager, OutOfBlocks
from tests.backends.inference.test_embedded_engine import make_model, make_tokenizer


# ---- the block pool ----------------------------------------------------------------------------------------------
class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocations (prompts from a tiny alphabet, so that prefixes repeat and blocks are shared), growth,
    frees and prefix-cache resets: the refcounts always equal the tables holding each block, the free list holds
    exactly the unreferenced blocks, and nothing is freed twice."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockManager(num_blocks=24, block_size=4)
        self.tables: list[list[int]] = []
        self.lengths: list[int] = []

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=30), share=st.booleans())
    def allocate(self, tokens, share):
        if not self.pool.can_allocate(tokens, share=share):
            with pytest.raises(OutOfBlocks):
                self.pool.allocate(tokens, share)
            return
        table, cached = self.pool.allocate(tokens, share)
        assert len(table) == self.pool.blocks_for(len(tokens)) and 0 <= cached < len(tokens)
        assert cached % self.pool.block_size == 0 and RESERVED_BLOCK not in table
        self.tables.append(table)
        self.lengths.append(len(tokens))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def grow(self, data):
        index = data.draw(st.integers(0, len(self.tables) - 1))
        if self.pool.num_free == 0 and len(self.tables[index]) * self.pool.block_size <= self.lengths[index]:
            return
        self.lengths[index] += 1
        self.pool.append_slot(self.tables[index], self.lengths[index])
        assert len(self.tables[index]) * self.pool.block_size >= self.lengths[index]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data):
        index = data.draw(st.integers(0, len(self.tables) - 1))
        self.pool.free(self.tables.pop(index))
        self.lengths.pop(index)

    @rule()
    def reset_prefix_cache(self):
        self.pool.reset_prefix_cache()

    @invariant()
    def refcounts_match_the_tables(self):
        held = [0] * self.pool.num_blocks
        for table in self.tables:
            for block in table:
                held[block] += 1
        assert held == self.pool.refcount
        assert set(self.pool._free) == {b for b in range(1, self.pool.num_blocks) if held[b] == 0}

    def teardown(self):
        for table in self.tables:
            self.pool.free(table)
        assert self.pool.num_free == self.pool.num_blocks - 1
        with pytest.raises(RuntimeError, match="freed twice"):
            if self.tables:
                self.pool.free(self.tables[0])
            else:
                raise RuntimeError("freed twice")


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# ---- the engine --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def core_engine(tokenizer, **settings) -> EmbeddedEngine:
    return EmbeddedEngine(make_model(seed=0), tokenizer, core=CoreSettings(mode="on", **settings))


def request(rid: str, prompt: list[int], **params) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(**params))


def assert_pool_empty(engine: EmbeddedEngine) -> None:
    blocks = engine.core.blocks
    assert blocks.num_free == blocks.num_blocks - 1 and not any(blocks.refcount[1:])
    assert engine.core.in_flight == 0


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 40), st.booleans(), st.integers(0, 3)),
                min_size=1, max_size=12), st.integers(0, 2**31), st.integers(64, 200), st.sampled_from([1, 4, 16, 32]))
def test_random_joins_aborts_and_finishes_never_leak_blocks(tokenizer, jobs, seed, pool, page):
    """Callers join at random steps with random lengths, in pools of random sizes and pages; some are aborted
    mid-way. Every call ends (none waits on a pool it can never enter: a prompt near a pool's end once stalled the
    queue) and every block comes back."""
    engine = core_engine(tokenizer, max_total_tokens=pool, page_size=page)
    slots = engine.core.scheduler.max_sequence_tokens
    jobs = [(min(prompt, slots - 1), *rest) for prompt, *rest in jobs]  # (prompts that fill the pool: refused)
    rng = random.Random(seed)

    async def caller(index, prompt_len, new_tokens, abort, delay):
        for _ in range(delay):
            await asyncio.sleep(0)
        prompt = [rng.randrange(3, 60) for _ in range(prompt_len)]
        task = asyncio.ensure_future(engine.generate([request(f"j{index}", prompt, max_new_tokens=new_tokens,
                                                              temperature=1.0, ignore_eos=True)]))
        if abort:
            await asyncio.sleep(0)
            await engine.abort([f"j{index}"])
        (output,) = await task
        assert output.finish_reason in (("abort", "length") if abort else ("length",))
        assert len(output.output_ids) == len(output.output_log_probs) <= min(new_tokens, slots - prompt_len)

    async def run_all():
        await asyncio.wait_for(asyncio.gather(*(caller(i, *job) for i, job in enumerate(jobs))), timeout=120)

    asyncio.run(run_all())
    assert_pool_empty(engine)


def test_a_seeded_request_samples_the_same_whatever_shares_its_steps(tokenizer):
    engine = core_engine(tokenizer)
    mine = [5, 9, 13, 17, 21]

    def solo():
        return asyncio.run(engine.generate([request("me", mine, max_new_tokens=16, seed=11, ignore_eos=True)]))[0]

    alone = solo()

    async def crowded():
        others = [asyncio.ensure_future(engine.generate([request(f"o{i}", [7 + i] * (3 + i), max_new_tokens=5 + 3 * i,
                                                                 temperature=0.8, seed=i, ignore_eos=True)]))
                  for i in range(6)]
        for _ in range(3):  # join mid-way through the others' decoding
            await asyncio.sleep(0)
        (out,) = await engine.generate([request("me", mine, max_new_tokens=16, seed=11, ignore_eos=True)])
        await asyncio.gather(*others)
        return out

    with_others = asyncio.run(crowded())
    assert with_others.output_ids == alone.output_ids
    assert with_others.output_log_probs == pytest.approx(alone.output_log_probs, abs=1e-5)
    assert_pool_empty(engine)


def test_concurrent_callers_share_one_running_batch(tokenizer):
    engine = core_engine(tokenizer)

    async def together():
        return await asyncio.gather(*(engine.generate([request(f"c{i}", [5 + i, 6], max_new_tokens=10,
                                                               temperature=0, ignore_eos=True)]) for i in range(8)))

    asyncio.run(together())
    # 8 callers x 10 tokens: one prefill step, then 9 decode steps for all of them together
    assert engine.core.steps == 10


@settings(max_examples=8, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6))
def test_each_output_is_built_once_and_streamed_as_returned(tokenizer, lengths):
    """A request's output (its text decoded from its tokens) is built once: what the stream reports as it finishes
    is the object the call returns, whatever order the requests finish in."""
    engine = core_engine(tokenizer)
    decoded = []
    decode = tokenizer.decode

    def counting_decode(ids, *args, **kwargs):
        decoded.append(list(ids))
        return decode(ids, *args, **kwargs)

    reported = {}
    requests = [request(f"b{i}", [5 + i, 6], max_new_tokens=n, temperature=1.0, seed=i, ignore_eos=True)
                for i, n in enumerate(lengths)]
    engine.core.tokenizer = types.SimpleNamespace(decode=counting_decode)
    outputs = asyncio.run(engine.core.generate(requests, on_output=reported.__setitem__))
    assert [len(o.output_ids) for o in outputs] == lengths
    assert all(reported[position] is output for position, output in enumerate(outputs))
    assert sorted(decoded) == sorted(o.output_ids for o in outputs)  # one decode per request, of its own tokens
    assert_pool_empty(engine)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 14), st.integers(1, 12), st.integers(0, 4), st.booleans()),
                min_size=1, max_size=8), st.sampled_from([None, 96]))
def test_pipelined_prefills_give_the_tokens_of_a_drained_pipeline(tokenizer, jobs, pool):
    """Callers join at random steps (some with a second sample of their prompt) under a small prefill budget, so
    prefills run in several steps, behind decodes in flight, and with a small pool some sequences are preempted:
    every seeded request gets the same tokens and log-probs with the paged runner's prefills pipelined as with
    the pipeline drained before each prefill, and every block comes back."""

    def run(pipelined: bool):
        engine = core_engine(tokenizer, max_prefill_tokens=16, page_size=4,
                             **({"max_total_tokens": pool} if pool else {}))
        engine.core.runner.pipelines_prefill = pipelined

        async def caller(index, prompt_len, new_tokens, delay, twin):
            for _ in range(delay):
                await asyncio.sleep(0)
            prompt = [3 + (index * 5 + j) % 50 for j in range(prompt_len)]
            return await engine.generate([request(f"j{index}-{k}", prompt, max_new_tokens=new_tokens,
                                                  temperature=1.0, seed=index, ignore_eos=True)
                                          for k in range(1 + twin)])

        async def run_all():
            return await asyncio.gather(*(caller(i, *job) for i, job in enumerate(jobs)))

        outputs = [output for group in asyncio.run(run_all()) for output in group]
        assert_pool_empty(engine)
        return outputs

    drained, pipelined = run(False), run(True)
    assert [o.output_ids for o in pipelined] == [o.output_ids for o in drained]
    for a, b in zip(pipelined, drained):
        assert a.finish_reason == b.finish_reason == "length"
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=1e-5)


def test_a_prefill_is_launched_before_the_step_in_flight_is_read(tokenizer):
    """The paged runner's prefills join the pipeline: each prefill after the first, and the first decode, are
    launched while the step before them is still unread (so the device never waits for the host to build a
    prefill's inputs); a request joining mid-decode is prefilled behind the decode in flight."""
    engine = core_engine(tokenizer, max_prefill_tokens=8)
    core, runner, events = engine.core, engine.core.runner, []

    def logged(kind, launch):
        def step(sequences, *args):
            output = launch(sequences, *args)
            events.append(("launch", kind, id(output)))
            return output
        return step

    runner.prefill, runner.decode = logged("prefill", runner.prefill), logged("decode", runner.decode)
    process = core._process
    core._process = lambda output: (events.append(("read", None, id(output))), process(output))[1]

    async def scenario():
        first = asyncio.ensure_future(engine.generate([request(f"a{i}", [5 + i] * 8, max_new_tokens=12, seed=i,
                                                               ignore_eos=True) for i in range(3)]))
        while core.decode_steps < 4:
            await asyncio.sleep(0)
        late = await engine.generate([request("late", [9] * 5, max_new_tokens=3, seed=7, ignore_eos=True)])
        return await first, late

    first, late = asyncio.run(scenario())
    assert [len(o.output_ids) for o in first] == [12, 12, 12] and len(late[0].output_ids) == 3
    unread, behind = set(), []
    for event, kind, output in events:
        if event == "launch":
            behind.append((kind, bool(unread)))
            unread.add(output)
        else:
            unread.discard(output)
    prefills = [waited for kind, waited in behind if kind == "prefill"]
    assert len(prefills) == 4  # three 8-token prompts one per step, then the late one
    assert prefills[1:] == [True, True, True]  # each behind an unread step: a prefill, a prefill, a decode
    assert behind[3] == ("decode", True)  # the first decode behind the last prompt's prefill
    assert_pool_empty(engine)


def test_a_grpo_group_computes_its_prompt_once(tokenizer):
    engine = core_engine(tokenizer, page_size=4)
    prompt = list(range(3, 41))  # 38 tokens: 9 full blocks of 4 and a partial one
    outputs = asyncio.run(engine.generate([request(f"g{i}", prompt, max_new_tokens=6, seed=5, ignore_eos=True)
                                           for i in range(8)]))
    assert engine.core.runner.prefill_tokens == 38  # one prefill; the partial block is copied on first write
    assert len({tuple(o.output_ids) for o in outputs}) > 1  # one prompt, eight different samples
    assert_pool_empty(engine)


def test_a_prompt_seen_again_later_reuses_its_full_blocks(tokenizer):
    engine = core_engine(tokenizer, page_size=4)
    prompt = list(range(3, 41))
    asyncio.run(engine.generate([request("first", prompt, max_new_tokens=3, temperature=0)]))
    before = engine.core.runner.prefill_tokens
    asyncio.run(engine.generate([request("again", prompt + [7, 8], max_new_tokens=3, temperature=0)]))
    assert engine.core.runner.prefill_tokens - before == 40 - 9 * 4  # the 9 full blocks came from the pool
    assert_pool_empty(engine)


def test_preemption_keeps_greedy_outputs(tokenizer):
    prompts = [[3 + (i * 7 + j) % 50 for j in range(6 + i)] for i in range(6)]
    requests = [request(f"p{i}", p, max_new_tokens=24, temperature=0, ignore_eos=True) for i, p in enumerate(prompts)]
    roomy = asyncio.run(core_engine(tokenizer).generate(requests))
    tight_engine = core_engine(tokenizer, max_total_tokens=64, page_size=4)
    tight = asyncio.run(tight_engine.generate(requests))
    assert tight_engine.core.scheduler.preemptions > 0
    assert [o.output_ids for o in tight] == [o.output_ids for o in roomy]
    for a, b in zip(tight, roomy):
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=1e-5)
    assert_pool_empty(tight_engine)


def test_a_request_longer_than_the_pool_is_refused_naming_it(tokenizer):
    engine = core_engine(tokenizer, max_total_tokens=32, page_size=4)
    with pytest.raises(ValueError, match=r"'long': 37 prompt tokens leave no room for an answer in the engine's KV "
                                         r"pool of 32 token slots \(--max-total-tokens\)"):
        asyncio.run(engine.generate([request("fits", [3, 4, 5], max_new_tokens=4),
                                     request("long", list(range(3, 40)), max_new_tokens=4)]))
    assert_pool_empty(engine)
    assert not engine.core.scheduler.has_work  # nothing of the refused call was queued to decode for nobody


def test_a_prompt_within_a_page_of_the_pool_s_end_runs_and_the_queue_behind_it_too(tokenizer):
    """A new sequence was admitted only with a whole page of room to grow beyond its prompt: a 50-token prompt in a
    64-slot pool of 16-slot pages never was, and every request queued behind it waited for good (the engine
    stalled, with no error). The room asked is now what the sequence can still grow."""
    engine = core_engine(tokenizer, max_total_tokens=64, page_size=16)

    async def run_all():
        return await asyncio.wait_for(engine.generate([
            request("near-the-end", list(range(3, 53)), max_new_tokens=4, ignore_eos=True),
            request("behind-it", [3, 4, 5], max_new_tokens=4, ignore_eos=True)]), timeout=60)

    assert [len(output.output_ids) for output in asyncio.run(run_all())] == [4, 4]
    assert_pool_empty(engine)


@settings(max_examples=10, deadline=None)
@given(pool=st.integers(64, 160), page=st.sampled_from([1, 4, 16, 64]),
       calls=st.lists(st.lists(st.tuples(st.integers(1, 170), st.integers(1, 240)), min_size=1, max_size=3),
                      min_size=1, max_size=3))
def test_a_request_runs_within_the_pool_or_its_call_is_refused_whole(tokenizer, pool, page, calls):
    """A prompt that fit the model's positions, with prompt + max_new_tokens past a small --max-total-tokens pool,
    was refused by the engine and ended the rollout. The engine now ends a sequence at its pool with "length", as
    at the model's last position (SGLang caps max_new_tokens at its pool alike), and refuses only a prompt that
    leaves no room for one answer token: its whole call, before any of it is queued."""
    engine = core_engine(tokenizer, max_total_tokens=pool, page_size=page)
    slots = pool // page * page
    assert engine.core.scheduler.max_sequence_tokens == slots

    async def call(index, lengths):
        requests = [request(f"c{index}-{i}", [3 + (i + n) % 50 for n in range(prompt)], max_new_tokens=new,
                            temperature=1.0, ignore_eos=True) for i, (prompt, new) in enumerate(lengths)]
        refused = [r.request_id for r in requests if len(r.input_ids) >= slots]
        try:
            outputs = await engine.generate(requests)
        except ValueError as error:
            assert refused and f"{refused[0]!r}: " in str(error) and f"pool of {slots} token slots" in str(error)
            return
        assert not refused
        for (prompt, new), output in zip(lengths, outputs):
            assert output.finish_reason == "length"
            assert len(output.output_ids) == min(new, slots - prompt)

    async def run_all():
        await asyncio.gather(*(call(i, lengths) for i, lengths in enumerate(calls)))

    asyncio.run(run_all())
    assert_pool_empty(engine)
    assert not engine.core.scheduler.has_work


def test_a_pool_larger_than_the_free_memory_is_refused_naming_the_flag_before_allocating(tokenizer, monkeypatch):
    """--max-total-tokens of more bytes than the device has free failed in torch's allocator (a 381 GiB request,
    a traceback naming no setting); it is refused with the sizes, and nothing is allocated."""
    from relax.backends.inference.engine_core import kv_cache

    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: 2**20)  # 1 MiB free
    allocations, allocate = [], kv_cache.KVPool.__init__

    def recorded(pool, *args, **kwargs):
        allocations.append(args)
        allocate(pool, *args, **kwargs)

    monkeypatch.setattr(kv_cache.KVPool, "__init__", recorded)
    with pytest.raises(ValueError, match=r"--max-total-tokens 4096: a KV pool of 4,096 tokens takes .* GiB "
                                         r"\(.* bytes a token\) and 0.0 GiB are free on cpu"):
        core_engine(tokenizer, max_total_tokens=4096)
    assert allocations == []
    core_engine(tokenizer, max_total_tokens=64)  # 64 tokens of this model fit the MiB
    assert len(allocations) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_pool_is_checked_against_the_device(tokenizer):
    """The engine checks a pool against the memory free now; preflight against the device's whole memory, read
    without a CUDA context (a supervisor process must not take one on the device its child computes on)."""
    from relax.backends.inference.engine_core.kv_cache import pool_problem
    from relax.utils.memory import free_bytes, total_bytes

    device = torch.device("cuda", torch.cuda.current_device())
    total = total_bytes(device)
    assert total == torch.cuda.get_device_properties(device).total_memory and 0 < free_bytes(device) <= total
    assert pool_problem(total // 1024 + 1, 1024, device, whole_device=True).endswith(f"is all on {device}")
    assert pool_problem(1024, 1024, device, whole_device=True) is None
    with pytest.raises(ValueError, match="--max-total-tokens"):
        EmbeddedEngine(make_model(seed=0).to(device), tokenizer,
                       core=CoreSettings(mode="on", max_total_tokens=total // 512))


@settings(max_examples=6, deadline=None)
@given(max_batch=st.integers(1, 10**9), pool_tokens=st.integers(64, 2048))
def test_the_running_batch_and_its_host_tables_are_bounded_by_the_pool(tokenizer, max_batch, pool_tokens):
    """--rollout-max-batch-size sized the runner's rows and block tables: 10**8 asked a 48 GiB table and failed in
    numpy. A running sequence holds a block at least, so no more run than the pool has blocks; the engine still
    decodes a batch larger than that, by turns."""
    engine = EmbeddedEngine(make_model(seed=0), tokenizer, max_batch_size=max_batch,
                            core=CoreSettings(mode="on", max_total_tokens=pool_tokens, page_size=16))
    blocks = engine.core.blocks.num_blocks
    assert engine.core.scheduler.max_running == min(max_batch, blocks - 1)
    assert len(engine.core.runner._table_rows.array) <= 2 * max(blocks - 1, 256)  # 256: the largest graph batch
    outputs = asyncio.run(engine.generate([request(f"r{i}", [3 + i, 4, 5], max_new_tokens=3, ignore_eos=True)
                                           for i in range(6)]))
    assert [len(output.output_ids) for output in outputs] == [3] * 6
    assert_pool_empty(engine)


def test_weight_update_resets_the_prefix_cache(tokenizer):
    engine = core_engine(tokenizer, page_size=4)
    prompt = list(range(3, 23))
    asyncio.run(engine.generate([request("a", prompt, max_new_tokens=2, temperature=0)]))
    computed = engine.core.runner.prefill_tokens
    asyncio.run(engine.generate([request("b", prompt, max_new_tokens=2, temperature=0)]))
    assert engine.core.runner.prefill_tokens - computed == 4  # the cached prefix was reused
    new_weights = list(make_model(seed=1).named_parameters())
    asyncio.run(engine.update_weights(new_weights, version=1))
    computed = engine.core.runner.prefill_tokens
    (after,) = asyncio.run(engine.generate([request("c", prompt, max_new_tokens=2, temperature=0)]))
    assert engine.core.runner.prefill_tokens - computed == 20 and after.weight_version == 1
    reference = EmbeddedEngine(make_model(seed=1), tokenizer, core=CoreSettings(mode="off"))
    (expected,) = asyncio.run(reference.generate([request("c", prompt, max_new_tokens=2, temperature=0)]))
    assert after.output_ids == expected.output_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3"])
def test_on_cuda_the_core_agrees_with_the_training_forward(tokenizer, temperature, cache_dtype):
    """bf16 on CUDA, decode in graphs with the fused kernels: each token's log-prob equals the Hugging Face forward
    of the same tokens (the trainer's) up to bf16 rounding, as the GPU smoke tests require of the rollout (k1
    mismatch < 0.05), and a greedy token is the forward's argmax unless the top two are within rounding. Over an
    FP8 KV pool the mean gap holds (each key and value within e4m3 rounding of its head vector's largest entry);
    single tokens may be off by up to 1 nat (0.61 measured on an H200) and a greedy token may trail the top logit
    by up to 0.5."""
    model = make_model(seed=0).to("cuda", torch.bfloat16)
    core = EmbeddedEngine(model, tokenizer, core=CoreSettings(mode="on", max_total_tokens=4096,
                                                              kv_cache_dtype=cache_dtype))
    assert core.core.runner.graphs and core.core.runner.decoder.fused
    gaps = _log_prob_gaps_to_the_training_forward(model, core, temperature, cache_dtype)
    print(f"{cache_dtype} T={temperature}: mean gap {sum(gaps) / len(gaps):.4f}, max |gap| {max(map(abs, gaps)):.4f}")
    assert abs(sum(gaps) / len(gaps)) < 0.05 and max(abs(g) for g in gaps) < (0.5 if cache_dtype == "auto" else 1.0)


def _log_prob_gaps_to_the_training_forward(model, core: EmbeddedEngine, temperature: float,
                                           cache_dtype: str = "auto") -> list[float]:
    requests = [request(f"r{i}", [5 + i] * (4 + i), max_new_tokens=24, temperature=temperature, seed=i,
                        ignore_eos=True) for i in range(20)]
    outputs = asyncio.run(core.generate(requests))
    gaps = []
    for req, out in zip(requests, outputs):
        ids = torch.tensor([req.input_ids + out.output_ids], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0, len(req.input_ids) - 1:-1].float()
        scaled = logits / (temperature or 1.0)
        reference = scaled.log_softmax(-1).gather(1, torch.tensor(out.output_ids, device="cuda")[:, None])[:, 0]
        gaps += (torch.tensor(out.output_log_probs, device="cuda") - reference).tolist()
        if temperature == 0:
            top2 = logits.topk(2, dim=-1).values
            chosen = logits.gather(1, torch.tensor(out.output_ids, device="cuda")[:, None])[:, 0]
            # within a few bf16 steps of the top logit (the forward of the whole sequence rounds differently)
            rounding = 0.125 if cache_dtype == "auto" else 0.5
            assert torch.all((chosen >= top2[:, 0]) | (top2[:, 0] - chosen < rounding))
    return gaps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3"])
def test_on_cuda_decode_in_the_cuda_attention_kernel_agrees_with_the_triton_kernel(tokenizer, cache_dtype,
                                                                                  monkeypatch):
    """The engine's decode through `cuda_attention` (head dimension 128, groups of 2 query heads: the shapes it
    takes; the other tests' models have 16-dimensional heads and run the Triton kernel), inside the decode graphs,
    over a bf16 and an FP8 pool, against the same engine with decode attention in the Triton kernel over the same
    pool: the kernels differ only in the order they add in, so greedy decoding takes the same tokens until a
    near-tie, and the log-probs up to and including a first difference agree up to rounding. Over a bf16
    pool each token's log-prob is also the training forward's up to rounding (over an FP8 one the forward reads
    unrounded keys and values, which `test_on_cuda_the_core_agrees_with_the_training_forward` bounds loosely)."""
    from relax.backends.inference.engine_core import cuda_attention

    assert cuda_attention.ENGINE_TAKES_IT
    launched = []
    kernel = cuda_attention.paged_decode_attention
    monkeypatch.setattr(cuda_attention, "paged_decode_attention",
                        lambda *args, **kwargs: launched.append(args[1].dtype) or kernel(*args, **kwargs))
    model = _model_with_heads_of(128).to("cuda", torch.bfloat16)
    requests = [request(f"r{i}", [5 + i] * (4 + i), max_new_tokens=24, temperature=0.0, ignore_eos=True)
                for i in range(20)]

    def decoded() -> list:
        engine = EmbeddedEngine(model, tokenizer, core=CoreSettings(mode="on", max_total_tokens=4096,
                                                                    kv_cache_dtype=cache_dtype))
        return asyncio.run(engine.generate(requests))

    in_cuda = decoded()
    # captured into the decode graphs, over the pool asked for: one byte an entry over FP8, two over bf16
    assert launched and {dtype.itemsize for dtype in launched} == {1 if cache_dtype == "fp8_e4m3" else 2}
    launched.clear()
    monkeypatch.setattr(cuda_attention, "ENGINE_TAKES_IT", False)
    in_triton = decoded()
    assert not launched
    gaps, differing = [], 0
    for a, b in zip(in_cuda, in_triton):
        same = next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y), len(a.output_ids))
        differing += same < len(a.output_ids)
        compared = min(same + 1, len(a.output_ids))  # a first difference is a near-tie: the best log-probs agree
        gaps += [abs(x - y) for x, y in zip(a.output_log_probs[:compared], b.output_log_probs[:compared])]
    print(f"{cache_dtype}: {differing} of {len(requests)} greedy outputs differ; log-prob gaps: mean "
          f"{sum(gaps) / len(gaps):.5f}, largest {max(gaps):.4f}")
    # a bf16 step of an attention output moves a log-prob by under a tenth in this model (H100, 2026-12-06: mean
    # 0.0085 and at most 0.091 over bf16, 4 outputs of 20 parting at a near-tie; 0.0025 and 0.047 over FP8, 1)
    assert sum(gaps) / len(gaps) < 0.02 and max(gaps) < 0.15
    assert differing <= len(requests) // 2  # mostly the same tokens: a gap that moved every argmax would fail here
    if cache_dtype == "auto":
        monkeypatch.setattr(cuda_attention, "ENGINE_TAKES_IT", True)
        engine = EmbeddedEngine(model, tokenizer, core=CoreSettings(mode="on", max_total_tokens=4096))
        gaps = _log_prob_gaps_to_the_training_forward(model, engine, 0.0)
        assert abs(sum(gaps) / len(gaps)) < 0.05 and max(abs(g) for g in gaps) < 0.5


def _model_with_heads_of(head_dim: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    reference = make_model(seed=0).config
    config = Qwen3Config(**{**reference.to_dict(), "head_dim": head_dim, "hidden_size": 128,
                            "intermediate_size": 256})
    return Qwen3ForCausalLM(config).eval()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_weights_laid_out_column_major_decode_as_the_training_forward(tokenizer, monkeypatch):
    """Every product's weight column-major (taken whatever the timing says): the decode graphs still agree with
    the training forward, before and after a weight update (an in-place copy into the strided parameters) and a
    release and reload of the engine's memory, and the parameters keep their layout through both."""
    from relax.backends.inference.engine_core import weight_layouts

    monkeypatch.setattr(weight_layouts, "MEASURE", True)
    monkeypatch.setattr(weight_layouts, "MARGIN", -1.0)  # column-major however it times
    model = make_model(seed=0).to("cuda", torch.bfloat16)
    core = EmbeddedEngine(model, tokenizer, core=CoreSettings(mode="on", max_total_tokens=4096))
    layouts = core.core.runner.decoder.weight_layouts
    assert set(layouts) == {"qkv", "o", "gate_up", "down"} and all(t.column_major for t in layouts.values())
    assert all(t.as_stored_us > 0 and t.column_major_us > 0 for t in layouts.values())
    down = model.model.layers[0].mlp.down_proj.weight
    assert down.t().is_contiguous() and not down.is_contiguous()
    for step in range(2):
        gaps = _log_prob_gaps_to_the_training_forward(model, core, temperature=0.0)
        assert abs(sum(gaps) / len(gaps)) < 0.05 and max(abs(g) for g in gaps) < 0.5
        new_weights = make_model(seed=step + 1).to("cuda", torch.bfloat16)
        asyncio.run(core.release_memory_occupation())
        asyncio.run(core.resume_memory_occupation())
        asyncio.run(core.update_weights(new_weights.state_dict().items(), version=step + 1))
        assert model.model.layers[0].mlp.down_proj.weight.t().is_contiguous()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads, kv_heads, page", [(16, 8, 16), (32, 8, 16), (4, 4, 8)])
@pytest.mark.parametrize("cache_dtype, widen_by_bits", [("auto", False), ("fp8_e4m3", False), ("fp8_e4m3", True)])
@pytest.mark.parametrize("layout, heads_first", [("slot_major", False), ("slot_major", True), ("head_major", True)])
def test_the_triton_decode_kernel_matches_attention_over_the_gathered_keys(heads, kv_heads, page, cache_dtype,
                                                                           widen_by_bits, layout, heads_first):
    """Also over an FP8 pool (``--kv-cache-dtype fp8_e4m3``): against attention over the dequantized keys and
    values, so what is checked is the kernel's use of the scales, not the quantisation. The pool may be stored
    head-major (the kernel reads its strides), and the grid may run one KV head's sequences side by side (the
    benchmark's baseline) instead of one sequence's KV heads."""
    from relax.backends.inference.engine_core.kv_cache import LayerKV, quantize_heads
    from relax.backends.inference.engine_core.triton_attention import paged_decode_attention

    torch.manual_seed(0)
    dim, blocks, batch = 128, 600, 9
    keys = torch.randn(blocks * page, kv_heads, dim, device="cuda", dtype=torch.bfloat16) * 3
    values = torch.randn_like(keys)
    scales = {}
    if cache_dtype == "fp8_e4m3":
        (keys, scales["key_scales"]), (values, scales["value_scales"]) = quantize_heads(keys), quantize_heads(values)
        cache = LayerKV(keys, values, scales["key_scales"], scales["value_scales"])
        all_slots = torch.arange(keys.shape[0], device="cuda")
        keys_read, values_read = cache.gather(all_slots, torch.bfloat16)
    else:
        keys_read, values_read = keys, values
    lens = torch.tensor([1, 2, 15, 16, 17, 64, 65, 300, 777], dtype=torch.int32, device="cuda")
    tables = torch.zeros(batch, 128, dtype=torch.int32, device="cuda")
    order = (torch.randperm(blocks - 1, device="cuda") + 1).to(torch.int32)
    used = 0
    for row, length in enumerate(lens.tolist()):
        count = -(-length // page)
        tables[row, :count] = order[used:used + count]
        used += count
    query = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    if layout == "head_major":  # the same values, [Hkv, slots, D] in memory
        keys, values = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (keys, values))
        scales = {name: x.t().contiguous().t() for name, x in scales.items()}
    out = paged_decode_attention(query, keys, values, tables, lens, dim ** -0.5, page, heads_first=heads_first,
                                 widen_by_bits=widen_by_bits, **scales)
    for row, length in enumerate(lens.tolist()):
        positions = torch.arange(length, device="cuda")
        slots = tables[row].long()[positions // page] * page + positions % page
        k = keys_read[slots].float().repeat_interleave(heads // kv_heads, dim=1)
        v = values_read[slots].float().repeat_interleave(heads // kv_heads, dim=1)
        probs = (torch.einsum("hd,lhd->hl", query[row].float(), k) * dim ** -0.5).softmax(-1)
        expected = torch.einsum("hl,lhd->hd", probs, v)
        error = (out[row].float() - expected).norm() / expected.norm()
        assert error < 1e-2, (row, length, error)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_widening_e4m3_by_its_bits_gives_every_finite_code_times_two_to_the_minus_120():
    """The FP8 decode kernel's integer widening of e4m3 bytes to bf16, over all 254 finite codes (subnormals, both
    zeros, both signs), each code in each of the four positions of a register."""
    import triton
    import triton.language as tl

    from relax.backends.inference.engine_core.triton_attention import _e4m3_bits_to_bf16

    @triton.jit
    def widen(src, dst, N: tl.constexpr):
        offsets = tl.arange(0, N)
        tl.store(dst + offsets, _e4m3_bits_to_bf16(tl.load(src + offsets)))

    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[torch.isfinite(codes.to(torch.uint8).view(torch.float8_e4m3fn).float())]
    rotations = torch.stack([codes.roll(shift) for shift in range(4)]).flatten()  # each code at each position
    size = triton.next_power_of_2(rotations.numel())
    src = torch.zeros(size, dtype=torch.uint8)
    src[:rotations.numel()] = rotations.to(torch.uint8)
    dst = torch.empty(size, dtype=torch.bfloat16, device="cuda")
    widen[(1,)](src.cuda(), dst, N=size)
    expected = src.view(torch.float8_e4m3fn).double() * 2.0 ** -120
    assert torch.equal(dst.cpu().double(), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("key_magnitude, value_magnitude, query_magnitude", [
    (1e-4, 1e-4, 1e3), (1e4, 1e4, 1e-3), (1.0, 1e-4, 1.0), (1e-4, 1e4, 1.0)])
def test_the_fp8_decode_kernel_widening_by_bits_holds_over_magnitudes(key_magnitude, value_magnitude,
                                                                      query_magnitude):
    """The kernel carries the query and the probabilities 2**64 up so that its 2**-120 keys and values multiply
    inside float32's normal range: its output over an FP8 pool equals the conversion path's across the magnitudes
    a head vector can take."""
    from relax.backends.inference.engine_core.kv_cache import quantize_heads
    from relax.backends.inference.engine_core.triton_attention import paged_decode_attention

    torch.manual_seed(1)
    batch, heads, kv_heads, dim, page, context = 6, 32, 8, 128, 16, 200
    keys = torch.randn(batch * 16 * page, kv_heads, dim, device="cuda") * key_magnitude
    values = torch.randn_like(keys) * value_magnitude
    (keys, key_scales), (values, value_scales) = quantize_heads(keys), quantize_heads(values)
    tables = torch.arange(batch * 16, device="cuda", dtype=torch.int32).view(batch, 16)
    lens = torch.tensor([1, 7, 16, 33, 150, context], device="cuda", dtype=torch.int32)
    query = (torch.randn(batch, heads, dim, device="cuda") * query_magnitude).to(torch.bfloat16)
    outs = [paged_decode_attention(query, keys, values, tables, lens, dim ** -0.5, page, key_scales=key_scales,
                                   value_scales=value_scales, widen_by_bits=widen) for widen in (False, True)]
    assert torch.isfinite(outs[1]).all()
    error = (outs[1].float() - outs[0].float()).norm() / outs[0].float().norm()
    assert error < 1e-2, error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads, kv_heads", [(16, 8), (32, 8), (4, 4)])
def test_the_varlen_prefill_matches_the_padded_prefill(heads, kv_heads):
    """Prompts with and without a cached prefix in the pool (a query block shorter than its keys): FlashAttention's
    varlen kernel gives the padded SDPA path's attention, so its causal mask is aligned bottom-right."""
    from relax.backends.inference.engine_core.attention import attend, prefill_metadata
    from relax.backends.inference.engine_core.kv_cache import LayerKV
    from relax.backends.models import flash_varlen

    if not flash_varlen.available():
        pytest.skip("this PyTorch has no varlen FlashAttention")
    torch.manual_seed(0)
    dim, page, blocks = 128, 16, 400
    keys = torch.randn(blocks * page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    starts, ends = [0, 0, 32, 48, 5, 0], [1, 37, 40, 300, 6, 16]
    order = (torch.randperm(blocks - 1) + 1).tolist()
    tables, used = [], 0
    for end in ends:
        count = -(-end // page)
        tables.append(order[used:used + count])
        used += count
    query = torch.randn(sum(e - s for s, e in zip(starts, ends)), heads, dim, device="cuda", dtype=torch.bfloat16)
    cache = LayerKV(keys, values)
    padded = attend(query, cache, prefill_metadata(page, tables, starts, ends, torch.device("cuda")), 0.1)
    varlen = attend(query, cache, prefill_metadata(page, tables, starts, ends, torch.device("cuda"), varlen=True), 0.1)
    error = (varlen.float() - padded.float()).norm() / padded.float().norm()
    assert error < 1e-2, error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("varlen", [True, False])
def test_a_prefills_inputs_reach_the_device_without_waiting_for_it(varlen):
    """A pipelined prefill builds its inputs while the step before it runs: the metadata's copies queue behind the
    device's work instead of waiting for it (a plain ``.to`` from pageable memory synchronises the stream), and
    carry the same values."""
    from relax.backends.inference.engine_core.attention import prefill_metadata

    tables, starts, ends = [[3, 4, 5], [6, 7]], [0, 4], [40, 30]
    warm = prefill_metadata(16, tables, starts, ends, torch.device("cuda"), varlen=varlen)  # warms the pinned
    torch.cuda.synchronize()  # host allocator, as an engine's earlier steps have (a first cudaHostAlloc may wait)
    torch.cuda._sleep(2_000_000_000)  # about a second of device work in flight
    metadata = prefill_metadata(16, tables, starts, ends, torch.device("cuda"), varlen=varlen)
    assert not torch.cuda.current_stream().query()  # the host came back with the device still busy
    torch.cuda.synchronize()
    reference = prefill_metadata(16, tables, starts, ends, torch.device("cpu"), varlen=varlen)
    for field in ("slot_mapping", "key_slots", "cu_seqlens_q", "cu_seqlens_k", "query_rows", "mask", "packed_rows"):
        value = getattr(reference, field)
        if value is not None:
            assert torch.equal(getattr(metadata, field).cpu(), value), field
            assert torch.equal(getattr(warm, field).cpu(), value), field
