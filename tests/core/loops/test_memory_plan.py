"""The memory plan of a trainer and an embedded engine on one GPU (`relax.core.loops.memory_plan`): a budget that fits
changes nothing, one that fits only without the KV pool releases it while training (synchronous loop only), one
that does not fit stops the run naming the largest budget that does; the phase memory applies the release on a real
engine; the GPU probe is tested under ``-m gpu``."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine
from relax.config import ConfigError, RelaxConfig
from relax.core.loops.memory_plan import (
    HEADROOM,
    DeviceMemory,
    MemoryPlan,
    StepFootprint,
    largest_micro_batch_tokens,
    plan_memory,
)
from relax.core.loops.phase_memory import PhaseMemory
from tests.backends.inference.test_embedded_engine import make_model, make_tokenizer
from tests.core.loops.test_phase_memory import _generate

GIB = 1024 ** 3
H200 = 141 * GIB
STEP = StepFootprint(fixed_bytes=2 * GIB, bytes_per_token=3.5 * 1024 * 1024)  # the 0.6B shape, no checkpointing


def _device(held_gib: float, kv_gib: float, pending_gib: float = 0.0) -> DeviceMemory:
    return DeviceMemory(total_bytes=H200, held_bytes=int(held_gib * GIB), pending_bytes=int(pending_gib * GIB),
                        kv_pool_bytes=int(kv_gib * GIB))


def test_a_budget_that_fits_beside_the_pool_changes_nothing():
    plan = plan_memory(_device(held_gib=50, kv_gib=40), STEP, tokens=16384, can_release_kv=True)
    assert not plan.release_kv_while_training
    assert plan.peak_bytes == 50 * GIB + STEP.peak_bytes(16384) <= plan.usable_bytes


def test_a_budget_that_fits_only_without_the_pool_releases_it_in_the_sync_loop_and_is_refused_when_overlapped():
    # The H200 failure: 32,768-token micro-batches beside a resident pool.
    device = _device(held_gib=50, kv_gib=40, pending_gib=5)
    plan = plan_memory(device, STEP, tokens=32768, can_release_kv=True)
    assert plan.release_kv_while_training and plan.peak_bytes <= plan.usable_bytes
    with pytest.raises(ConfigError) as refused:
        plan_memory(device, STEP, tokens=32768, can_release_kv=False)
    message = str(refused.value)
    for named in ("--max-tokens-per-gpu", "--mem-fraction-static", "--gradient-checkpointing", "--colocate-async",
                  "32768 tokens", "40.0 GiB"):
        assert named in message, (named, message)


def test_a_refusal_suggests_a_smaller_pool_only_where_the_pool_stays_during_training():
    # On the H200 (--colocate, the engine offloaded while training) the refusal named a smaller KV pool, which would
    # have changed nothing: what is released while training does not weigh on the step.
    device = _device(held_gib=99, kv_gib=54, pending_gib=0)
    step = StepFootprint(fixed_bytes=int(22.5 * GIB), bytes_per_token=4471 * 1024)
    with pytest.raises(ConfigError) as released:
        plan_memory(device, step, tokens=16384, can_release_kv=True)
    assert "--mem-fraction-static" not in str(released.value) and "--max-tokens-per-gpu 1" in str(released.value)
    with pytest.raises(ConfigError) as resident:
        plan_memory(device, step, tokens=16384, can_release_kv=False)
    assert "--mem-fraction-static" in str(resident.value)
    assert "--log-probs-keep-logits" not in str(resident.value)
    with pytest.raises(ConfigError) as kept:  # the head's kept logits are a remedy only where they are kept
        plan_memory(device, step, tokens=16384, can_release_kv=False, kept_logits=True)
    assert "--log-probs-keep-logits off or auto" in str(kept.value)


def test_a_budget_that_fits_nowhere_names_a_smaller_model_when_no_token_fits():
    with pytest.raises(ConfigError, match="a smaller model or more devices"):
        plan_memory(_device(held_gib=135, kv_gib=0), STEP, tokens=1024, can_release_kv=True)


@settings(max_examples=300, deadline=None)
@given(held=st.floats(1, 130), kv_share=st.floats(0, 1), pending=st.floats(0, 20), fixed=st.floats(0, 10),
       per_token_kib=st.floats(1, 8192), tokens=st.integers(1, 1 << 17), can_release=st.booleans())
def test_a_plan_always_fits_and_a_refusal_names_the_largest_budget_that_does(held, kv_share, pending, fixed,
                                                                            per_token_kib, tokens, can_release):
    device = _device(held_gib=held, kv_gib=held * kv_share, pending_gib=pending)
    step = StepFootprint(fixed_bytes=int(fixed * GIB), bytes_per_token=per_token_kib * 1024)
    try:
        plan = plan_memory(device, step, tokens, can_release)
    except ConfigError as error:
        message = str(error)
        if "--max-tokens-per-gpu " not in message:  # not even one token fits
            with pytest.raises(ConfigError):
                plan_memory(device, step, 1, can_release)
            return
        fitting = int(message.split("--max-tokens-per-gpu ")[1].split()[0])
        assert 0 < fitting < tokens
        fits = plan_memory(device, step, fitting, can_release)  # the suggestion fits ...
        assert fits.peak_bytes <= fits.usable_bytes
        with pytest.raises(ConfigError):  # ... and is the largest that does
            plan_memory(device, step, fitting + 1, can_release)
        return
    assert plan.peak_bytes <= plan.usable_bytes == int(H200 * (1 - HEADROOM))
    assert can_release or not plan.release_kv_while_training
    if plan.release_kv_while_training:  # released only when keeping it would not fit
        assert plan.peak_bytes + device.kv_pool_bytes > plan.usable_bytes


def test_the_log_line_says_what_leaves_the_device_while_training():
    usable = int(H200 * (1 - HEADROOM))
    assert "stay resident" in MemoryPlan(False, GIB, usable).describe()
    assert "KV pool is released" in MemoryPlan(True, GIB, usable).describe()
    # --colocate offloads the engine whole: the plan keeps nothing resident for it (seen on the H200: the log said
    # "the trainer and the engine stay resident" while the engine left at every training phase)
    offloaded = MemoryPlan(False, GIB, usable, engine_offloaded=True).describe()
    assert "weights and KV pool leave the device" in offloaded and "stay resident" not in offloaded


def test_the_footprint_is_the_line_through_two_probes():
    step = StepFootprint.from_two_points((1024, 4096), (3 * GIB, 6 * GIB))
    assert step.bytes_per_token == GIB / 1024 and step.fixed_bytes == 2 * GIB
    assert step.peak_bytes(8192) == 10 * GIB
    assert StepFootprint.from_two_points((1024, 4096), (5 * GIB, 4 * GIB)).bytes_per_token == 0.0  # noise


@pytest.mark.parametrize("fields, tokens", [
    ({"use_dynamic_batch_size": True, "max_tokens_per_gpu": 32768, "rollout_max_response_len": 2048}, 32768),
    ({"use_dynamic_batch_size": True, "max_tokens_per_gpu": 4096, "rollout_max_response_len": 2048,
      "rollout_max_prompt_len": 512}, 4096),
    ({"micro_batch_size": 8, "rollout_max_response_len": 512, "rollout_max_prompt_len": 256}, 8 * 768),
    ({"micro_batch_size": 2, "rollout_max_response_len": 512, "rollout_max_context_len": 4096}, 8192),
])
def test_the_largest_micro_batch_follows_the_flags(fields, tokens):
    cfg = RelaxConfig(hf_checkpoint="m", prompt_data="p.jsonl", **fields)
    assert largest_micro_batch_tokens(cfg) == tokens


def test_the_phase_memory_releases_only_the_kv_pool_while_training_and_the_engine_samples_the_same():
    engine = EmbeddedEngine(make_model(seed=0), make_tokenizer(), core=CoreSettings(mode="on"))
    before = _generate(engine)
    memory = PhaseMemory([], engine, torch.device("cpu"), offload_train=False, offload_rollout=False,
                         release_kv_while_training=True)
    assert memory.moves_memory
    for _ in range(2):
        asyncio.run(memory.enter_training())
        assert engine.core.runner.released and all(p.numel() for p in engine.model.parameters())
        assert not asyncio.run(memory.before_weight_sync())  # the weights never left: nothing to resend
        asyncio.run(memory.enter_rollout())
        assert not engine.core.runner.released
        assert _generate(engine) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_probe_predicts_the_training_peak_on_cuda(tiny_workspace, tmp_path):
    """The plan's prediction of the training phase's peak (probe + resident + AdamW's moments) against the peak two
    real steps reach with the largest micro-batch the flags allow."""
    from relax.cli.args import parse_config
    from relax.core.build import build_roles
    from relax.core.loops.sync import SyncController
    from relax.core.placement.in_process import InProcessPlacement
    from relax.telemetry.metrics_file import read_metrics
    from relax.telemetry.tracking import Tracker
    from tests.support.runs import tiny_train_args

    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, "--num-rollout", "2", "--device", "cuda",
                                       "--skip-eval-before-train", "--dump-samples", "0",
                                       "--rollout-max-response-len", "64", "--rollout-max-prompt-len", "64"))
    roles = build_roles(cfg)
    with Tracker(cfg.output_dir, use_tensorboard=False) as tracker:
        controller = SyncController(cfg, InProcessPlacement(cfg, roles), tracker)
        plan = controller.memory.plan
        # whether the pool is released depends on what else holds the device (in a `-m gpu` session, what earlier
        # tests left allocated): the prediction must hold either way
        assert plan is not None
        asyncio.run(controller.run())
    peak = max(row["perf/gpu_peak_gib_train"] for row in read_metrics(tmp_path / "metrics.jsonl")
               if "perf/gpu_peak_gib_train" in row) * GIB
    assert peak <= plan.peak_bytes * 1.1, (peak / GIB, plan.peak_bytes / GIB)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_probe_line_bounds_a_step_whose_micro_batches_fill_the_budget(tmp_path):
    """A step's second and later micro-batches hold the gradients of the earlier ones beside their own activations.
    The probe's line at the token budget must bound the peak of a step of four micro-batches that each fill it (a
    line through first micro-batches, whose backward frees activations as it makes gradients, missed the gradients:
    issue 32's out-of-memory error on the Qwen3-4B shape), and not overshoot it by much either."""
    from relax.backends.training.base import TrainBatch
    from relax.backends.training.fsdp import FSDPTrainBackend
    from relax.backends.training.settings import TrainSettings
    from tests.backends.training.test_packing import LOSS
    from tests.support.tiny_assets import build_tiny_model_dir

    # gradients a sizeable share of the step: 15.8 MB of float32 (3.9M parameters) beside the activations
    model_dir = build_tiny_model_dir(tmp_path / "model", hidden_size=256, intermediate_size=1024,
                                     num_hidden_layers=4, head_dim=64, max_position_embeddings=1024)
    budget, sample = 2048, 256
    settings = TrainSettings(device=torch.device("cuda"), compute_dtype=torch.bfloat16, micro_batch_size=1,
                             temperature=1.0, pad_token_id=0, lr=1e-4, total_optimizer_steps=4,
                             max_tokens_per_gpu=budget)
    backend = FSDPTrainBackend(model_dir, settings)
    generator = torch.Generator().manual_seed(0)
    count = 4 * budget // sample  # four micro-batches of eight samples each
    response = sample - 16
    batch = TrainBatch(tokens=[torch.randint(3, backend.hf_config.vocab_size, (sample,), generator=generator).tolist()
                               for _ in range(count)],
                       response_lengths=[response] * count, loss_masks=[[1] * response] * count,
                       fields={"advantages": [torch.randn(response, generator=generator) for _ in range(count)],
                               "old_log_probs": [-torch.rand(response, generator=generator) for _ in range(count)]})
    backend.train_step(batch, LOSS)  # AdamW's moments now exist: the state between steps
    backend.model.zero_grad(set_to_none=True)
    probe = (budget // 8, budget // 4)
    line = StepFootprint.from_two_points(probe, tuple(backend.measure_step_memory(probe)))
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    backend.train_step(batch, LOSS)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - held
    predicted = line.peak_bytes(budget)
    assert peak <= predicted * 1.05, (peak / 2**20, predicted / 2**20)
    assert predicted <= peak * 1.5, (peak / 2**20, predicted / 2**20)


@pytest.mark.parametrize("family", ["text", "vision-language", "omni"])
def test_the_memory_probes_pass_runs_on_every_familys_model(family, tmp_path):
    """The probe's forward and backward (`FSDPTrainBackend._probe_pass`, what `measure_step_memory` times on CUDA)
    on a text model, Qwen2.5-VL and Qwen2.5-Omni: its token ids come from the input embedding's rows, since a
    multimodal family's top-level config has no vocabulary size (the probe that read it failed on Qwen2.5-VL on the
    GPU, and the run went on unplanned). It makes every trained weight's gradient and leaves the weights alone."""
    from relax.backends.training.fsdp import FSDPTrainBackend
    from relax.backends.training.settings import TrainSettings
    from tests.support.tiny_assets import build_tiny_model_dir
    from tests.support.tiny_mm_assets import build_tiny_omni, build_tiny_vl

    builders = {"text": lambda path: build_tiny_model_dir(path / "model"), "vision-language": build_tiny_vl,
                "omni": build_tiny_omni}
    settings = TrainSettings(device=torch.device("cpu"), compute_dtype=torch.float32, micro_batch_size=1,
                             temperature=1.0, pad_token_id=0, lr=1e-4, total_optimizer_steps=1)
    backend = FSDPTrainBackend(builders[family](tmp_path), settings)
    before = {name: p.detach().clone() for name, p in backend.model.named_parameters()}
    backend._probe_pass(33, torch.Generator().manual_seed(0))
    embedding = backend.model.hf_model.get_input_embeddings().weight
    assert embedding.grad is not None and torch.count_nonzero(embedding.grad) == 0  # a zero loss
    assert all(torch.equal(p, before[name]) for name, p in backend.model.named_parameters())


@pytest.mark.parametrize("family", ["vision-language", "omni"])
def test_a_critic_on_a_multimodal_checkpoint_reads_its_text_configs_width(family, tmp_path):
    """The same class of fault as the probe's: the critic's value head took its width from the top-level config,
    which a multimodal family leaves without one. It trains on the text samples of such a checkpoint."""
    from relax.backends.training.fsdp import FSDPTrainBackend
    from relax.backends.training.settings import TrainSettings
    from tests.support.tiny_mm_assets import build_tiny_omni, build_tiny_vl

    model_dir = (build_tiny_omni if family == "omni" else build_tiny_vl)(tmp_path)
    settings = TrainSettings(device=torch.device("cpu"), compute_dtype=torch.float32, micro_batch_size=1,
                             temperature=1.0, pad_token_id=0, lr=1e-4, total_optimizer_steps=1)
    backend = FSDPTrainBackend(model_dir, settings, value_head=True)
    width = backend.model.hf_model.config.get_text_config().hidden_size
    assert backend.model.value_head.in_features == width
    backend._probe_pass(9, torch.Generator().manual_seed(0))
    assert backend.model.value_head.weight.grad is not None


def test_a_failed_probe_is_logged_as_text_that_holds_no_frame(tmp_path, caplog, monkeypatch):
    """A probe that raises leaves the run unplanned with a warning naming the error and where it came from. The
    record holds text only: with the exception among its arguments, its traceback kept the planning frame and the
    engine's 31 GiB KV pool alive for as long as a handler kept the record (pytest's log capture, on the GPU)."""
    import gc
    import logging
    import weakref
    from types import SimpleNamespace

    from relax.core.loops.phase_memory import plan_for_run
    from tests.backends.training.test_fsdp_backend import make_backend
    from tests.support.tiny_assets import build_tiny_model_dir

    class Pool:  # stands in for the engine's KV pool: what the frame must not keep
        kv_pool_bytes = 1

    backend = make_backend(build_tiny_model_dir(tmp_path / "model"))

    def probe(token_counts):
        raise AttributeError("'ThinkerOutput' object has no attribute 'last_hidden_state'")

    monkeypatch.setattr(backend, "measure_step_memory", probe)
    roles = SimpleNamespace(device=torch.device("cuda"), rollout=SimpleNamespace(engine=Pool()),
                            actor=SimpleNamespace(backend=backend), reference=None, critic=None, distillation=None)
    cfg = RelaxConfig(hf_checkpoint="m", prompt_data="p.jsonl", micro_batch_size=2, rollout_max_response_len=8,
                      rollout_max_prompt_len=8)
    with caplog.at_level(logging.WARNING, logger="relax"):
        assert plan_for_run(cfg, roles, can_release_kv=True, engine_released=False) is None
    (record,) = [r for r in caplog.records if "memory plan skipped" in r.getMessage()]
    assert "AttributeError: 'ThinkerOutput' object has no attribute 'last_hidden_state', at " in record.getMessage()
    assert "test_memory_plan.py:" in record.getMessage()
    assert all(isinstance(arg, str | int) for arg in record.args)
    held = weakref.ref(roles.rollout.engine)
    del roles
    gc.collect()
    assert held() is None, "the record (still in caplog) keeps the engine"


def _planned_run(tmp_path, monkeypatch, keep: str, bytes_per_token_kept: int, bytes_per_token: int,
                 total_gib: float = 10.0):
    """`plan_for_run` on a CPU trainer whose probe reports a line per token (more with kept logits) on a device of
    ``total_gib``, the CUDA queries answered for it; the trainers' kept-logits setting after it, and the plan."""
    from types import SimpleNamespace

    from relax.core.loops import phase_memory
    from tests.backends.training.test_fsdp_backend import make_backend
    from tests.support.tiny_assets import build_tiny_model_dir

    backend = make_backend(build_tiny_model_dir(tmp_path / "model"))
    backend.keep_logits(keep == "on")  # as `run_settings.train_settings` starts it
    probed = []

    def probe(token_counts):
        kept = backend.settings.log_probs_keep_logits
        probed.append(kept)
        per_token = bytes_per_token_kept if kept else bytes_per_token
        return [count * per_token for count in token_counts]

    monkeypatch.setattr(backend, "measure_step_memory", probe)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=int(total_gib * GIB)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    monkeypatch.setattr(phase_memory, "optimizer_state_bytes", lambda trainer: 0)
    roles = SimpleNamespace(device=torch.device("cuda"),
                            rollout=SimpleNamespace(engine=SimpleNamespace(kv_pool_bytes=0)),
                            actor=SimpleNamespace(backend=backend), reference=None, critic=None, distillation=None)
    cfg = RelaxConfig(hf_checkpoint="m", prompt_data="p.jsonl", use_dynamic_batch_size=True, max_tokens_per_gpu=4096,
                      rollout_max_response_len=64, rollout_max_prompt_len=64, log_probs_keep_logits=keep)
    plan = phase_memory.plan_for_run(cfg, roles, can_release_kv=True, engine_released=False)
    return backend.settings.log_probs_keep_logits, plan, probed


def test_auto_keeps_the_logits_where_the_plan_has_room_for_them(tmp_path, monkeypatch):
    kept, plan, probed = _planned_run(tmp_path, monkeypatch, "auto", bytes_per_token_kept=1 << 20,
                                      bytes_per_token=1 << 19)
    assert kept and plan is not None and probed == [True]


def test_auto_recomputes_them_where_only_the_step_without_them_fits(tmp_path, monkeypatch):
    # 4096 tokens: 12 GiB with the logits kept, 4 GiB without, on a 10 GiB device
    kept, plan, probed = _planned_run(tmp_path, monkeypatch, "auto", bytes_per_token_kept=3 << 20,
                                      bytes_per_token=1 << 20)
    assert not kept and plan is not None and probed == [True, False]


def test_on_is_refused_with_the_remedy_and_off_never_keeps_them(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="--log-probs-keep-logits off or auto"):
        _planned_run(tmp_path, monkeypatch, "on", bytes_per_token_kept=3 << 20, bytes_per_token=1 << 20)
    kept, plan, probed = _planned_run(tmp_path, monkeypatch, "off", bytes_per_token_kept=1 << 20,
                                      bytes_per_token=1 << 19)
    assert not kept and plan is not None and probed == [False]


def test_auto_recomputes_them_where_the_step_cannot_be_measured(tmp_path, monkeypatch):
    kept, plan, _ = _planned_run(tmp_path, monkeypatch, "auto", bytes_per_token_kept=1, bytes_per_token=1)
    assert kept and plan is not None  # (measured)
    from relax.core.loops import phase_memory

    monkeypatch.setattr(phase_memory, "_measured_plan", lambda *args: None)
    kept, plan, _ = _planned_run(tmp_path / "again", monkeypatch, "auto", bytes_per_token_kept=1, bytes_per_token=1)
    assert not kept and plan is None
