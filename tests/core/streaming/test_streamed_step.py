"""A step trained as its data arrives (``--train-stream-chunks``): chunks accumulated with provisional loss
denominators and rescaled at the end give the optimizer step of the whole batch, for every loss aggregation, with
groups dropped on the way, with the MoE auxiliary loss, and across two real gloo ranks."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

from relax.algorithms.aggregation import LOSS_AGGREGATIONS
from relax.algorithms.loss import build_policy_loss_fn
from relax.algorithms.policy_loss import PolicyLossSettings
from relax.backends.training.fsdp import FSDPTrainBackend
from relax.components.actor import Actor
from relax.data.sample import Sample
from relax.distributed.process_group import free_loopback_port, shutdown_process_group
from tests.backends.training.test_packing import _rl_batch, _settings
from tests.support.runs import start_ranks
from tests.support.tiny_families import build_text_family


def _loss(aggregation: str, policy_loss: str = "ppo_clip"):
    return build_policy_loss_fn(PolicyLossSettings(
        policy_loss=policy_loss, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None, aggregation=aggregation,
        use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01, use_tis=True, max_response_len=12))


def _samples_and_fields(num_samples: int, seed: int = 0):
    batch = _rl_batch(num_samples=num_samples, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    samples = [Sample(index=i, group_index=i, tokens=tokens, response_length=length, loss_mask=mask)
               for i, (tokens, length, mask) in enumerate(zip(batch.tokens, batch.response_lengths, batch.loss_masks))]
    fields = dict(batch.fields)
    fields["ref_log_probs"] = [-torch.rand(r, generator=generator) * 3 for r in batch.response_lengths]
    fields["rollout_log_probs"] = [-torch.rand(r, generator=generator) * 3 for r in batch.response_lengths]
    return samples, fields


def _actor(model_dir, aggregation: str, policy_loss: str = "ppo_clip", **settings) -> Actor:
    torch.manual_seed(0)
    backend = FSDPTrainBackend(model_dir, _settings(clip_grad=1.0, **settings))
    return Actor(backend, _loss(aggregation, policy_loss), train_batch_size=64, loss_aggregation=aggregation)


def _whole(actor: Actor, samples, fields) -> dict[str, float]:
    return asyncio.run(actor.train(samples, fields))


def _streamed(actor: Actor, samples, fields, cuts: list[int], expected: int, mark_last: bool = True):
    async def run():
        starts = [0, *cuts]
        for start, end in zip(starts, [*cuts, len(samples)]):
            chunk = {name: values[start:end] for name, values in fields.items()}
            await actor.train_chunk(0, samples[start:end], chunk, expected, mark_last and end == len(samples))
        return await actor.finish_streamed_step(0)

    return asyncio.run(run())


def _assert_same_step(whole: tuple[dict, dict], streamed: tuple[dict, dict]) -> None:
    """Same metrics and the same (clipped) gradients the optimizer step was taken with."""
    (metrics, grads), (streamed_metrics, streamed_grads) = whole, streamed
    assert set(streamed_metrics) == set(metrics)
    for name, value in metrics.items():
        assert streamed_metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    for name, grad in grads.items():
        torch.testing.assert_close(streamed_grads[name], grad, atol=1e-6, rtol=1e-4)


def _gradients(actor: Actor) -> dict[str, torch.Tensor]:
    """The gradients of the step just taken (the next step zeroes them), whole on every rank."""
    return {name: getattr(p.grad, "full_tensor", lambda g=p.grad: g)().clone()
            for name, p in actor.backend.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("policy_loss", ["ppo_clip", "m2po"])
def test_a_step_trained_in_chunks_equals_the_whole_step(tiny_workspace, aggregation, policy_loss):
    """Random chunkings (property): loss, every metric, the gradient norm and the weights after the optimizer step
    equal the whole step's, whatever the first chunk implied for the token count."""
    model_dir = tiny_workspace / "model"
    samples, fields = _samples_and_fields(9)
    whole_actor = _actor(model_dir, aggregation, policy_loss)
    whole = (_whole(whole_actor, samples, fields), _gradients(whole_actor))
    rng = random.Random(f"{aggregation}/{policy_loss}")
    # M2PO's masks and moments are statistics of each micro-batch (3 samples here), so its step depends on how
    # samples are grouped into micro-batches, chunked or not: its chunks keep the whole step's micro-batches.
    boundaries = range(3, len(samples), 3) if policy_loss == "m2po" else range(1, len(samples))
    for _ in range(3):
        cuts = sorted(rng.sample(boundaries, rng.randint(1, len(boundaries) if policy_loss == "m2po" else 4)))
        actor = _actor(model_dir, aggregation, policy_loss)
        streamed = _streamed(actor, samples, fields, cuts, expected=len(samples), mark_last=rng.random() < 0.5)
        _assert_same_step(whole, (streamed, _gradients(actor)))


def test_dropped_groups_leave_the_step_of_what_arrived(tiny_workspace):
    """The step expected 12 samples and 9 arrived (groups dropped as stale or failed): the update is that of the 9,
    with their own denominators."""
    model_dir = tiny_workspace / "model"
    samples, fields = _samples_and_fields(9, seed=3)
    whole_actor = _actor(model_dir, "seq-mean-token-mean")
    whole = (_whole(whole_actor, samples, fields), _gradients(whole_actor))
    actor = _actor(model_dir, "seq-mean-token-mean")
    _assert_same_step(whole, (_streamed(actor, samples, fields, [4], expected=12, mark_last=False), _gradients(actor)))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_text_family("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3_moe")


def test_the_moe_auxiliary_loss_is_rescaled_with_the_samples(moe_dir):
    """The auxiliary loss is a statistic of each micro-batch's routing: chunks that keep the micro-batches (3 samples)
    give the whole step, with 3 samples fewer than expected arriving."""
    samples, fields = _samples_and_fields(7)
    whole_actor = _actor(moe_dir, "seq-mean-token-mean", moe_aux_loss_coef=0.5)
    whole = (_whole(whole_actor, samples, fields), _gradients(whole_actor))
    assert whole[0]["train/moe_aux_loss"] > 0
    actor = _actor(moe_dir, "seq-mean-token-mean", moe_aux_loss_coef=0.5)
    _assert_same_step(whole, (_streamed(actor, samples, fields, [3, 6], expected=10), _gradients(actor)))
    # token-mean divides the policy loss by tokens, the auxiliary loss by samples: one rescale cannot fix both
    token_mean = _actor(moe_dir, "token-mean", moe_aux_loss_coef=0.5)
    assert "MoE auxiliary loss" in asyncio.run(token_mean.streamed_step_unsupported(7))


def test_several_optimizer_steps_per_rollout_wait_for_the_whole_batch(tiny_workspace):
    actor = _actor(tiny_workspace / "model", "seq-mean-token-mean")
    actor.train_batch_size = 4
    assert "old-policy log-probs" in asyncio.run(actor.streamed_step_unsupported(8))
    assert asyncio.run(actor.streamed_step_unsupported(4)) is None


def _streamed_on_rank(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    actor = _actor(model_dir, "token-mean")
    assert actor.backend.sharded
    samples, fields = _samples_and_fields(9)
    # uneven chunks (a rank gets one sample of the 3-sample chunk fewer), the last not marked: end_step reduces
    metrics = _streamed(actor, samples, fields, [3, 4], expected=12, mark_last=False)
    grads = _gradients(actor)
    if rank == 0:
        torch.save({"metrics": metrics, "grads": grads}, out)
    shutdown_process_group()


def test_two_ranks_train_a_streamed_step_as_one_process_trains_the_whole(tiny_workspace, tmp_path):
    model_dir, out = str(tiny_workspace / "model"), str(tmp_path / "rank0.pt")
    start_ranks(_streamed_on_rank, (2, free_loopback_port(), model_dir, out), nprocs=2)
    sharded = torch.load(out, weights_only=False)
    single = _actor(model_dir, "token-mean")
    samples, fields = _samples_and_fields(9)
    metrics = _whole(single, samples, fields)
    for name in ("train/loss", "train/pg_loss", "train/kl_loss", "train/grad_norm"):
        assert sharded["metrics"][name] == pytest.approx(metrics[name], rel=1e-4, abs=1e-6), name
    for name, grad in _gradients(single).items():
        torch.testing.assert_close(sharded["grads"][name], grad, atol=1e-6, rtol=1e-4)


def test_an_unfinished_step_does_not_leak_into_the_next(tiny_workspace):
    """A step whose chunks were never finished (the run failed mid-step) does not leak into the next step."""
    model_dir = tiny_workspace / "model"
    samples, fields = _samples_and_fields(6)
    actor = _actor(model_dir, "seq-mean-token-mean")
    asyncio.run(actor.train_chunk(0, samples[:3], {n: v[:3] for n, v in fields.items()}, 6, False))
    # the next step starts over: its update is that of its own chunks only
    reference = _actor(model_dir, "seq-mean-token-mean")
    metrics = asyncio.run(_finish_after(actor, 1, samples, fields))
    expected = asyncio.run(_finish_after(reference, 1, samples, fields))
    assert metrics["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-5)


async def _finish_after(actor: Actor, step: int, samples, fields) -> dict[str, float]:
    await actor.train_chunk(step, samples, fields, len(samples), True)
    return await actor.finish_streamed_step(step)
