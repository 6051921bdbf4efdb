"""In-place recovery of the embedded engine (``--use-fault-tolerance``, issue 17): a generation that fails with an
out-of-memory error rebuilds the engine's core and decodes the failed requests again, sampling what they would
have sampled; other errors and failures past the limit end the call with the cause named.

The fault is the exception the CUDA allocator raises, thrown by a forward hook of the real model's LM head (in
process) or by `tests/support/fault_injection/sitecustomize.py` inside a real `relax train` (end to end)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine, EngineRecoveryError, is_recoverable
from relax.telemetry.metrics_file import read_metrics
from tests.backends.inference.test_embedded_engine import ENGINE_PATHS, make_model, make_tokenizer
from tests.support.runs import ROOT, run_relax, tiny_train_args

PROMPTS = ["hello", "a+b=", "the quick brown fox", "7*8=5"]


def _engine(path: str, max_recoveries: int) -> EmbeddedEngine:
    core = CoreSettings(mode="on" if path == "paged" else "off", cuda_graphs=False)
    return EmbeddedEngine(make_model(seed=3), make_tokenizer(), core=core, max_recoveries=max_recoveries)


def _requests(tokenizer, prefix: str, seed: int = 11) -> list[GenerationRequest]:
    return [GenerationRequest(f"{prefix}-{i}", tokenizer(prompt)["input_ids"],
                              SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed + i))
            for i, prompt in enumerate(PROMPTS)]


def _fail_at(engine: EmbeddedEngine, calls: set[int], error: Exception) -> list[int]:
    """Raise ``error`` from the LM head at each of these forward calls (1-based); returns the call counter."""
    seen = [0]

    def hook(module, inputs):
        seen[0] += 1
        if seen[0] in calls:
            raise error

    engine.model.lm_head.register_forward_pre_hook(hook)
    return seen


def _tokens(outputs) -> list[list[int]]:
    return [output.output_ids for output in outputs]


@pytest.mark.parametrize("path", ENGINE_PATHS)
def test_an_out_of_memory_step_is_recovered_and_samples_what_it_would_have(path):
    tokenizer = make_tokenizer()
    clean = asyncio.run(_engine(path, 0).generate(_requests(tokenizer, "r")))
    engine = _engine(path, max_recoveries=2)
    _fail_at(engine, {4}, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    recovered = asyncio.run(engine.generate(_requests(tokenizer, "r")))
    assert _tokens(recovered) == _tokens(clean)
    for mine, theirs in zip(recovered, clean, strict=True):
        assert mine.output_log_probs == pytest.approx(theirs.output_log_probs, abs=1e-5)
    assert engine.recoveries == 1
    assert asyncio.run(engine.health())["recoveries"] == 1
    assert engine.core.kind == path


def test_concurrent_calls_that_one_failure_ends_are_recovered_once():
    tokenizer = make_tokenizer()
    clean_engine = _engine("paged", 0)

    async def both(engine):
        return await asyncio.gather(engine.generate(_requests(tokenizer, "a")),
                                    engine.generate(_requests(tokenizer, "b", seed=50)))

    clean = asyncio.run(both(clean_engine))
    engine = _engine("paged", max_recoveries=3)
    _fail_at(engine, {5}, torch.OutOfMemoryError("CUDA out of memory"))
    recovered = asyncio.run(both(engine))
    assert [_tokens(call) for call in recovered] == [_tokens(call) for call in clean]
    assert engine.recoveries == 1  # one failure: one rebuild, though it ended both calls


@pytest.mark.parametrize("path", ENGINE_PATHS)
def test_failures_past_the_limit_end_the_call_naming_the_cause(path):
    engine = _engine(path, max_recoveries=1)
    _fail_at(engine, set(range(1, 1000)), RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: "
                                                       "can't allocate memory: you tried to allocate 8 bytes"))
    with pytest.raises(EngineRecoveryError, match=r"can't allocate memory.*limit, 1 in-place recoveries"):
        asyncio.run(engine.generate(_requests(make_tokenizer(), "r")))
    assert engine.recoveries == 1
    engine = _engine(path, max_recoveries=0)
    _fail_at(engine, {1}, torch.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(EngineRecoveryError, match="--use-fault-tolerance turns it on"):
        asyncio.run(engine.generate(_requests(make_tokenizer(), "r")))


@pytest.mark.parametrize("path", ENGINE_PATHS)
def test_other_errors_are_not_retried(path):
    engine = _engine(path, max_recoveries=3)
    seen = _fail_at(engine, {1}, ValueError("a bug"))
    with pytest.raises(ValueError, match="a bug"):
        asyncio.run(engine.generate(_requests(make_tokenizer(), "r")))
    assert engine.recoveries == 0 and seen[0] == 1
    assert not is_recoverable(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_recoverable(torch.OutOfMemoryError("x")) and not is_recoverable(EngineRecoveryError("CUDA out of memory"))


def test_a_run_recovers_its_embedded_engine_in_place(tiny_workspace, tmp_path):
    """A real `relax train --use-fault-tolerance` whose engine's third decode step runs out of memory: the run logs
    the recovery, goes on, and every metric equals the uninterrupted run's (the retried groups sampled what they
    would have)."""
    steps = ("--num-rollout", "3", "--skip-eval-before-train", "--dump-samples", "0", "--no-use-tensorboard",
             "--rollout-seed", "7")
    reference = run_relax("train", *tiny_train_args(tiny_workspace, tmp_path / "reference", *steps))
    assert reference.returncode == 0, reference.stderr[-3000:]
    run_dir = tmp_path / "faulty"
    fault = {"PYTHONPATH": f"{ROOT / 'tests' / 'support' / 'fault_injection'}:{ROOT}",
             "RELAX_TEST_OOM_AT": "relax.backends.inference.engine_core.paged_runner:PagedRunner.decode:3"}
    faulty = run_relax("train", *tiny_train_args(tiny_workspace, run_dir, *steps, "--use-fault-tolerance"),
                       env=fault)
    assert faulty.returncode == 0, faulty.stderr[-3000:]
    log = (run_dir / "run.log").read_text()
    assert "embedded engine: OutOfMemoryError: CUDA out of memory (injected" in log
    assert "(recovery 1/3)" in log
    mine, theirs = read_metrics(run_dir / "metrics.jsonl"), read_metrics(tmp_path / "reference" / "metrics.jsonl")
    assert [row["step"] for row in mine] == [row["step"] for row in theirs]
    for a, b in zip(mine, theirs, strict=True):
        for key, value in b.items():
            if isinstance(value, float) and not key.startswith("perf/") and not math.isnan(value):
                assert a[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (a["step"], key)
