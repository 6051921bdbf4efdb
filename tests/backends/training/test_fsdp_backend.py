"""The FSDP2 training backend and in-process weight sync, on a tiny real model."""

import asyncio
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax.algorithms.loss import build_policy_loss_fn
from relax.algorithms.policy_loss import PolicyLossSettings
from relax.backends.inference.embedded import EmbeddedEngine
from relax.backends.training.base import TrainBatch
from relax.backends.training.fsdp import FSDPTrainBackend
from relax.backends.training.optimizer import lr_lambda
from relax.backends.training.settings import TrainSettings
from relax.components.actor import Actor
from relax.distributed.weight_sync import sync_weights_in_process

LOSS = build_policy_loss_fn(PolicyLossSettings(policy_loss="ppo_clip", eps_clip=0.2, eps_clip_high=0.2,
                                               eps_clip_c=None, aggregation="seq-mean-token-mean"))


def make_backend(model_dir, micro_batch_size=4, lr=1e-2, temperature=1.0, trainable=True):
    settings = TrainSettings(device=torch.device("cpu"), compute_dtype=torch.float32, micro_batch_size=micro_batch_size,
                             temperature=temperature, pad_token_id=0, lr=lr, total_optimizer_steps=10)
    return FSDPTrainBackend(model_dir, settings, trainable=trainable)


def make_batch(num_samples=8, seed=0) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    tokens, response_lengths = [], []
    for i in range(num_samples):
        length = 6 + i % 4
        tokens.append(torch.randint(3, 40, (length,), generator=generator).tolist())
        response_lengths.append(2 + i % 3)
    advantages = [torch.full((r,), 1.0 if i % 2 else -1.0) for i, r in enumerate(response_lengths)]
    loss_masks = [[1] * r for r in response_lengths]
    loss_masks[3][-1] = 0  # an environment token inside the response: excluded from the loss
    return TrainBatch(tokens, response_lengths, loss_masks, {"advantages": advantages})


def test_log_probs_match_a_plain_forward_with_temperature(tiny_workspace):
    model_dir = tiny_workspace / "model"
    backend = make_backend(model_dir, temperature=0.7)
    batch = make_batch()
    log_probs, entropy = backend.compute_log_probs(batch)[:2]
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    for i, tokens in enumerate(batch.tokens):
        with torch.no_grad():
            logits = reference(torch.tensor([tokens])).logits[0].float() / 0.7
        prompt_len = len(tokens) - batch.response_lengths[i]
        expected = logits.log_softmax(-1)[prompt_len - 1:-1].gather(-1, torch.tensor(tokens[prompt_len:])[:, None])
        torch.testing.assert_close(log_probs[i], expected.squeeze(-1), atol=1e-5, rtol=1e-5)
        probs = logits.softmax(-1)[prompt_len - 1:-1]
        torch.testing.assert_close(entropy[i], -(probs * probs.log()).sum(-1), atol=1e-4, rtol=1e-4)


def test_first_micro_batch_has_zero_ppo_kl_and_clipfrac_then_the_policy_moves(tiny_workspace):
    backend = make_backend(tiny_workspace / "model", micro_batch_size=2)
    batch = make_batch()
    old_log_probs = backend.compute_log_probs(batch).log_probs
    batch.fields["old_log_probs"] = old_log_probs
    seen = []

    def recording_loss(mb, log_probs, entropy):
        loss, metrics = LOSS(mb, log_probs, entropy)
        seen.append({k: float(v) * mb.global_num_samples / mb.mask.shape[0] for k, v in metrics.items()})
        return loss, metrics

    actor = Actor(backend, recording_loss, train_batch_size=4)  # two optimizer steps on one rollout batch
    asyncio.run(actor.train([_sample(batch, i) for i in range(len(batch))], batch.fields))
    first_step = seen[:2]
    assert all(abs(m["ppo_kl"]) < 1e-7 and m["clipfrac"] == 0.0 for m in first_step)
    assert any(abs(m["ppo_kl"]) > 1e-5 for m in seen[2:])  # after one update the policy has moved


def _sample(batch, i):
    from relax.data.sample import Sample

    return Sample(index=i, tokens=batch.tokens[i], response_length=batch.response_lengths[i],
                  loss_mask=batch.loss_masks[i])


def _gradients(backend):
    return {name: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for name, p in backend.model.named_parameters()}


def test_gradient_accumulation_equals_one_big_micro_batch(tiny_workspace):
    batch = make_batch()
    results = []
    for micro_batch_size in (1, 3, 8):
        backend = make_backend(tiny_workspace / "model", micro_batch_size=micro_batch_size)
        metrics = backend.train_step(batch, LOSS)
        results.append((metrics, _gradients(backend)))
    (reference_metrics, reference_grads), *others = results
    for metrics, grads in others:
        assert metrics["loss"] == pytest.approx(reference_metrics["loss"], abs=1e-6)
        assert metrics["grad_norm"] == pytest.approx(reference_metrics["grad_norm"], rel=1e-4)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], atol=1e-6, rtol=1e-4)


def _poisoned(value: float):
    """The policy loss with ``value`` (NaN, an infinity) added: a loss that overflowed, or NaN advantages."""
    def loss(mb, log_probs, entropy):
        total, metrics = LOSS(mb, log_probs, entropy)
        return total + value * log_probs.mean(), metrics  # (a constant would add nothing to the gradients)
    return loss


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_step_whose_gradients_are_not_finite_is_skipped_and_three_in_a_row_end_the_run(tiny_workspace, value):
    """A NaN or an infinity in the gradients had been written into every weight by the optimizer; the engine then
    sampled from NaN weights and the run failed steps later on a token id past the vocabulary."""
    backend = make_backend(tiny_workspace / "model")
    before = {name: tensor.clone() for name, tensor in backend.model.state_dict().items()}
    optimizer_state = len(backend.optimizer.state)
    for attempt in (1, 2):
        metrics = backend.train_step(make_batch(seed=attempt), _poisoned(value))
        assert metrics["skipped_nonfinite_grad"] == 1.0 and not math.isfinite(metrics["grad_norm"])
        assert all(torch.equal(tensor, before[name]) for name, tensor in backend.model.state_dict().items())
        assert len(backend.optimizer.state) == optimizer_state  # no moment of Adam saw the step
    with pytest.raises(RuntimeError, match="gradient norm was .* at 3 optimizer steps in a row, each skipped"):
        backend.train_step(make_batch(seed=3), _poisoned(value))
    assert all(torch.equal(tensor, before[name]) for name, tensor in backend.model.state_dict().items())

    backend = make_backend(tiny_workspace / "model")  # a finite step between two skipped ones starts the count anew
    for poisoned in (True, True, False, True, True, False):
        metrics = backend.train_step(make_batch(), _poisoned(value) if poisoned else LOSS)
        assert ("skipped_nonfinite_grad" in metrics) == poisoned and math.isfinite(metrics["grad_norm"]) != poisoned
    assert all(torch.isfinite(tensor).all() for tensor in backend.model.state_dict().values())


def test_weight_sync_makes_engine_weights_bit_identical(tiny_workspace):
    model_dir = tiny_workspace / "model"
    backend = make_backend(model_dir)
    backend.train_step(make_batch(), LOSS)
    engine = EmbeddedEngine(AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir))
    actor = Actor(backend, LOSS, train_batch_size=8)
    asyncio.run(sync_weights_in_process(actor, engine, version=1, dtype=torch.float32, bucket_bytes=4096))
    assert engine.weight_version == 1
    trained = backend.full_state_dict()
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name


def test_save_and_load_restore_model_optimizer_and_schedule(tiny_workspace, tmp_path):
    backend = make_backend(tiny_workspace / "model")
    backend.train_step(make_batch(seed=1), LOSS)
    backend.save(tmp_path / "ckpt")
    saved = backend.full_state_dict()
    after_save = backend.train_step(make_batch(seed=2), LOSS)
    restored = make_backend(tiny_workspace / "model")
    restored.load(tmp_path / "ckpt")
    for name, tensor in restored.full_state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    # Optimizer moments and the LR schedule came back too: the next step is the same step.
    again = restored.train_step(make_batch(seed=2), LOSS)
    assert again["loss"] == pytest.approx(after_save["loss"], abs=1e-7)
    assert again["lr"] == after_save["lr"]
    for name, tensor in restored.full_state_dict().items():
        torch.testing.assert_close(tensor, backend.full_state_dict()[name], atol=1e-7, rtol=0)


@pytest.mark.parametrize("layout", ["by parameter name", "by group index (checkpoints of before)"])
def test_the_optimizer_state_round_trips_in_either_checkpoint_layout(layout, tiny_workspace, tmp_path):
    """Checkpoints key the optimizer's state by parameter name (pipeline stages each hold a different group 0);
    those written before, with groups by index, still load with their moments and hyper-parameters. A parameter
    without a state yet (no gradient before the save: an omni thinker's unused audio token) has none after the load
    either, and starts at its first gradient."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    backend = make_backend(tiny_workspace / "model")
    backend.train_step(make_batch(seed=1), LOSS)
    backend.optimizer.state.pop(backend.model.hf_model.model.norm.weight)  # as if it had had no gradient
    if layout.startswith("by parameter"):
        backend.save(tmp_path / "ckpt")
        keys = dcp.FileSystemReader(str(tmp_path / "ckpt" / "model_optim")).read_metadata().state_dict_metadata
        assert any(key.startswith("optim.param_groups.hf_model.") for key in keys)
    else:  # what save_state wrote before
        model_state, optim_state = get_state_dict(backend.model, backend.optimizer, options=StateDictOptions())
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp_path / "ckpt" / "model_optim")
        torch.save(backend.scheduler.state_dict(), tmp_path / "ckpt" / "lr_scheduler.pt")
    restored = make_backend(tiny_workspace / "model")
    restored.load(tmp_path / "ckpt")
    for group, expected in zip(restored.optimizer.param_groups, backend.optimizer.param_groups):
        assert {k: v for k, v in group.items() if k != "params"} == {k: v for k, v in expected.items() if k != "params"}
    for param, expected in zip(restored.model.parameters(), backend.model.parameters()):
        state, reference = restored.optimizer.state[param], backend.optimizer.state[expected]
        assert state.keys() == reference.keys()
        for key in state:
            assert torch.equal(state[key], reference[key]), key


def test_frozen_backend_cannot_train(tiny_workspace):
    frozen = make_backend(tiny_workspace / "model", trainable=False)
    assert all(not p.requires_grad for p in frozen.model.parameters())
    with pytest.raises(AssertionError, match="frozen backend"):
        frozen.train_step(make_batch(), LOSS)


def test_learning_rate_schedule():
    assert [lr_lambda(s, 2, 10, "constant", 0.0) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_lambda(2, 2, 10, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_lambda(6, 2, 10, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_lambda(10, 2, 10, "cosine", 0.1) == pytest.approx(0.1)


def test_a_checkpointed_block_recomputes_with_the_rope_its_forward_ran_with():
    """Autograd may recompute a checkpointed block on another thread (CUDA's backward worker) or after the
    trainer's `rope_scope` closed; the recomputation must still dispatch RoPE as the forward did, or it saves tensors
    of other shapes and the backward fails (seen on the H200). Here the backward runs outside the scope."""
    from torch.utils.checkpoint import checkpoint

    from relax.backends.training import liger

    def block(x: torch.Tensor, seen: list[bool]) -> torch.Tensor:
        seen.append(liger._ROPE_ACTIVE.get())
        return x.sin()

    def run(**kwargs) -> list[bool]:
        seen: list[bool] = []
        x = torch.ones(3, requires_grad=True)
        with liger.rope_scope(True):
            y = checkpoint(block, x, seen, use_reentrant=False, **kwargs)
        y.sum().backward()  # the recomputation, outside the scope
        return seen

    assert run() == [True, False]  # the fault: the recomputation would take Hugging Face's RoPE
    assert run(context_fn=liger.checkpoint_context) == [True, True]


def test_the_trainer_checkpoints_blocks_with_that_context(tiny_workspace):
    import dataclasses

    from relax.backends.training import liger

    backend = make_backend(tiny_workspace / "model")
    settings = dataclasses.replace(backend.settings, gradient_checkpointing=True)
    checkpointed = FSDPTrainBackend(tiny_workspace / "model", settings)
    functions = {getattr(module, "_gradient_checkpointing_func", None) for module in checkpointed.model.modules()}
    functions.discard(None)
    assert functions and all(f.keywords == {"use_reentrant": False, "context_fn": liger.checkpoint_context}
                             for f in functions)
    metrics = checkpointed.train_step(make_batch(), build_policy_loss_fn(
        PolicyLossSettings("ppo_clip", 0.2, 0.2, None, "token-mean")))
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_the_kernels_put_the_chosen_rms_norm_forward_on_every_norm_instance_only(tiny_workspace):
    """`apply_liger_kernels` with `compiled_norm.rms_norm_forward` (the trainer's default on CUDA) patches each
    RMSNorm instance of the language model, and none with liger's; Hugging Face's class keeps its forward."""
    from transformers.models.qwen3 import modeling_qwen3

    from relax.backends.training import liger
    from relax.backends.training.compiled_norm import rms_norm_forward

    for chosen in (rms_norm_forward, None):
        model = AutoModelForCausalLM.from_pretrained(tiny_workspace / "model")
        norms = [m for m in model.modules() if type(m).__name__ == "Qwen3RMSNorm"]
        counts = liger.apply_liger_kernels(model.model, chosen)
        assert counts["rms_norm"] == len(norms) > 0
        assert {m.forward.__func__ for m in norms} == {chosen or liger._rms_norm_forward}
    assert modeling_qwen3.Qwen3RMSNorm.forward.__module__ == modeling_qwen3.__name__
