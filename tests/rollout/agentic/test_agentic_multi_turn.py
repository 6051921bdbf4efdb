"""The multi-turn generate loop and per-sample generate functions, on the real embedded engine with
the tiny models and real environments: loss masks and log-probs across turns, token-in/token-out,
every stop reason, failing environments (and a real training run that survives them), the custom
generate contract, and a vision-language episode whose observation adds an image."""

import asyncio
import threading

import pytest
import torch
from PIL import Image, ImageDraw
from transformers import AutoConfig, AutoTokenizer

from relax.algorithms.loss import MicroBatchTensors, build_policy_loss_fn
from relax.algorithms.policy_loss import PolicyLossSettings
from relax.backends.inference.base import GenerationRequest, SamplingParams, ScoreRequest
from relax.backends.inference.batcher import RequestBatcher
from relax.backends.inference.embedded import EmbeddedEngine
from relax.backends.training.fsdp import FSDPTrainBackend
from relax.backends.training.settings import TrainSettings
from relax.cli.args import parse_config
from relax.components.actor import to_train_batch
from relax.config import ConfigError, RelaxConfig
from relax.core.build import build_roles
from relax.core.loops.sync import SyncController
from relax.core.placement.in_process import InProcessPlacement
from relax.core.rollout_parts import MULTI_TURN_PATH, load_generate_function
from relax.data.multimodal import MultimodalSettings
from relax.data.sample import Sample, SampleStatus
from relax.rollout.agentic import multi_turn
from relax.rollout.agentic.env import BaseInteractionEnv
from relax.rollout.generation.context import GenerateFunctionError, PerSampleGeneration
from relax.rollout.generation.multimodal import MultimodalPreparer
from relax.telemetry.tracking import Tracker
from tests.support.runs import tiny_train_args
from tests.support.tiny_mm_assets import build_tiny_vl, make_image_rows

HERE = "tests.rollout.agentic.test_agentic_multi_turn"
CLOSED: list[str] = []  # environments record their close() here


# ----------------------------------------------------------------------------------------- environments


class EchoEnv(BaseInteractionEnv):
    """Answers every turn with ``obs_str`` (and images); done after ``done_at`` turns (never when None)."""

    def __init__(self, done_at=None, obs_str="ok", images=()):
        self.done_at, self.obs_str, self.images, self.turns = done_at, obs_str, list(images), 0

    def step(self, response_text):
        self.turns += 1
        observation = {"obs_str": self.obs_str}
        if self.images:
            observation["multi_modal_data"] = {"image": self.images}
        return observation, self.turns == self.done_at, {"turn": self.turns}

    def close(self):
        CLOSED.append(type(self).__name__)


def build_echo_env(sample, args):
    return EchoEnv(done_at=sample.metadata.get("done_at"))


class RaisingEnv(EchoEnv):
    def step(self, response_text):
        raise RuntimeError("the tool crashed")


class HangingEnv(EchoEnv):
    def step(self, response_text):
        threading.Event().wait(5)  # a sync step stuck in I/O; the daemon thread is abandoned
        return {}, True, {}


class AsyncHangingEnv(EchoEnv):
    async def step(self, response_text):
        await asyncio.sleep(60)


def build_failing_env(sample, args):
    kind = sample.metadata["env"]
    if kind == "build_raises":
        raise ValueError("no such task")
    return {"raises": RaisingEnv, "hangs": HangingEnv, "async_hangs": AsyncHangingEnv}[kind]()


# ----------------------------------------------------------------------------------------- helpers


class RecordingEngine:
    """The real engine, with every engine call's requests and outputs kept."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    @property
    def weight_version(self):
        return self.engine.weight_version

    async def generate(self, requests):
        outputs = await self.engine.generate(requests)
        self.calls.append((list(requests), outputs))
        return outputs

    async def abort(self, request_ids):
        await self.engine.abort(request_ids)

    async def close_session(self, session_id):
        self.closed_sessions = [*getattr(self, "closed_sessions", []), session_id]
        await self.engine.close_session(session_id)

    def turns(self, request_id_prefix):
        return [(r, o) for requests, outputs in self.calls for r, o in zip(requests, outputs)
                if r.request_id.startswith(request_id_prefix)]


def letter_ids(tokenizer):
    """Stop tokens that end a random tiny model's turn after a token or two."""
    return tokenizer.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz"))


def prompt_samples(tokenizer, count, **metadata):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True,
                                        tokenize=False)
    tokens = tokenizer(ids, add_special_tokens=False)["input_ids"]
    return [Sample(index=i, group_index=i, prompt="1+2=", tokens=list(tokens), metadata=dict(metadata))
            for i in range(count)]


def config(**overrides):
    fields = {"rollout_interaction_env_path": f"{HERE}:build_echo_env", "max_turns": 3, "rollout_max_response_len": 200,
              **overrides}
    return RelaxConfig(**fields)


def run(engine, tokenizer, samples, cfg, sampling, function=multi_turn.generate, path=MULTI_TURN_PATH,
        processor=None):
    generation = PerSampleGeneration(function, path, cfg, tokenizer, processor)
    return asyncio.run(generation.run(engine, samples, sampling))


def sampling(tokenizer, **overrides):
    return SamplingParams(**{"max_new_tokens": 8, "stop_token_ids": letter_ids(tokenizer), "seed": 11, **overrides})


def segments(mask):
    """Runs of equal mask values as (value, start, end)."""
    runs, start = [], 0
    for position in range(1, len(mask) + 1):
        if position == len(mask) or mask[position] != mask[start]:
            runs.append((mask[start], start, position))
            start = position
    return runs


# ----------------------------------------------------------------------------------------- the loop


def test_model_tokens_carry_the_loss_and_their_log_probs_across_turns(engine, tokenizer, tiny_workspace):
    recording = RecordingEngine(engine)
    samples = run(recording, tokenizer, prompt_samples(tokenizer, 4), config(), sampling(tokenizer))
    for sample in samples:
        prompt_length = sample.prompt_length
        assert sample.metadata["rollout_turns"] == 3 and sample.metadata["rollout_stop_reason"] == "max_turns"
        assert sample.status is SampleStatus.COMPLETED
        assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
        assert sample.response_length == len(sample.tokens) - prompt_length
        turns = recording.turns(f"mt-{sample.group_index}-{sample.index}-")
        assert len(turns) == 3
        # Earlier turns are never re-tokenized: each turn's input is the previous input + its output + observation,
        # and the final token list starts with every turn's input and output.
        for request, output in turns:
            assert sample.tokens[: len(request.input_ids) + len(output.output_ids)] == request.input_ids + output.output_ids
        # Mask-1 runs are exactly the model's outputs, in order; mask-0 runs are the observations.
        runs = segments(sample.loss_mask)
        assert [value for value, _, _ in runs] == [1, 0, 1, 0, 1]
        response = sample.response_tokens
        assert [response[s:e] for value, s, e in runs if value == 1] == [o.output_ids for _, o in turns]
        assert [sample.rollout_log_probs[s:e] for value, s, e in runs if value == 1] == [o.output_log_probs for _, o in turns]
        observation_runs = [(s, e) for value, s, e in runs if value == 0]
        for (start, end), (_, output) in zip(observation_runs, turns):
            assert sample.rollout_log_probs[start:end] == [0.0] * (end - start)
            # the observation alone: the assistant message closed (unless the model closed it with its EOS), then the
            # user message and a new generation prompt
            closing = "" if tokenizer.decode(output.output_ids[-1:]) == "<|im_end|>" else "<|im_end|>"
            assert tokenizer.decode(response[start:end]) == \
                closing + "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
        # Re-scoring the final token list gives the engine's log-probs on every mask-1 token.
        scored = asyncio.run(engine.score([ScoreRequest(sample.tokens, sample.response_length)]))[0].log_probs
        for position, (mask, log_prob) in enumerate(zip(sample.loss_mask, sample.rollout_log_probs)):
            if mask:
                assert scored[position] == pytest.approx(log_prob, abs=1e-4)
        traces = sample.metadata["rollout_traces"]
        assert [t["turn"] for t in traces] == [0, 1, 2] and traces[0]["env_info"] == {"turn": 1}
        assert sum(t["model_tokens"] + t["observation_tokens"] for t in traces) == sample.response_length
    assert CLOSED.count("EchoEnv") >= 4
    # ... and so does the trainer, on the whole batch of episodes
    trainer = trainer_log_probs(tiny_workspace / "model", tokenizer, samples)
    for sample, log_probs in zip(samples, trainer):
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(log_probs[mask], torch.tensor(sample.rollout_log_probs)[mask], atol=1e-4, rtol=0)


def trainer_log_probs(model_path, tokenizer, samples):
    backend = FSDPTrainBackend(model_path, TrainSettings(device=torch.device("cpu"), compute_dtype=torch.float32,
                                                         micro_batch_size=len(samples), temperature=1.0,
                                                         pad_token_id=tokenizer.pad_token_id), trainable=False)
    return backend.compute_log_probs(to_train_batch(samples)).log_probs


def test_observation_tokens_never_enter_the_loss(engine, tokenizer):
    sample = run(engine, tokenizer, prompt_samples(tokenizer, 1), config(), sampling(tokenizer))[0]
    mask = torch.tensor([sample.loss_mask], dtype=torch.float32)
    assert 0 < mask.sum() < mask.numel()
    loss_fn = build_policy_loss_fn(PolicyLossSettings(policy_loss="ppo_clip", eps_clip=0.2, eps_clip_high=0.2,
                                                      eps_clip_c=None, aggregation="seq-mean-token-mean",
                                                      use_tis=True))

    def loss_and_grad(observation_value):
        rollout = torch.tensor([sample.rollout_log_probs])
        # the observation tokens' log-probs (engine's, old and current) set to anything at all
        rollout = torch.where(mask.bool(), rollout, torch.full_like(rollout, observation_value))
        log_probs = (rollout + 0.1).requires_grad_(True)
        fields = {"advantages": torch.ones_like(rollout), "rollout_log_probs": rollout, "old_log_probs": rollout}
        loss, _ = loss_fn(MicroBatchTensors(mask=mask, fields=fields), log_probs, torch.zeros_like(rollout))
        loss.backward()
        return loss.item(), log_probs.grad

    loss_a, grad_a = loss_and_grad(0.0)
    loss_b, grad_b = loss_and_grad(-30.0)
    assert loss_a == loss_b
    assert torch.equal(grad_a, grad_b) and torch.all(grad_a[~mask.bool()] == 0)


@pytest.mark.parametrize("case", ["env_done", "max_turns", "budget_exhausted", "finish_length"])
def test_each_stop_reason(engine, tokenizer, case):
    samples = prompt_samples(tokenizer, 2, **({"done_at": 2} if case == "env_done" else {}))
    prompt_length = len(samples[0].tokens)
    cfg, params = config(max_turns=4), sampling(tokenizer)
    if case == "budget_exhausted":
        cfg = config(max_turns=4, rollout_max_context_len=prompt_length + 30)
    if case == "finish_length":
        params = sampling(tokenizer, stop_token_ids=[], max_new_tokens=3, ignore_eos=True)
    expected_status = {"env_done": SampleStatus.COMPLETED, "max_turns": SampleStatus.COMPLETED,
                       "budget_exhausted": SampleStatus.TRUNCATED, "finish_length": SampleStatus.TRUNCATED}[case]
    for sample in run(engine, tokenizer, samples, cfg, params):
        assert sample.metadata["rollout_stop_reason"] == case and sample.status is expected_status
        assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
        turns = sample.metadata["rollout_turns"]
        assert turns == {"env_done": 2, "max_turns": 4, "finish_length": 1}.get(case, turns)
        if case == "budget_exhausted":
            assert len(sample.tokens) <= prompt_length + 30 and turns < 4
        if case == "finish_length":
            assert sample.response_length == 3


def test_the_first_turn_is_capped_by_the_context_budget(engine, tokenizer):
    samples = prompt_samples(tokenizer, 1)
    cfg = config(rollout_max_context_len=len(samples[0].tokens) + 2)
    sample = run(engine, tokenizer, samples, cfg, sampling(tokenizer, stop_token_ids=[], ignore_eos=True))[0]
    assert sample.response_length == 2 and sample.metadata["rollout_stop_reason"] == "budget_exhausted"


def build_long_observation_env(sample, args):
    return EchoEnv(obs_str="o" * sample.metadata["observation_chars"])


def test_the_context_budget_never_passes_the_model_s_positions(engine, tokenizer, tiny_workspace):
    """The default budget (prompt + --rollout-max-response-len) may pass the model's 256 positions: after a turn and
    a long observation the next turn's prompt did, and the engine refused it ("leave no room for an answer"),
    which ended the run. Now the episode stops there, as at any exhausted budget."""
    samples = prompt_samples(tokenizer, 1, observation_chars=230)
    prompt_length = len(samples[0].tokens)
    cfg = config(rollout_interaction_env_path=f"{HERE}:build_long_observation_env", max_turns=3,
                 rollout_max_response_len=255, hf_checkpoint=str(tiny_workspace / "model"))
    assert multi_turn.context_budget(cfg, prompt_length) == 256 < prompt_length + 255
    sample = run(engine, tokenizer, samples, cfg, sampling(tokenizer))[0]  # (a turn stops at a letter, <= 8 tokens)
    assert sample.metadata["rollout_stop_reason"] == "budget_exhausted" and sample.metadata["rollout_turns"] == 1
    assert len(sample.tokens) < 256  # the observation that passed the positions is left out, the episode ends


@pytest.mark.parametrize("kind", ["raises", "hangs", "async_hangs", "build_raises"])
def test_an_environment_that_raises_or_hangs_fails_its_sample(engine, tokenizer, kind):
    cfg = config(rollout_interaction_env_path=f"{HERE}:build_failing_env", env_step_timeout=0.3)
    # (no clock: a hang cut by --env-step-timeout fails with that message, one waited out would not fail at all)
    samples = run(engine, tokenizer, prompt_samples(tokenizer, 2, env=kind), cfg, sampling(tokenizer))
    expected_error = {"raises": "RuntimeError: the tool crashed", "hangs": "did not return within --env-step-timeout",
                      "async_hangs": "did not return within --env-step-timeout",
                      "build_raises": "ValueError: no such task"}[kind]
    for sample in samples:
        assert sample.status is SampleStatus.FAILED and sample.metadata["rollout_stop_reason"] == "env_error"
        assert expected_error in sample.metadata["error"]
        assert sample.loss_mask == [0] * sample.response_length
        assert len(sample.rollout_log_probs) == sample.response_length
        assert sample.response_length == (0 if kind == "build_raises" else sample.metadata["rollout_traces"][0]["model_tokens"])


def test_seeded_episodes_share_engine_calls_and_do_not_depend_on_their_neighbours(engine, tokenizer):
    alone = run(engine, tokenizer, prompt_samples(tokenizer, 1), config(), sampling(tokenizer))[0]
    recording = RecordingEngine(engine)
    crowd = run(recording, tokenizer, prompt_samples(tokenizer, 6), config(), sampling(tokenizer))
    assert crowd[0].tokens == alone.tokens  # sample 0 draws from its own seed, whoever shares its batch
    assert len({tuple(s.tokens) for s in crowd}) > 1  # the samples of a prompt differ
    requests = sum(len(requests) for requests, _ in recording.calls)
    assert requests == 18 and len(recording.calls) <= 6  # 6 episodes x 3 turns merged into few engine calls


def test_the_batcher_merges_jobs_unless_they_share_a_seed(engine, tokenizer):
    async def submit(seeds):
        recording = RecordingEngine(engine)
        batcher = RequestBatcher(recording)
        batcher.start()
        prompt = prompt_samples(tokenizer, 1)[0].tokens
        jobs = [batcher.generate([GenerationRequest(f"r{i}", prompt, sampling(tokenizer, seed=seed))])
                for i, seed in enumerate(seeds)]
        outputs = await asyncio.gather(*jobs)
        await batcher.stop()
        return len(recording.calls), [o[0].output_ids for o in outputs]

    calls, outputs = asyncio.run(submit([1, 2, 3]))
    assert calls == 1 and len({tuple(o) for o in outputs}) > 1
    calls, outputs = asyncio.run(submit([1, 1, 2]))
    assert calls == 2 and outputs[0] == outputs[1]  # a seed's samples do not depend on what else is batched
    assert asyncio.run(submit([None, None]))[0] == 1


# ----------------------------------------------------------------------------------------- custom generate functions

CALLS = []


async def echo_generate(args, sample, sampling_params):
    """A user's generate function: one engine call through ``args``."""
    CALLS.append((args, sample, sampling_params))
    request = GenerationRequest(f"custom-{id(sample)}", list(sample.tokens), sampling_params)
    output = (await args.engine.generate([request]))[0]
    sample.tokens = sample.tokens + output.output_ids
    sample.response_length, sample.response = len(output.output_ids), output.text
    sample.loss_mask, sample.rollout_log_probs = [1] * len(output.output_ids), output.output_log_probs
    sample.status = SampleStatus.COMPLETED
    sample.metadata["max_turns_seen"] = args.max_turns
    return sample


async def upstream_style(args, sample, sampling_params, evaluation=False):
    sample.metadata["evaluation"] = evaluation
    return sample


async def two_pieces(args, sample, sampling_params):
    first = await echo_generate(args, sample, sampling_params)
    return [first, Sample(**{**first.__dict__, "metadata": {"piece": 2}})]


async def ragged_lists(args, sample, sampling_params):
    return [sample] * (1 + sample.index % 2)


async def returns_nothing(args, sample, sampling_params):
    return []


async def returns_text(args, sample, sampling_params):
    return "not a sample"


async def raises(args, sample, sampling_params):
    raise KeyError("missing field")


def not_async(args, sample, sampling_params):
    return sample


def test_a_custom_function_is_called_with_args_sample_and_sampling_params(engine, tokenizer):
    CALLS.clear()
    cfg = RelaxConfig(max_turns=7, apply_chat_template_kwargs={"enable_thinking": False})
    samples = prompt_samples(tokenizer, 3)
    out = run(engine, tokenizer, samples, cfg, sampling(tokenizer), echo_generate, f"{HERE}:echo_generate")
    assert out == samples and [s.metadata["max_turns_seen"] for s in out] == [7, 7, 7]
    args, sample, params = CALLS[0]
    assert args.tokenizer is tokenizer and args.processor is None and args.rollout_max_context_len is None
    assert args.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(AttributeError, match="'max_turn': not engine, tokenizer, processor"):
        args.max_turn  # noqa: B018 - a typo names what exists
    assert isinstance(sample, Sample) and isinstance(params, SamplingParams) and params.max_new_tokens == 8
    assert len({params.seed for _, _, params in CALLS}) == 3  # each sample its own seed, derived from the step's


def test_upstream_functions_learn_whether_they_evaluate(engine, tokenizer):
    generation = PerSampleGeneration(upstream_style, f"{HERE}:upstream_style", RelaxConfig(), tokenizer)
    for evaluation in (False, True):
        out = asyncio.run(generation.run(engine, prompt_samples(tokenizer, 1), sampling(tokenizer), evaluation))
        assert out[0].metadata["evaluation"] is evaluation


def test_a_list_return_stays_in_the_sample_group(engine, tokenizer):
    samples = prompt_samples(tokenizer, 2)
    out = run(engine, tokenizer, samples, RelaxConfig(), sampling(tokenizer), two_pieces, f"{HERE}:two_pieces")
    assert [s.group_index for s in out] == [0, 0, 1, 1]
    assert [s.metadata.get("piece") for s in out] == [None, 2, None, 2]


@pytest.mark.parametrize("function, message", [
    ("ragged_lists", "lists of different lengths"),
    ("returns_nothing", "returned an empty list"),
    ("returns_text", "returned str, expected a Sample"),
    ("raises", "failed on sample 0: KeyError"),
])
def test_a_bad_custom_function_names_its_path(engine, tokenizer, function, message):
    path = f"{HERE}:{function}"
    with pytest.raises(GenerateFunctionError, match=message) as error:
        run(engine, tokenizer, prompt_samples(tokenizer, 2), RelaxConfig(), sampling(tokenizer), globals()[function],
            path)
    assert path in str(error.value)


@pytest.mark.parametrize("flags, message", [
    ({"custom_generate_function_path": "tests.no_such_module:generate"}, "--custom-generate-function-path"),
    ({"custom_generate_function_path": f"{HERE}:not_async"}, "must be an `async def"),
    ({"rollout_interaction_env_path": "tests.no_such_env"}, "--rollout-interaction-env-path"),
])
def test_bad_paths_fail_before_any_model_loads(tiny_workspace, tmp_path, flags, message):
    cfg = RelaxConfig(hf_checkpoint=str(tmp_path / "no_model_here"), prompt_data=str(tiny_workspace / "train.jsonl"),
                      rm_type="math", num_rollout=1, **flags)
    with pytest.raises(ConfigError, match=message):
        load_generate_function(cfg)
    with pytest.raises(ConfigError, match=message):
        build_roles(cfg)  # the missing model folder would be the error if the paths were checked later


def test_the_env_path_alone_selects_the_multi_turn_loop():
    assert load_generate_function(RelaxConfig()) is None
    assert load_generate_function(config()) == (multi_turn.generate, MULTI_TURN_PATH)
    custom = load_generate_function(config(custom_generate_function_path=f"{HERE}:echo_generate"))
    assert custom == (echo_generate, f"{HERE}:echo_generate")


# ----------------------------------------------------------------------------------------- a real run

ENV_MODULE = '''
import itertools, threading
from relax.rollout.agentic.env import BaseInteractionEnv

_calls = itertools.count()

class Episode(BaseInteractionEnv):
    def __init__(self, mode):
        self.mode, self.turns = mode, 0

    def step(self, response_text):
        self.turns += 1
        if self.mode == "raises":
            raise RuntimeError("tool crashed")
        if self.mode == "hangs":
            threading.Event().wait(3)
        return {"obs_str": "ok"}, self.turns == 2, {}

def build_env(sample, args):
    mode = ["ok", "raises", "hangs", "build", "ok"][next(_calls) % 5]
    if mode == "build":
        raise ValueError("bad task")
    return Episode(mode)
'''


def test_training_goes_on_when_environments_fail(tiny_workspace, tmp_path, monkeypatch):
    (tmp_path / "flaky_envs.py").write_text(ENV_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    letters = [str(i) for i in letter_ids(AutoTokenizer.from_pretrained(tiny_workspace / "model"))]
    argv = tiny_train_args(tiny_workspace, tmp_path / "run", "--num-rollout", "2", "--rollout-interaction-env-path",
                           "flaky_envs", "--env-step-timeout", "0.3", "--rollout-max-context-len", "64",
                           "--max-turns", "3", "--rollout-stop-token-ids", *letters, "--dump-samples", "16")
    cfg = parse_config(argv)
    roles = build_roles(cfg)
    with Tracker(cfg.output_dir, use_tensorboard=False) as tracker:
        controller = SyncController(cfg, InProcessPlacement(cfg, roles), tracker)
        metrics = [asyncio.run(controller.train_step(step)) for step in range(2)]
    for step in metrics:
        assert 0 < step["rollout/failed_ratio"] < 1 and step["rollout/stop_env_error_ratio"] > 0
        assert step["rollout/turns_mean"] > 0
        train = {k: v for k, v in step.items() if k.startswith("train/")}
        assert "train/loss" in train and all(torch.isfinite(torch.tensor(v)) for v in train.values())
    samples, _ = asyncio.run(roles.rollout.generate(2))
    failed = [s for s in samples if s.status is SampleStatus.FAILED]
    assert failed and all(s.reward == 0.0 and not any(s.loss_mask) and s.metadata["error"] for s in failed)
    assert any(s.response_length == 0 for s in failed)  # build_env raised before any turn
    assert any(s.metadata["rollout_turns"] == 2 and s.metadata["rollout_stop_reason"] == "env_done" for s in samples)
    # evaluation plays episodes with the same loop
    eval_metrics, eval_samples = asyncio.run(roles.rollout.evaluate(0))
    assert all("rollout_stop_reason" in s.metadata for s in eval_samples["held_out"])
    assert "eval/held_out/failed_ratio" in eval_metrics


# ----------------------------------------------------------------------------------------- images


def squares(count, size):
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    for k in range(count):
        draw.rectangle((4 + 20 * k, 4, 16 + 20 * k, 16), fill="black")
    return image


def build_zoom_env(sample, args):
    return EchoEnv(done_at=2, obs_str="zoomed", images=[squares(2, (84, 56))])


def test_an_observation_image_extends_engine_and_trainer_inputs(tmp_path):
    folder = build_tiny_vl(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    preparer = MultimodalPreparer(tokenizer, AutoConfig.from_pretrained(folder), folder, MultimodalSettings(), None,
                                  {}, pool_size=1, skip_bad_samples=False)
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                          "text": "How many shapes?"}]}], add_generation_prompt=True, tokenize=False)
    ids, inputs = preparer.expand_media(tokenizer(text, add_special_tokens=False)["input_ids"],
                                        preparer.process_images([squares(3, (56, 56))]))
    prompt = Sample(index=0, prompt=text, tokens=ids, multimodal_train_inputs=inputs)
    engine = RecordingEngine(EmbeddedEngine.from_pretrained(str(folder)))
    cfg = config(rollout_interaction_env_path=f"{HERE}:build_zoom_env")
    params = SamplingParams(max_new_tokens=4, stop_token_ids=list(range(100, 300)), seed=5)
    sample = run(engine, tokenizer, [prompt], cfg, params, processor=preparer)[0]
    preparer.close()

    assert sample.metadata["rollout_stop_reason"] == "env_done" and sample.metadata["rollout_turns"] == 2
    image_token = preparer.media_tokens.image
    grids = sample.multimodal_train_inputs["image_grid_thw"]
    assert grids.tolist() == [[1, 4, 4], [1, 4, 6]]  # the prompt's image, then the observation's
    assert sample.tokens.count(image_token) == 4 + 6  # each image's placeholders, expanded (merge 2x2)
    assert sample.tokens[: len(ids)] == ids
    second_turn = engine.calls[-1][0][0]
    assert second_turn.multimodal_inputs["image_grid_thw"].tolist() == grids.tolist()
    assert all(m == 0 for token, m in zip(sample.response_tokens, sample.loss_mask) if token == image_token)
    # The trainer's log-probs of the model tokens equal the engine's.
    trainer = trainer_log_probs(folder, tokenizer, [sample])[0]
    mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
    assert mask.sum() >= 2
    torch.testing.assert_close(trainer[mask], torch.tensor(sample.rollout_log_probs)[mask], atol=1e-4, rtol=0)


def test_a_vision_language_run_trains_on_episodes_with_observation_images(tmp_path):
    folder = build_tiny_vl(tmp_path)
    rows = make_image_rows(tmp_path, 4)
    argv = ["--hf-checkpoint", str(folder), "--prompt-data", str(rows), "--input-key", "prompt", "--label-key", "label",
            "--multimodal-keys", '{"image": "images"}', "--apply-chat-template", "--custom-rm-path",
            "tests.support.e2e_rewards:digit_fraction", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "3", "--micro-batch-size", "4", "--lr", "1e-3", "--output-dir",
            str(tmp_path / "run"), "--use-tis", "--dump-samples", "0", "--num-rollout", "1",
            "--rollout-interaction-env-path", f"{HERE}:build_zoom_env", "--max-turns", "2",
            "--rollout-max-context-len", "256", "--rollout-stop-token-ids", *[str(i) for i in range(100, 300)]]
    cfg = parse_config(argv)
    roles = build_roles(cfg)
    with Tracker(cfg.output_dir, use_tensorboard=False) as tracker:
        step = asyncio.run(SyncController(cfg, InProcessPlacement(cfg, roles), tracker).train_step(0))
    # the engine's and the trainer's log-probs of the model tokens agree on two-image episodes
    assert abs(step["train/tis_mismatch_kl"]) < 1e-3 and step["train/tis_mismatch_k3_kl"] < 1e-4
    samples, _ = asyncio.run(roles.rollout.generate(1))
    two_images = [s for s in samples if len(s.multimodal_train_inputs["image_grid_thw"]) == 2]
    assert two_images and all(s.metadata["rollout_turns"] == 2 for s in two_images)


def test_with_session_lifecycle_an_episodes_turns_share_a_session_let_go_at_its_end(engine, tokenizer):
    """--agentic-session-lifecycle: every turn of an episode names one engine session (its K/V is kept between the
    turns) and the episode's end closes it, so no K/V stays pinned after the rollout."""
    recording = RecordingEngine(engine)
    cfg = config(agentic_session_lifecycle=True)
    samples = run(recording, tokenizer, prompt_samples(tokenizer, 2), cfg, sampling(tokenizer))
    assert all(sample.metadata["rollout_turns"] >= 2 for sample in samples)
    sessions = {}
    for requests, _ in recording.calls:
        for request in requests:
            sessions.setdefault(request.request_id.rsplit("-t", 1)[0], set()).add(request.session_id)
    assert len(sessions) == 2 and all(len(ids) == 1 and None not in ids for ids in sessions.values())
    assert sorted(recording.closed_sessions) == sorted(next(iter(ids)) for ids in sessions.values())
    assert engine.pinned_sessions == 0
