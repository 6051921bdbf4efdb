"""Two real gloo processes train with FSDP2 (sharded) and match the one-process step."""

import os

import pytest
import torch

from relax.distributed.process_group import free_loopback_port, shutdown_process_group
from tests.backends.training.test_fsdp_backend import LOSS, make_backend, make_batch
from tests.support.runs import start_ranks


def _gradients(backend):
    return {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)().clone() for n, p in backend.model.named_parameters()}


def _backend(model_dir, variant: str):
    """``even``: 8 samples, 2 per micro-batch. ``uneven``: 5 samples (shares of 3 and 2, so one rank has a
    micro-batch fewer and runs a placeholder). ``budget``: token-budget micro-batches on token-balanced shares."""
    import dataclasses

    backend = make_backend(model_dir, micro_batch_size=2, lr=1e-4)
    if variant == "budget":
        backend.settings = dataclasses.replace(backend.settings, max_tokens_per_gpu=14, balance_data=True)
    return backend


def _variant_batch(variant: str):
    return make_batch(num_samples=5) if variant == "uneven" else make_batch()


def _train_on_rank(rank: int, world_size: int, port: int, model_dir: str, out: str, variant: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    backend = _backend(model_dir, variant)
    assert backend.sharded
    metrics = backend.train_step(_variant_batch(variant), LOSS)
    grads = _gradients(backend)
    state = backend.full_state_dict()
    if rank == 0:
        torch.save({"metrics": metrics, "grads": grads, "state": state}, out)
    shutdown_process_group()


@pytest.mark.parametrize("variant", ["even", "uneven", "budget"])
def test_two_process_fsdp_step_equals_the_single_process_step(variant, tiny_workspace, tmp_path):
    model_dir, out = str(tiny_workspace / "model"), str(tmp_path / "rank0.pt")
    start_ranks(_train_on_rank, (2, free_loopback_port(), model_dir, out, variant), nprocs=2)
    sharded = torch.load(out, weights_only=False)

    single = make_backend(model_dir, micro_batch_size=2, lr=1e-4)
    assert not single.sharded
    metrics = single.train_step(_variant_batch(variant), LOSS)
    for key in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert abs(sharded["metrics"][key] - metrics[key]) <= 1e-5 * max(1.0, abs(metrics[key])), key
    for name, grad in _gradients(single).items():
        torch.testing.assert_close(sharded["grads"][name], grad, atol=1e-6, rtol=1e-4)
    # After AdamW each parameter moves by at most ~lr; the two runs agree well inside that.
    for name, tensor in single.full_state_dict().items():
        torch.testing.assert_close(sharded["state"][name], tensor, atol=2e-6, rtol=0)


def _step_with_checkpoint(model_dir: str, checkpoint: str, action: str) -> dict:
    """Train a step and save (``train_and_save``) or load, then take one more step: the full weights after it."""
    backend = make_backend(model_dir, micro_batch_size=2, lr=1e-4)
    if action == "train_and_save":
        backend.train_step(make_batch(), LOSS)
        os.makedirs(checkpoint, exist_ok=True)
        backend.save(checkpoint)
    else:
        backend.load(checkpoint)
    backend.train_step(make_batch(seed=1), LOSS)  # the optimizer state must have come back too
    return backend.full_state_dict()


def _save_or_load_on_rank(rank: int, world_size: int, port: int, model_dir: str, checkpoint: str, action: str,
                          out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    state = _step_with_checkpoint(model_dir, checkpoint, action)
    if rank == 0:
        torch.save(state, out)
    shutdown_process_group()


def _one_process(model_dir, checkpoint, action, out):
    torch.save(_step_with_checkpoint(model_dir, checkpoint, action), out)


def _assert_close_states(a, b):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_checkpoints_move_between_world_sizes(tiny_workspace, tmp_path):
    """Saved by 2 processes, resumed by 1 (and the other way): weights and optimizer state come back, so the next
    step lands where an uninterrupted run at the saving world size lands."""
    model_dir = str(tiny_workspace / "model")

    def two(action, checkpoint, out):
        start_ranks(_save_or_load_on_rank, (2, free_loopback_port(), model_dir, checkpoint, action, out), nprocs=2)
        return torch.load(out, weights_only=False)

    # 2 -> 1: the 2-process run saves after step 1 and takes step 2; a 1-process run loads and takes step 2
    reference = two("train_and_save", str(tmp_path / "ckpt2"), str(tmp_path / "ref2.pt"))
    _one_process(model_dir, str(tmp_path / "ckpt2"), "load", str(tmp_path / "resumed1.pt"))
    _assert_close_states(torch.load(tmp_path / "resumed1.pt"), reference)
    # 1 -> 2
    _one_process(model_dir, str(tmp_path / "ckpt1"), "train_and_save", str(tmp_path / "ref1.pt"))
    resumed = two("load", str(tmp_path / "ckpt1"), str(tmp_path / "resumed2.pt"))
    _assert_close_states(resumed, torch.load(tmp_path / "ref1.pt"))


def test_torchrun_colocated_run_splits_the_rollout_across_ranks(tiny_workspace, tmp_path):
    """`torchrun --nproc-per-node 2 relax train`: both ranks train one FSDP model and each generates half of the
    prompt groups on its own engine; every step trains on all groups, and rank 0 alone writes the run directory."""
    import json

    from tests.support.runs import run_torchrun, tiny_train_args

    run_dir = tmp_path / "run"
    result = run_torchrun(2, "train", *tiny_train_args(tiny_workspace, run_dir, "--num-rollout", "2",
                                                       "--save-interval", "2"))
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/loss" in row]
    assert [row["step"] for row in steps] == [1, 2]
    assert all(row["rollout/num_samples"] == 16 for row in steps)  # 4 groups x 4 samples, from both engines
    assert (run_dir / "checkpoints" / "iter_0000002" / "model_optim").is_dir()


def test_groups_are_assigned_round_robin_in_order_of_appearance():
    from relax.backends.inference.base import GenerationRequest, SamplingParams
    from relax.backends.inference.data_parallel import assign_groups

    ids = ["g7-i0-0", "g7-i1-1", "g3-i2-2", "g3-i3-3", "g9-i4-4", "other"]
    requests = [GenerationRequest(rid, [1], SamplingParams()) for rid in ids]
    assert assign_groups(requests, 2) == [0, 0, 1, 1, 0, 1]
    assert assign_groups(requests, 1) == [0] * 6
