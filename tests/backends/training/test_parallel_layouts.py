"""The trainer's mesh (issue 30): a training step under tensor parallelism, alone and with FSDP2, equals the
single-process step on real gloo process groups (dense Qwen3, Qwen3-MoE, a vision-language model); checkpoints
reshard across layouts; the weights an engine is synced with are the trainer's full tensors; layouts that cannot be
built are refused naming the flag."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import transformers
from hypothesis import given
from hypothesis import strategies as st

from relax.backends.training.fsdp import FSDPTrainBackend
from relax.backends.training.mesh import ParallelDims
from relax.distributed.process_group import free_loopback_port, shutdown_process_group
from tests.backends.training.test_packing import LOSS, _media_batch, _rl_batch, _settings
from tests.support.tiny_families import build_text_family
from tests.support.tiny_mm_assets import build_tiny_vl

LR = 1e-4


def _backend(model_dir: str, tp: int = 1) -> FSDPTrainBackend:
    torch.manual_seed(0)
    return FSDPTrainBackend(model_dir, dataclasses.replace(_settings(), lr=LR, tensor_model_parallel_size=tp))


def _grads(backend) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in backend.model.named_parameters() if p.grad is not None}


def _step(backend, batch) -> dict:
    metrics = backend.train_step(batch, LOSS)
    return {"metrics": metrics, "grads": _grads(backend), "state": backend.full_state_dict()}


def _assert_same_step(got: dict, expected: dict) -> None:
    for key in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert got["metrics"][key] == pytest.approx(expected["metrics"][key], rel=1e-5, abs=1e-7), key
    assert got["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    # AdamW moves each weight by about lr whatever its gradient's size, so float32 sums taken in another order
    # move a near-zero gradient's weight by a small fraction of lr: compare at 2% of it
    for name, tensor in expected["state"].items():
        torch.testing.assert_close(got["state"][name], tensor, rtol=0, atol=0.02 * LR, msg=name)


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)


def _tensor_parallel_on_rank(rank: int, world: int, port: int, models: dict, root: str) -> None:
    """World 2: a TP=2 step per model; Qwen3's checkpoint saved at TP=2 and loaded at FSDP=2, which takes a
    second step; the weights of a weight sync from the TP trainer."""
    _join(rank, world, port)
    results = {}
    for name, model_dir in models.items():
        backend = _backend(model_dir, tp=2)
        assert backend.dims.tp == 2 and backend.dims.dp == 1
        results[name] = _step(backend, torch.load(Path(root) / f"{name}.batch", weights_only=False))
        if name == "qwen3":
            synced = {n: t.clone() for bucket in backend.named_parameters_for_sync(torch.float32, 1 << 12)
                      for n, t in bucket}
            results["synced"] = synced
            backend.save(Path(root) / "tp2")
        backend.release()
    data_parallel = _backend(models["qwen3"], tp=1)
    data_parallel.load(Path(root) / "tp2")
    results["loaded_at_fsdp2"] = data_parallel.full_state_dict()
    results["second_step_at_fsdp2"] = _step(data_parallel, _rl_batch(seed=1))
    data_parallel.release()
    if rank == 0:
        torch.save(results, Path(root) / "results.pt")
    shutdown_process_group()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    dirs = {name: str(build_text_family(name, root / name)) for name in ("qwen3", "qwen3_moe")}
    dirs["vl"] = str(build_tiny_vl(root))
    batches = {"qwen3": _rl_batch(), "qwen3_moe": _rl_batch(), "vl": _media_batch(dirs["vl"], "image", root, count=2)}
    for name, batch in batches.items():
        torch.save(batch, root / f"{name}.batch")
    return root, dirs, batches


def test_tensor_parallel_steps_equal_the_single_process_step_and_checkpoints_reshard(models):
    root, dirs, batches = models
    mp.start_processes(_tensor_parallel_on_rank, args=(2, free_loopback_port(), dirs, str(root)), nprocs=2,
                       join=True, start_method="spawn")
    results = torch.load(root / "results.pt", weights_only=False)
    for name, model_dir in dirs.items():
        single = _backend(model_dir)
        assert single.dims.trivial
        _assert_same_step(results[name], _step(single, batches[name]))
        if name == "qwen3":
            first_state = results[name]["state"]
            # an engine synced from the TP trainer holds exactly its full tensors
            hf_names = {n: t for n, t in first_state.items()}
            assert results["synced"].keys() == hf_names.keys()
            for n, tensor in results["synced"].items():
                assert torch.equal(tensor, hf_names[n]), n
            # saved at TP=2, loaded at FSDP=2: the same weights, and the optimizer state came along (the second
            # step equals the single process's second step)
            for n, tensor in first_state.items():
                assert torch.equal(results["loaded_at_fsdp2"][n], tensor), n
            _assert_same_step(results["second_step_at_fsdp2"], _step(single, _rl_batch(seed=1)))
        single.release()


def _two_dimensional_on_rank(rank: int, world: int, port: int, model_dir: str, root: str) -> None:
    """World 4: FSDP=2 x TP=2 takes a step and saves; FSDP=4 loads and takes the second; TP=2 x FSDP=2 loads that
    and takes the third."""
    _join(rank, world, port)
    results = {}
    for index, tp in enumerate((2, 1, 2)):
        backend = _backend(model_dir, tp=tp)
        assert backend.dims.dp == world // tp
        if index:
            backend.load(Path(root) / f"step{index}")
        results[index] = _step(backend, _rl_batch(seed=index))
        backend.save(Path(root) / f"step{index + 1}")
        backend.release()
    if rank == 0:
        torch.save(results, Path(root) / "results.pt")
    shutdown_process_group()


def test_fsdp_by_tensor_parallel_steps_equal_the_single_process_steps_across_layouts(models, tmp_path):
    _, dirs, _ = models
    mp.start_processes(_two_dimensional_on_rank, args=(4, free_loopback_port(), dirs["qwen3"], str(tmp_path)),
                       nprocs=4, join=True, start_method="spawn")
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    single = _backend(dirs["qwen3"])
    for index in range(3):
        _assert_same_step(results[index], _step(single, _rl_batch(seed=index)))
    single.release()


# ---- layouts refused -----------------------------------------------------------------------------

@given(world=st.integers(1, 16), tp=st.integers(1, 8), heads=st.integers(1, 16), kv_heads=st.integers(1, 8))
def test_a_layout_is_refused_exactly_when_a_size_does_not_divide_naming_the_flag(world, tp, heads, kv_heads):
    config = transformers.Qwen3Config(num_attention_heads=heads, num_key_value_heads=kv_heads)
    dims = ParallelDims(world, tp=tp)
    fits = world % tp == 0 and (tp == 1 or (heads % tp == 0 and kv_heads % tp == 0))
    if fits:
        dims.check(config)
        assert dims.dp * tp == world
    else:
        with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
            dims.check(config)


def test_a_family_without_a_plan_is_refused_naming_the_flag(models):
    from relax.backends.training.parallelize import tensor_parallel_plan

    config = transformers.CONFIG_MAPPING["glm_moe_dsa"](num_hidden_layers=1, hidden_size=32, num_attention_heads=2)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size: GLM-5 .* has no tensor-parallel plan"):
        tensor_parallel_plan(type("Model", (), {"config": config})())


def test_the_flag_reaches_the_trainer_and_the_upstream_flags_left_are_refused_with_a_reason():
    from relax.cli.args import parse_config
    from relax.config import ConfigError

    cfg = parse_config(["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", "--tensor-model-parallel-size", "2"])
    assert cfg.tensor_model_parallel_size == 2
    with pytest.raises(ConfigError, match="--context-parallel-size: not built in Relax yet"):
        parse_config(["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", "--context-parallel-size", "2"])
