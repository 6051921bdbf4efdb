"""Memory between the phases of a colocated step (issue 16): the embedded engine releases its KV pool and weights
and comes back bit for bit once the weights are sent again; a colocated run with the offload flags logs the same
metrics as one without them; the flags resolve and refuse as documented."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine
from relax.config import RelaxConfig
from relax.telemetry.metrics_file import read_metrics
from tests.backends.inference.test_embedded_engine import make_model, make_tokenizer
from tests.support.runs import run_relax, tiny_train_args


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def _requests() -> list[GenerationRequest]:
    prompts = [[3 + (i * 5 + j) % 40 for j in range(5 + i)] for i in range(4)]
    return [GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=8, temperature=1.0, seed=11 + i))
            for i, p in enumerate(prompts)]


def _generate(engine: EmbeddedEngine):
    return [(o.output_ids, o.output_log_probs) for o in asyncio.run(engine.generate(_requests()))]


@pytest.mark.parametrize("core", ["on", "off"])
def test_released_engine_refuses_until_its_weights_are_sent_then_samples_the_same(tokenizer, core):
    engine = EmbeddedEngine(make_model(seed=0), tokenizer, core=CoreSettings(mode=core))
    before = _generate(engine)
    weights = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    asyncio.run(engine.release_memory_occupation())
    assert all(p.numel() == 0 for p in engine.model.parameters())
    assert engine.core.runner.released
    with pytest.raises(RuntimeError, match="released"):
        _generate(engine)
    with pytest.raises(RuntimeError, match="resume_memory_occupation first"):
        asyncio.run(engine.update_weights(weights.items(), version=1))
    with pytest.raises(RuntimeError, match="weights before its KV cache"):
        asyncio.run(engine.resume_memory_occupation(["kv_cache"]))
    asyncio.run(engine.resume_memory_occupation(["weights"]))
    # Only some weights sent: generation still refuses, naming how many are missing.
    partial = list(weights.items())[:2]
    asyncio.run(engine.update_weights(partial, version=1))
    with pytest.raises(RuntimeError, match=r"\d+ of the engine's weights were released and not loaded"):
        _generate(engine)
    asyncio.run(engine.update_weights(weights.items(), version=1))
    asyncio.run(engine.resume_memory_occupation(["kv_cache"]))
    assert _generate(engine) == before


def test_a_release_with_requests_in_flight_is_refused_and_loses_nothing(tokenizer):
    engine = EmbeddedEngine(make_model(seed=0), tokenizer, core=CoreSettings(mode="on"))
    expected = _generate(engine)

    async def release_while_generating():
        task = asyncio.create_task(engine.generate(_requests()))
        while engine.core.in_flight == 0:
            await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="in flight"):
            await engine.release_memory_occupation()
        return [(o.output_ids, o.output_log_probs) for o in await task]

    assert asyncio.run(release_while_generating()) == expected
    with pytest.raises(ValueError, match="unknown memory tags"):
        asyncio.run(engine.release_memory_occupation(["kv"]))


def test_release_and_resume_of_the_kv_pool_alone_keep_the_weights(tokenizer):
    engine = EmbeddedEngine(make_model(seed=0), tokenizer, core=CoreSettings(mode="on"))
    before = _generate(engine)
    asyncio.run(engine.release_memory_occupation(["kv_cache"]))
    assert engine.core.runner.released and all(p.numel() for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="KV pool is released"):
        _generate(engine)
    asyncio.run(engine.resume_memory_occupation(["kv_cache"]))
    assert _generate(engine) == before


# ---- the flags ---------------------------------------------------------------------------------------------------
def _config(**fields) -> RelaxConfig:
    return RelaxConfig(hf_checkpoint="m", prompt_data="p.jsonl", **fields)


def test_colocate_turns_on_both_offloads_unless_one_is_set():
    plain = _config()
    assert not plain.resolved_offload_train and not plain.resolved_offload_rollout
    colocated = _config(colocate=True)
    assert colocated.resolved_offload_train and colocated.resolved_offload_rollout
    partly = _config(colocate=True, offload_train=False)
    assert not partly.resolved_offload_train and partly.resolved_offload_rollout
    both = _config(offload=True, offload_rollout=False)
    assert both.resolved_offload_train and not both.resolved_offload_rollout
    external = _config(colocate=True, rollout_external=True, rollout_external_engine_addrs=["http://127.0.0.1:1"])
    assert external.resolved_offload_train and not external.resolved_offload_rollout


@pytest.mark.parametrize("fields, message", [
    ({"offload": True, "fully_async": True}, "async modes overlap"),
    ({"offload_train": True, "hybrid": True}, "async modes overlap"),
    ({"offload_rollout": True, "rollout_external": True, "rollout_external_engine_addrs": ["http://127.0.0.1:1"]},
     "--no-offload-rollout"),
    ({"offload": True, "loss_type": "sft"}, "no rollout phase"),
    ({"offload_train": True, "placement": "ray"}, "in-process placement"),
])
def test_offload_flags_where_they_cannot_act_are_refused_naming_them(fields, message):
    with pytest.raises(ValueError, match=message):
        _config(**fields)


# ---- a whole run -------------------------------------------------------------------------------------------------
def test_a_colocated_run_with_offload_logs_what_a_resident_one_does(tiny_workspace, tmp_path):
    """PPO with a critic-only first step: step 1 sends the unchanged weights back into the released engine as
    the same version, later steps the new ones. Same seeds, so the same metrics to the last digit's tolerance."""
    common = ["--advantage-estimator", "ppo", "--num-critic-only-steps", "1", "--num-rollout", "3",
              "--engine-core", "on", "--skip-eval-before-train"]
    rows = {}
    for name, flags in (("resident", ["--no-offload-train", "--no-offload-rollout"]), ("offload", [])):
        run_dir = tmp_path / name
        result = run_relax("train", *tiny_train_args(tiny_workspace, run_dir, "--colocate", *common, *flags))
        assert result.returncode == 0, result.stderr[-3000:]
        rows[name] = read_metrics(run_dir / "metrics.jsonl")
    assert "offloading between phases: trainers while rolling out, engine while training" in \
        (tmp_path / "offload" / "run.log").read_text()
    assert [r["step"] for r in rows["offload"]] == [r["step"] for r in rows["resident"]] == [1, 2, 3]
    for mine, theirs in zip(rows["offload"], rows["resident"]):
        for key, value in theirs.items():
            if not key.startswith("perf/") and not key.startswith("weight_sync/"):
                assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (mine["step"], key)
        assert "perf/offload_s" in mine and "perf/offload_s" not in theirs
    assert torch.isfinite(torch.tensor(rows["offload"][-1]["train/loss"]))
