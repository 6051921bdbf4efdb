"""Rollout routing replay (R3, `--use-rollout-routing-replay`; issue 18): the engine records the experts of every
token it feeds its MoE layers, the trainer's policy forwards route tokens to them.

The acceptance case (`test_replay_closes_the_train_rollout_gap`): an engine whose router scores differ from the
trainer's in the sixth decimal at nearly tied experts (what bf16 kernels and batch shapes do to real routers) picks
other experts for many tokens, and its log-probs differ from the trainer's by up to 1e-2 nats; with replay they
agree to float32 rounding (the dense families' tolerance, 1e-5), in packed and in padded micro-batches.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import httpx
import pytest
import torch
import transformers

from relax.algorithms.loss import build_policy_loss_fn
from relax.algorithms.policy_loss import PolicyLossSettings
from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.embedded import EmbeddedEngine
from relax.backends.inference.remote.sglang import SGLangHTTPEngine
from relax.backends.models.family import load_model
from relax.backends.models.routing_replay import (
    RoutingRecorder,
    RoutingReplay,
    decode_routes,
    encode_routes,
    moe_routers,
    replayed_weights,
    token_routes,
)
from relax.backends.training.base import TrainBatch
from relax.backends.training.fsdp import FSDPTrainBackend
from relax.backends.training.settings import TrainSettings
from relax.cli.main import main
from relax.telemetry.metrics_file import read_metrics
from tests.support.http_servers import Server
from tests.support.tiny_families import TEXT_CONFIGS, build_text_family
from tests.support.tiny_mm_assets import build_tiny_qwen3_5_vl, build_tiny_qwen3_omni, build_tiny_qwen3_vl

MOE_FAMILIES = [name for name, config in TEXT_CONFIGS.items() if "num_experts" in config and name != "glm_moe_dsa"]
LOG_PROB_TOLERANCE = 1e-5  # tests/backends/models/test_model_families.py: the engine and the trainer of a dense family
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12][: 3 + i % 5] for i in range(24)]


def _settings(**changes) -> TrainSettings:
    base = TrainSettings(device=torch.device("cpu"), compute_dtype=torch.float32, micro_batch_size=8,
                         temperature=1.0, pad_token_id=0)
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    dirs = {name: build_text_family(name, root / name) for name in MOE_FAMILIES}
    dirs["qwen3_vl_moe"] = build_tiny_qwen3_vl(root / "qwen3_vl_moe", experts=True)
    dirs["qwen3_5_moe"] = build_tiny_qwen3_5_vl(root / "qwen3_5_moe", experts=True)
    dirs["qwen3_omni_moe"] = build_tiny_qwen3_omni(root / "qwen3_omni_moe")
    return dirs


def _generate(engine: EmbeddedEngine, prompts=PROMPTS, max_new_tokens: int = 16, **request_fields):
    requests = [GenerationRequest(f"r{i}", list(p), SamplingParams(max_new_tokens=max_new_tokens, seed=i),
                                  **{"return_routed_experts": True, **request_fields})
                for i, p in enumerate(prompts)]
    return asyncio.run(engine.generate(requests))


def _gaps(backend: FSDPTrainBackend, prompts, outputs, replay: bool) -> torch.Tensor:
    tokens = [list(p) + o.output_ids for p, o in zip(prompts, outputs)]
    lengths = [len(o.output_ids) for o in outputs]
    batch = TrainBatch(tokens, lengths, [[1] * n for n in lengths],
                       routed_experts=[o.routed_experts for o in outputs] if replay else None)
    log_probs = backend.compute_log_probs(batch).log_probs
    return torch.cat([(mine - torch.tensor(o.output_log_probs)).abs() for mine, o in zip(log_probs, outputs)])


@pytest.mark.parametrize("family", [*MOE_FAMILIES, "qwen3_vl_moe", "qwen3_5_moe", "qwen3_omni_moe"])
def test_a_router_replaying_its_own_choice_computes_what_it_computed(family, moe_dirs):
    """`replayed_weights` is each family's own formula: at the router's own experts it gives its own weights (and
    the same forward); at other experts the forward changes (the replay is not a no-op)."""
    model = load_model(moe_dirs[family], torch.float32).eval()
    routers = moe_routers(model)
    assert routers, family
    for router in routers:
        hidden = torch.randn(37, router.hidden_dim)
        logits, weights, experts = router(hidden)
        assert torch.allclose(replayed_weights(router, logits, experts).to(weights.dtype), weights, atol=1e-7)
    ids = torch.tensor([PROMPTS[4] * 3])
    recorder = RoutingRecorder(model)
    with torch.no_grad(), recorder.recording():
        own = model(ids).logits
    routes = recorder.take()
    assert routes.shape == (ids.numel(), len(routers), routers[0].top_k)
    replay = RoutingReplay(model)
    with torch.no_grad():
        with replay.replaying(routes):
            replayed = model(ids).logits
        other = (routes + 1) % routers[0].num_experts  # every token sent elsewhere
        with replay.replaying(other):
            moved = model(ids).logits
        after = model(ids).logits  # outside the context the routers choose again
    assert torch.allclose(replayed, own, atol=1e-6) and torch.allclose(after, own, atol=1e-6)
    assert (moved - own).abs().max() > 1e-3


def test_the_engine_records_every_token_it_feeds(moe_dirs):
    """``[prompt + output - 1, L, k]`` per request: the prompt's routes from the (shared, left-padded) prefill,
    one per decode step; they are the experts a full forward of the same tokens picks; only requests that ask get
    them; stop strings that trim the output trim them too."""
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_dirs["qwen3_moe"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(moe_dirs["qwen3_moe"])
    engine = EmbeddedEngine(model, tokenizer)
    prompts = PROMPTS[:6] + [PROMPTS[0]] * 3  # a group sharing its prefill
    outputs = _generate(engine, prompts)
    layers, top_k = len(moe_routers(model)), moe_routers(model)[0].top_k
    recorder = RoutingRecorder(model)
    agree = total = 0
    for prompt, output in zip(prompts, outputs):
        tokens = list(prompt) + output.output_ids
        assert output.routed_experts.shape == (len(tokens) - 1, layers, top_k)
        with torch.no_grad(), recorder.recording():
            model(torch.tensor([tokens[:-1]]))
        full = recorder.take()
        agree += int((full.sort(-1).values == output.routed_experts.long().sort(-1).values).all(-1).all(-1).sum())
        total += len(tokens) - 1
    assert agree >= 0.99 * total, (agree, total)  # float32: the same experts but where two tie in the 7th digit

    mixed = asyncio.run(engine.generate([
        GenerationRequest("asks", PROMPTS[1], SamplingParams(max_new_tokens=8, seed=1), return_routed_experts=True),
        GenerationRequest("not", PROMPTS[1], SamplingParams(max_new_tokens=8, seed=2)),
        GenerationRequest("stops", PROMPTS[2], SamplingParams(max_new_tokens=12, seed=3, stop=["1", "2", "3", "a"]),
                          return_routed_experts=True),
    ]))
    assert mixed[1].routed_experts is None and mixed[0].routed_experts.shape[0] == len(PROMPTS[1]) + 8 - 1
    assert mixed[2].routed_experts.shape[0] == len(PROMPTS[2]) + len(mixed[2].output_ids) - 1


def test_asking_a_dense_model_for_routes_fails_that_caller_only(tiny_workspace):
    """Named in the error; through the batcher of `relax serve`, the other callers merged into the same engine call
    still get their outputs."""
    from relax.backends.inference.batcher import RequestBatcher

    engine = EmbeddedEngine.from_pretrained(str(tiny_workspace / "model"))
    with pytest.raises(ValueError, match="request 'r0' asks for routed experts.*no mixture-of-experts"):
        _generate(engine, PROMPTS[:1])

    async def two_callers():
        batcher = RequestBatcher(engine, window_s=0.05)
        batcher.start()
        try:
            good = GenerationRequest("good", PROMPTS[0], SamplingParams(max_new_tokens=4, seed=1))
            bad = GenerationRequest("bad", PROMPTS[1], SamplingParams(max_new_tokens=4, seed=2),
                                    return_routed_experts=True)
            return await asyncio.gather(batcher.generate([good]), batcher.generate([bad]), return_exceptions=True)
        finally:
            await batcher.stop()

    good, bad = asyncio.run(two_callers())
    assert len(good[0].output_ids) == 4 and isinstance(bad, ValueError) and "'bad'" in str(bad)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe_text", "deepseek_v3"])
def test_replay_closes_the_train_rollout_gap(family, moe_dirs, capsys):
    """The acceptance case (module doc). qwen3_moe and deepseek_v3 train on packed rows, qwen3_5_moe_text (linear
    attention) on padded ones."""
    trainer_dir = moe_dirs[family]
    model = transformers.AutoModelForCausalLM.from_pretrained(trainer_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # experts 1 and 2 nearly tied in the trainer; the engine's scores differ in the 6th digit
        for router in moe_routers(model):
            router.weight[2] = router.weight[1] + 1e-6 * torch.randn(router.weight[1].shape, generator=generator)
    model.save_pretrained(trainer_dir / "tied")
    engine_model = copy.deepcopy(model)
    with torch.no_grad():
        for router in moe_routers(engine_model):
            router.weight[2] += 2e-6 * torch.randn(router.weight[2].shape, generator=generator)
    tokenizer = transformers.AutoTokenizer.from_pretrained(trainer_dir)
    tokenizer.save_pretrained(trainer_dir / "tied")
    outputs = _generate(EmbeddedEngine(engine_model, tokenizer), max_new_tokens=24)

    backend = FSDPTrainBackend(trainer_dir / "tied", _settings(routing_replay=True), trainable=False)
    without, replayed = _gaps(backend, PROMPTS, outputs, replay=False), _gaps(backend, PROMPTS, outputs, replay=True)
    with capsys.disabled():
        print(f"\n{family}: train/rollout |log-prob gap| over {without.numel()} tokens: without replay max "
              f"{without.max():.2e} mean {without.mean():.2e} ({int((without > 1e-4).sum())} tokens > 1e-4); with "
              f"replay max {replayed.max():.2e} mean {replayed.mean():.2e}")
    assert without.max() > 1e-3  # the routers disagree on some tokens
    assert replayed.max() < LOG_PROB_TOLERANCE


def test_a_training_step_replaying_the_routers_own_choice_is_the_plain_step(moe_dirs):
    """Through activation checkpointing (the recomputation in backward routes again, inside the replay) and
    token-budget micro-batches: the same loss and the same gradient as without replay."""
    path = moe_dirs["qwen3_moe"]
    engine = EmbeddedEngine(transformers.AutoModelForCausalLM.from_pretrained(path),
                            transformers.AutoTokenizer.from_pretrained(path))
    outputs = _generate(engine, PROMPTS[:8])
    tokens = [list(p) + o.output_ids for p, o in zip(PROMPTS, outputs)]
    lengths = [len(o.output_ids) for o in outputs]

    def step(replay: bool):
        torch.manual_seed(0)
        backend = FSDPTrainBackend(path, _settings(routing_replay=replay, gradient_checkpointing=True,
                                                   max_tokens_per_gpu=64, lr=1e-2))
        batch = TrainBatch(tokens, lengths, [[1] * n for n in lengths],
                           fields={"advantages": [torch.linspace(-1, 1, n) for n in lengths]},
                           routed_experts=[o.routed_experts for o in outputs] if replay else None)
        loss_fn = build_policy_loss_fn(PolicyLossSettings("ppo_clip", 0.2, 0.2, None, "token-mean"))
        metrics = backend.train_step(batch, loss_fn)
        return metrics, {n: p.detach().clone() for n, p in backend.model.named_parameters()}

    (plain, plain_weights), (replayed, replayed_weights_) = step(False), step(True)
    assert replayed["loss"] == pytest.approx(plain["loss"], abs=1e-6)
    assert replayed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)
    for name, value in plain_weights.items():
        assert torch.allclose(replayed_weights_[name], value, atol=1e-6), name


def test_token_routes_lay_out_packed_and_padded_rows_and_refuse_a_wrong_count():
    routes = [torch.arange(2 * 3 * 2, dtype=torch.int16).reshape(2, 3, 2), torch.full((4, 3, 2), 7)]
    packed = token_routes(routes, [3, 5], (3, 2), packed=True, device=torch.device("cpu"))
    assert packed.shape == (8, 3, 2) and (packed[2] == -1).all() and (packed[7] == -1).all()
    assert torch.equal(packed[:2], routes[0]) and (packed[3:7] == 7).all()
    padded = token_routes(routes, [3, 5], (3, 2), packed=False, device=torch.device("cpu"))
    assert padded.shape == (10, 3, 2) and (padded[2:5] == -1).all() and (padded[5:9] == 7).all()
    assert torch.equal(decode_routes(encode_routes(routes[0])).reshape(2, 3, 2), routes[0])
    with pytest.raises(ValueError, match="a sample of 4 tokens carries 12 routed expert ids, not 3 tokens x 3"):
        token_routes(routes[:1], [4], (3, 2), packed=True, device=torch.device("cpu"))


def test_relax_serve_returns_routed_experts_as_sglang_does(moe_dirs):
    """``return_routed_experts`` on /generate: base64 int32 in meta_info; the SGLang adapter decodes them; a dense
    model answers 400 naming the request."""
    server = Server(moe_dirs["qwen3_moe"], api_key=None)
    try:
        request = GenerationRequest("a", PROMPTS[3], SamplingParams(max_new_tokens=6, seed=0),
                                    return_routed_experts=True)
        (output,) = asyncio.run(SGLangHTTPEngine(server.url).generate([request]))
        (local,) = asyncio.run(server.engine.generate([request]))
        assert output.output_ids == local.output_ids
        assert torch.equal(output.routed_experts, local.routed_experts.reshape(-1))
    finally:
        server.stop()


def test_relax_serve_refuses_routes_of_a_dense_model(tiny_workspace):
    server = Server(tiny_workspace / "model", api_key=None)
    try:
        answer = httpx.post(f"{server.url}/generate", json={"input_ids": [5, 6], "return_routed_experts": True})
        assert answer.status_code == 400 and "no mixture-of-experts" in answer.text
    finally:
        server.stop()


def _train(model, tiny_workspace, run_dir, *extra) -> int:
    return main(["train", "--hf-checkpoint", str(model), "--prompt-data", str(tiny_workspace / "train.jsonl"),
                 "--custom-rm-path", "tests.support.e2e_rewards:digit_fraction", "--rollout-batch-size", "2",
                 "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4", "--global-batch-size", "4",
                 "--lr", "1e-2", "--output-dir", str(run_dir), "--num-rollout", "2", "--skip-eval-before-train",
                 "--dump-samples", "0", "--no-use-tensorboard", "--use-tis", *extra])


def test_a_run_with_routing_replay_trains_on_the_engines_routes(moe_dirs, tiny_workspace, tmp_path):
    """`relax train --use-rollout-routing-replay`: two optimizer steps per rollout (so the old log-probs are a
    replayed forward too), the engine's and the trainer's log-probs agree."""
    run_dir = tmp_path / "run"
    assert _train(moe_dirs["glm4_moe"], tiny_workspace, run_dir, "--use-rollout-routing-replay") == 0
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["train/optimizer_steps"] == 2 and abs(row["train/tis_mismatch_kl"]) < LOG_PROB_TOLERANCE, row


def test_routing_replay_is_refused_where_it_cannot_work(tiny_workspace, tmp_path, capsys):
    assert _train(tiny_workspace / "model", tiny_workspace, tmp_path / "dense", "--use-rollout-routing-replay") == 2
    assert "has no mixture-of-experts routers" in capsys.readouterr().err
    assert not (tmp_path / "dense").exists()
    assert _train(tiny_workspace / "model", tiny_workspace, tmp_path / "openai", "--use-rollout-routing-replay",
                  "--rollout-external", "--rollout-engine-protocol", "openai", "--rollout-external-engine-addrs",
                  "http://127.0.0.1:9") == 2
    assert "openai servers do not return routed experts" in capsys.readouterr().err


def test_routes_travel_through_the_data_plane_and_stay_out_of_sample_dumps():
    from relax.data.sample import Sample
    from relax.data_plane.tq_codec import decode_rows, encode_rows, record_to_sample

    routes = torch.arange(8, dtype=torch.int16).reshape(2, 2, 2)
    samples = [Sample(tokens=[1, 2, 3], response_length=1, rollout_routed_experts=routes),
               Sample(tokens=[1, 2], response_length=1)]
    back = [record_to_sample(record) for record in decode_rows(encode_rows(samples))]
    assert torch.equal(back[0].rollout_routed_experts, routes) and back[1].rollout_routed_experts is None
    assert "rollout_routed_experts" not in samples[0].to_dict()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replay_in_bf16_on_the_gpu(moe_dirs, capsys):
    """The engine (Hugging Face decode path) and the trainer both in bf16 on CUDA, as in a GPU run: replay never
    widens the gap, and leaves it within the dense families' bf16 tolerance (tests/backends/models/test_model_families.py)."""
    path = moe_dirs["qwen3_moe"]
    model = load_model(path, torch.bfloat16).to("cuda")
    outputs = _generate(EmbeddedEngine(model, transformers.AutoTokenizer.from_pretrained(path)), max_new_tokens=32)
    backend = FSDPTrainBackend(path, _settings(device=torch.device("cuda"), compute_dtype=torch.bfloat16,
                                               routing_replay=True), trainable=False)
    without, replayed = _gaps(backend, PROMPTS, outputs, replay=False), _gaps(backend, PROMPTS, outputs, replay=True)
    with capsys.disabled():
        print(f"\nbf16 CUDA qwen3_moe: |log-prob gap| without replay max {without.max():.2e} mean "
              f"{without.mean():.2e}; with replay max {replayed.max():.2e} mean {replayed.mean():.2e}")
    assert replayed.mean() <= without.mean() + 1e-4 and replayed.mean() < 0.05
