"""EmbeddedEngine against real tiny Qwen3 models (random init) and an offline char-level tokenizer."""

from __future__ import annotations

import asyncio
import string

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARACTERS = string.digits + string.ascii_lowercase + " +-=*/.,:;!?()'\"#<>[]{}_@"
PAD_ID, EOS_ID = 0, 2
PROMPTS = ["hello", "a+b=", "the quick brown fox", "7*8=5", "x"]


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A 64-token char-level tokenizer: three specials, then one token per character."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )


def make_model(seed: int) -> Qwen3ForCausalLM:
    # initializer_range 0.3 (not the default 0.02) gives peaked, varied next-token distributions,
    # so greedy outputs are not one repeated token and argmax ties are far apart.
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=None,
        initializer_range=0.3,
    )
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


# Every contract test runs on both of the core's runners: the model's own forward and cache ("off") and the paged
# decoder ("on").
ENGINE_PATHS = ["model_cache", "paged"]


def make_engine(model, tokenizer, path: str, **kwargs) -> EmbeddedEngine:
    return EmbeddedEngine(model, tokenizer, core=CoreSettings(mode="on" if path == "paged" else "off"), **kwargs)


@pytest.fixture(params=ENGINE_PATHS)
def engine_path(request) -> str:
    return request.param


@pytest.fixture
def engine(tokenizer, engine_path) -> EmbeddedEngine:
    engine = make_engine(make_model(seed=0), tokenizer, engine_path)
    assert engine.core.kind == engine_path
    return engine


def requests_for(tokenizer, prompts=PROMPTS, **params) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            request_id=f"r{index}", input_ids=tokenizer.encode(prompt), sampling_params=SamplingParams(**params)
        )
        for index, prompt in enumerate(prompts)
    ]


def generate(engine: EmbeddedEngine, requests: list[GenerationRequest]):
    return asyncio.run(engine.generate(requests))


def hf_greedy(model, tokenizer, prompts, max_new_tokens: int) -> list[list[int]]:
    """`model.generate` greedy continuations, cut after the first EOS (it pads finished rows)."""
    encoded = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    generated = model.generate(**encoded, do_sample=False, max_new_tokens=max_new_tokens)
    continuations = []
    for row in generated[:, encoded.input_ids.shape[1] :].tolist():
        continuations.append(row[: row.index(EOS_ID) + 1] if EOS_ID in row else row)
    return continuations


def test_greedy_matches_hf_generate(engine, tokenizer):
    outputs = generate(engine, requests_for(tokenizer, max_new_tokens=16, temperature=0.0))
    expected = hf_greedy(engine.model, tokenizer, PROMPTS, max_new_tokens=16)
    assert [output.output_ids for output in outputs] == expected
    for output, expected_ids in zip(outputs, expected):
        assert output.finish_reason == ("stop" if expected_ids[-1] == EOS_ID else "length")
        assert output.text == tokenizer.decode(expected_ids, skip_special_tokens=True)
        assert output.weight_version == 0


def test_max_batch_size_splits_without_changing_greedy_outputs(engine, tokenizer):
    whole = generate(engine, requests_for(tokenizer, max_new_tokens=10, temperature=0.0))
    engine.max_batch_size = 2
    split = generate(engine, requests_for(tokenizer, max_new_tokens=10, temperature=0.0))
    assert [output.request_id for output in split] == [f"r{index}" for index in range(len(PROMPTS))]
    assert [output.output_ids for output in split] == [output.output_ids for output in whole]


def test_requests_sharing_a_prompt_share_its_prefill_but_sample_independently(engine, tokenizer):
    grouped_prompts = [prompt for prompt in PROMPTS for _ in range(4)]  # GRPO-style groups of 4
    greedy = generate(engine, requests_for(tokenizer, grouped_prompts, max_new_tokens=12, temperature=0.0))
    alone = generate(engine, requests_for(tokenizer, max_new_tokens=12, temperature=0.0))
    for index, output in enumerate(greedy):
        reference = alone[index // 4]
        assert output.output_ids == reference.output_ids
        assert output.output_log_probs == pytest.approx(reference.output_log_probs, abs=1e-5)
    before = engine.core.runner.prefill_tokens
    sampled = generate(engine, requests_for(tokenizer, grouped_prompts, max_new_tokens=12, seed=3))
    computed = engine.core.runner.prefill_tokens - before
    distinct = sum(len(request.input_ids) for request in requests_for(tokenizer))
    # Each prompt is computed once for its group of 4 (the paged runner may also reuse blocks cached earlier).
    assert computed == distinct if engine.core.kind == "model_cache" else 0 < computed <= distinct
    first_group = [tuple(output.output_ids) for output in sampled[:4]]
    assert len(set(first_group)) > 1  # one prefill, yet four different samples


def test_log_probs_match_teacher_forced_forward(engine, tokenizer):
    temperature = 0.7
    # Filters must not change the reported log-probs, which are taken before filtering.
    outputs = generate(
        engine, requests_for(tokenizer, max_new_tokens=12, temperature=temperature, top_k=10, top_p=0.9, seed=3)
    )
    for request, output in zip(requests_for(tokenizer), outputs):
        sequence = torch.tensor([request.input_ids + output.output_ids])
        with torch.no_grad():
            logits = engine.model(sequence).logits[0].float()
        prompt_length = len(request.input_ids)
        positions = torch.arange(prompt_length - 1, sequence.shape[1] - 1)
        expected = torch.log_softmax(logits[positions] / temperature, dim=-1)
        expected = expected.gather(1, torch.tensor(output.output_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(output.output_log_probs), expected, atol=1e-4, rtol=0)


def test_greedy_log_probs_are_plain_log_softmax(engine, tokenizer):
    request = requests_for(tokenizer, prompts=["hello"], max_new_tokens=6, temperature=0.0, ignore_eos=True)[0]
    output = generate(engine, [request])[0]
    with torch.no_grad():
        logits = engine.model(torch.tensor([request.input_ids + output.output_ids])).logits[0]
    expected = torch.log_softmax(logits[len(request.input_ids) - 1 : -1], dim=-1)
    expected = expected.gather(1, torch.tensor(output.output_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(output.output_log_probs), expected, atol=1e-4, rtol=0)


def test_same_seed_same_samples_different_seed_different_samples(engine, tokenizer):
    def sample(seed: int) -> list[list[int]]:
        outputs = generate(
            engine, requests_for(tokenizer, max_new_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
        )
        return [output.output_ids for output in outputs]

    assert sample(seed=7) == sample(seed=7)
    assert sample(seed=7) != sample(seed=8)


def test_top_k_one_equals_greedy(engine, tokenizer):
    greedy = generate(engine, requests_for(tokenizer, max_new_tokens=12, temperature=0.0))
    top_one = generate(engine, requests_for(tokenizer, max_new_tokens=12, temperature=1.3, top_k=1, seed=1))
    assert [output.output_ids for output in top_one] == [output.output_ids for output in greedy]


def test_per_row_params_in_one_batch(engine, tokenizer):
    """A greedy row keeps its greedy output next to sampling rows with other settings."""
    greedy_alone = generate(engine, requests_for(tokenizer, prompts=["hello"], max_new_tokens=12, temperature=0.0))
    mixed = requests_for(tokenizer, prompts=["hello", "hello", "hello"], max_new_tokens=12)
    mixed[0].sampling_params.temperature = 0.0
    mixed[1].sampling_params.top_p = 0.5
    mixed[2].sampling_params.top_k = 3
    outputs = generate(engine, mixed)
    assert outputs[0].output_ids == greedy_alone[0].output_ids


def test_max_new_tokens_per_row_finishes_with_length(engine, tokenizer):
    """Rows of different lengths leave the batch early (compaction) without disturbing the others."""
    limits = [3, 5, 9, 1, 9]
    requests = requests_for(tokenizer, max_new_tokens=9, temperature=0.0, ignore_eos=True)
    full_length = generate(engine, requests)
    for request, limit in zip(requests, limits):
        request.sampling_params.max_new_tokens = limit
    outputs = generate(engine, requests)
    for output, reference, limit in zip(outputs, full_length, limits):
        assert output.finish_reason == "length"
        assert output.output_ids == reference.output_ids[:limit]
        assert len(output.output_log_probs) == limit


def test_eos_from_generation_config_stops_unless_ignored(tokenizer, engine_path):
    model = make_model(seed=0)
    request = requests_for(tokenizer, prompts=["hello"], max_new_tokens=12, temperature=0.0, ignore_eos=True)[0]
    reference = generate(make_engine(model, tokenizer, engine_path), [request])[0].output_ids
    # The model's generation config may name EOS ids beyond the tokenizer's.
    model.generation_config.eos_token_id = [EOS_ID, reference[3]]
    engine = make_engine(model, tokenizer, engine_path)

    ignored = generate(engine, [request])[0]
    assert ignored.output_ids == reference and ignored.finish_reason == "length"
    request.sampling_params.ignore_eos = False
    stopped = generate(engine, [request])[0]
    assert stopped.output_ids == reference[: reference.index(reference[3]) + 1]
    assert stopped.finish_reason == "stop"


def test_stop_token_id_and_stop_string(engine, tokenizer):
    request = requests_for(
        tokenizer, prompts=["the quick brown fox"], max_new_tokens=16, temperature=0.0, ignore_eos=True
    )[0]
    reference = generate(engine, [request])[0].output_ids

    stop_token = reference[4]
    request.sampling_params.stop_token_ids = [stop_token]
    by_token = generate(engine, [request])[0]
    assert by_token.finish_reason == "stop"
    assert by_token.output_ids == reference[: reference.index(stop_token) + 1]

    stop_string = tokenizer.decode(reference[5:7])
    request.sampling_params.stop_token_ids = []
    request.sampling_params.stop = ["never in output @@@@", stop_string]
    by_string = generate(engine, [request])[0]
    first_match_end = next(end for end in range(1, 17) if stop_string in tokenizer.decode(reference[:end]))
    assert by_string.finish_reason == "stop"
    assert by_string.output_ids == reference[:first_match_end]
    assert by_string.text.endswith(stop_string)


def test_abort_from_another_task_mid_generation(engine, tokenizer):
    async def scenario():
        requests = requests_for(
            tokenizer, prompts=["hello", "x"], max_new_tokens=20_000, temperature=1.0, ignore_eos=True
        )
        steps_before = (await engine.health())["decode_steps"]
        task = asyncio.create_task(engine.generate(requests))
        while (await engine.health())["decode_steps"] < steps_before + 5:
            await asyncio.sleep(0.005)
        await engine.abort(["r0", "r1", "not-in-flight"])
        return await task

    outputs = asyncio.run(scenario())
    for output in outputs:
        assert output.finish_reason == "abort"
        assert 5 <= len(output.output_ids) < 20_000
        assert len(output.output_log_probs) == len(output.output_ids)
    assert asyncio.run(engine.health())["in_flight_requests"] == 0


def test_pause_blocks_new_generate_until_resume(engine, tokenizer):
    async def scenario():
        await engine.pause()
        assert (await engine.health())["paused"] is True
        task = asyncio.create_task(engine.generate(requests_for(tokenizer, max_new_tokens=4, temperature=0.0)))
        await asyncio.sleep(0.2)
        blocked = not task.done()
        steps_while_paused = (await engine.health())["decode_steps"]
        await engine.resume()
        return blocked, steps_while_paused, await task

    blocked, steps_while_paused, outputs = asyncio.run(scenario())
    assert blocked and steps_while_paused == 0
    assert all(output.finish_reason in ("stop", "length") for output in outputs)


async def start_endless_generation(engine, tokenizer) -> asyncio.Task:
    """A one-request generation (id "r0") that only an abort ends, once it has run three steps."""
    task = asyncio.create_task(
        engine.generate(requests_for(tokenizer, prompts=["hello"], max_new_tokens=20_000, ignore_eos=True))
    )
    while (await engine.health())["decode_steps"] < 3:
        await asyncio.sleep(0.005)
    return task


def test_abort_while_paused_returns_without_resume(engine, tokenizer):
    async def scenario():
        task = await start_endless_generation(engine, tokenizer)
        await engine.pause()
        await engine.abort(["r0"])
        return await task

    [output] = asyncio.run(scenario())
    assert output.finish_reason == "abort" and len(output.output_ids) >= 3


def test_weight_update_while_paused_is_recorded_per_token(tokenizer, engine_path):
    engine = make_engine(make_model(seed=0), tokenizer, engine_path)
    new_weights = list(make_model(seed=1).named_parameters())

    async def scenario():
        task = await start_endless_generation(engine, tokenizer)
        await engine.pause()
        steps_at_pause = (await engine.health())["decode_steps"]
        await engine.update_weights(new_weights, version=1)
        await asyncio.sleep(0.05)
        assert (await engine.health())["decode_steps"] == steps_at_pause
        await engine.resume()
        while (await engine.health())["decode_steps"] < steps_at_pause + 3:
            await asyncio.sleep(0.005)
        await engine.abort(["r0"])
        return steps_at_pause, await task

    steps_at_pause, [output] = asyncio.run(scenario())
    versions = output.output_weight_versions
    assert len(versions) == len(output.output_ids)
    assert versions == [0] * steps_at_pause + [1] * (len(versions) - steps_at_pause)
    assert output.weight_version == 1


def test_update_weights_loads_another_model(engine, tokenizer):
    other = make_model(seed=1)
    before = generate(engine, requests_for(tokenizer, max_new_tokens=12, temperature=0.0))
    expected = hf_greedy(other, tokenizer, PROMPTS, max_new_tokens=12)
    assert [output.output_ids for output in before] != expected

    asyncio.run(engine.update_weights(other.state_dict().items(), version=5))
    after = generate(engine, requests_for(tokenizer, max_new_tokens=12, temperature=0.0))
    assert [output.output_ids for output in after] == expected
    assert engine.weight_version == 5 and all(output.weight_version == 5 for output in after)
    assert asyncio.run(engine.health())["weight_version"] == 5
    # Tied embeddings: the output projection still is the input embedding.
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert torch.equal(engine.model.lm_head.weight, other.model.embed_tokens.weight)


def test_update_weights_through_either_tied_name_and_casts_dtype(engine):
    embedding = torch.randn_like(engine.model.model.embed_tokens.weight).to(torch.bfloat16)
    asyncio.run(engine.update_weights([("lm_head.weight", embedding)], version=1))
    assert engine.model.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(engine.model.model.embed_tokens.weight, embedding.float())


def test_update_weights_rejects_unknown_name_and_wrong_shape(engine):
    with pytest.raises(KeyError, match="model.layers.99.mlp.up_proj.weight"):
        asyncio.run(engine.update_weights([("model.layers.99.mlp.up_proj.weight", torch.zeros(1))], version=1))
    with pytest.raises(ValueError, match="model.norm.weight"):
        asyncio.run(engine.update_weights([("model.norm.weight", torch.zeros(3))], version=1))
    assert engine.weight_version == 0


def test_invalid_requests_are_rejected_before_work(engine, tokenizer):
    [request] = requests_for(tokenizer, prompts=["hello"])
    request.multimodal_inputs = {"images": ["cat.png"]}
    with pytest.raises(TypeError, match="multimodal_inputs must be processor tensors"):
        generate(engine, [request])
    with pytest.raises(ValueError, match="input_ids"):
        generate(engine, [GenerationRequest("empty", [], SamplingParams())])
    assert generate(engine, []) == []


def test_from_pretrained_loads_a_saved_folder(tmp_path, tokenizer):
    model = make_model(seed=0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = EmbeddedEngine.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
    assert not engine.model.training and not any(p.requires_grad for p in engine.model.parameters())
    outputs = generate(engine, requests_for(tokenizer, max_new_tokens=8, temperature=0.0))
    assert [output.output_ids for output in outputs] == hf_greedy(model, tokenizer, PROMPTS, max_new_tokens=8)


def test_health(engine):
    health = asyncio.run(engine.health())
    assert health["status"] == "ok" and health["device"] == "cpu" and health["paused"] is False
    assert health["weight_version"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_greedy_matches_hf_generate_and_sampling_is_seeded(tokenizer):
    engine = EmbeddedEngine(make_model(seed=0).to("cuda"), tokenizer)
    greedy = generate(engine, requests_for(tokenizer, max_new_tokens=16, temperature=0.0))
    assert [output.output_ids for output in greedy] == hf_greedy(engine.model, tokenizer, PROMPTS, max_new_tokens=16)

    def sample(seed: int) -> list[list[int]]:
        outputs = generate(engine, requests_for(tokenizer, max_new_tokens=16, top_p=0.9, seed=seed, ignore_eos=True))
        return [output.output_ids for output in outputs]

    assert sample(seed=7) == sample(seed=7) != sample(seed=8)
    assert asyncio.run(engine.health())["device"] == "cuda:0"


def test_generate_streaming_reports_each_request_as_it_finishes(engine, tokenizer):
    """Requests leave in the order they finish (short ones first), each reported once, with the output the call
    returns; the samples equal a plain `generate` with the same seed (streaming changes no randomness)."""
    limits = [9, 1, 5, 3, 9]
    requests = requests_for(tokenizer, max_new_tokens=9, temperature=1.0, seed=7, ignore_eos=True)
    for request, limit in zip(requests, limits):
        request.sampling_params.max_new_tokens = limit
    plain = generate(engine, requests)
    reported: list[tuple[int, object]] = []

    async def run():
        return await engine.generate_streaming(requests, lambda position, output: reported.append((position, output)))

    outputs = asyncio.run(run())
    assert sorted(position for position, _ in reported) == list(range(len(requests)))
    assert all(outputs[position] is output for position, output in reported)
    assert [o.output_ids for o in outputs] == [o.output_ids for o in plain]
    order = [position for position, _ in reported]
    assert order[0] == 1 and set(order[-2:]) == {0, 4}  # per request: the 1-token one first, the 9-token ones last


def test_the_batcher_answers_each_job_when_its_own_requests_finish(tokenizer):
    """Two callers merged into one engine call (the core): the one whose request stops after a token gets its answer
    while the other's still decodes, as `relax serve` answers a finished GRPO group before the call ends."""
    from relax.backends.inference.batcher import RequestBatcher

    engine = make_engine(make_model(seed=0), tokenizer, "paged")
    short, long = requests_for(tokenizer, prompts=PROMPTS[:2], max_new_tokens=1, ignore_eos=True)
    long.sampling_params.max_new_tokens = 40

    async def run():
        batcher = RequestBatcher(engine, window_s=0.05)
        batcher.start()
        try:
            slow = asyncio.ensure_future(batcher.generate([long]))
            [quick] = await batcher.generate([short])
            answered_first = not slow.done()
            [late] = await slow
        finally:
            await batcher.stop()
        return batcher.engine_calls, quick, late, answered_first

    calls, quick, late, answered_first = asyncio.run(run())
    assert calls == 1 and answered_first
    assert len(quick.output_ids) == 1 and len(late.output_ids) == 40


@pytest.mark.parametrize("path", ENGINE_PATHS)
def test_a_sequence_ends_at_the_models_last_position(tokenizer, path):
    """A prompt that fills the model's positions is refused naming the limit; one that leaves room for a few tokens
    ends there with finish reason "length", whatever max_new_tokens asked (instead of indexing past the rotary
    tables)."""
    model = make_model(seed=0)
    model.config.max_position_embeddings = 64
    engine = make_engine(model, tokenizer, path)
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match=r"64 prompt tokens leave no room .* \(max_position_embeddings\)"):
        asyncio.run(engine.generate([GenerationRequest("full", [3] * 64, params)]))
    [output] = asyncio.run(engine.generate([GenerationRequest("near", [3 + i % 40 for i in range(61)], params)]))
    assert output.finish_reason == "length" and len(output.output_ids) == 3
