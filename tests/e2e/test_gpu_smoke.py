"""The training paths on CUDA (bf16 compute, fp32 master weights): two real steps each of GRPO with
TIS, PPO with its critic, on-policy distillation, a vision-language and an audio model, and the
fully-async loop. Skipped without a CUDA device; run on the GPU machine with `pytest -m gpu`."""

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch

from relax.cli.args import parse_config
from tests.support.runs import tiny_train_args

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TEXT_CASES = {
    "grpo-tis": ["--use-tis"],
    "ppo": ["--advantage-estimator", "ppo", "--critic-lr", "1e-3", "--use-tis"],
    "opd-forward-kl-loss": ["--use-opd", "--teacher-hf-checkpoint", "{teacher}", "--opd-kl-type", "forward_kl",
                            "--opd-loss-coef", "0.5", "--opd-log-prob-top-k", "4", "--use-tis"],
    "opd-engine-teacher": ["--use-opd", "--teacher-hf-checkpoint", "{teacher}", "--opd-type", "engine", "--use-tis"],
    "fully-async": ["--fully-async", "--max-staleness", "1", "--use-tis"],
    # the trainer on its own thread and CUDA stream beside the embedded engine
    "colocate-async": ["--colocate-async", "--use-tis"],
    # the reference and the advantages as streaming roles, groups reported by the engine core as they finish
    "fully-async-streaming-kl": ["--fully-async", "--max-staleness", "1", "--use-tis", "--use-kl-loss",
                                 "--kl-loss-coef", "0.01"],
}


def _two_steps(cfg):
    from relax.core.build import build_roles
    from relax.core.loops import loop_class
    from relax.core.placement.in_process import InProcessPlacement
    from relax.telemetry.metrics_file import read_metrics
    from relax.telemetry.tracking import Tracker

    roles = build_roles(cfg)
    assert roles.device.type == "cuda" and roles.inference_dtype == torch.bfloat16
    with Tracker(cfg.output_dir, use_tensorboard=False) as tracker:
        asyncio.run(loop_class(cfg)(cfg, InProcessPlacement(cfg, roles), tracker).run())
    rows = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
    trained = [row for row in rows if "train/loss" in row]
    assert len(trained) == 2
    for row in trained:
        assert all(v is not None and math.isfinite(v) for k, v in row.items() if k.startswith(("train/", "critic/")))
        # bf16 engine against the trainer's bf16 forward: the same distribution up to rounding
        assert abs(row["train/tis_mismatch_kl"]) < 0.05, row["train/tis_mismatch_kl"]
    return rows


@pytest.mark.parametrize("name", sorted(TEXT_CASES))
def test_text_paths_on_cuda(name, tiny_workspace, tmp_path):
    extra = [a.format(teacher=tiny_workspace / "model") for a in TEXT_CASES[name]]
    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, "--num-rollout", "2", "--device", "cuda",
                                       "--skip-eval-before-train", "--dump-samples", "0", *extra))
    rows = _two_steps(cfg)
    if name == "fully-async-streaming-kl":  # every trained sample carried the streamed fields
        assert all(row["data/streamed_fields_fraction"] == 1.0 for row in rows if "train/loss" in row)
        assert abs(next(row for row in rows if "train/loss" in row)["train/kl_loss"]) < 1e-3  # step 1: policy = ref


@pytest.mark.parametrize("kind", ["image", "audio"])
def test_multimodal_paths_on_cuda(kind, tmp_path):
    from tests.support.tiny_mm_assets import build_tiny_omni, build_tiny_vl, make_audio_rows, make_image_rows

    model = build_tiny_omni(tmp_path) if kind == "audio" else build_tiny_vl(tmp_path)
    rows = make_audio_rows(tmp_path, 8) if kind == "audio" else make_image_rows(tmp_path, 8)
    cfg = parse_config([
        "--hf-checkpoint", str(model), "--prompt-data", str(rows), "--input-key", "prompt", "--label-key", "label",
        "--multimodal-keys", json.dumps({kind: kind + "s"}), "--apply-chat-template", "--device", "cuda",
        "--custom-rm-path", "tests.support.e2e_rewards:digit_fraction", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--rollout-max-response-len", "3", "--micro-batch-size", "8",
        "--num-rollout", "2", "--use-tis", "--dump-samples", "0", "--output-dir", str(tmp_path / "run"),
    ])
    _two_steps(cfg)


def test_fully_async_with_an_external_engine_on_cuda(tiny_workspace, tmp_path):
    """The fully-async trainer on CUDA with the rollout on a `relax serve` app: the trainer roles compute on the
    worker thread (relax.core.placement.compute_thread), which must bind the CUDA device of the process."""
    from tests.support.http_servers import API_KEY, Server

    server = Server(tiny_workspace / "model")
    try:
        cfg = parse_config(tiny_train_args(
            tiny_workspace, tmp_path, "--num-rollout", "2", "--device", "cuda", "--skip-eval-before-train",
            "--dump-samples", "0", "--use-tis", "--fully-async", "--max-staleness", "1", "--rollout-external",
            "--rollout-external-engine-addrs", server.url, "--rollout-engine-api-key", API_KEY,
            "--rollout-weights-dir", str(tmp_path / "weights")))
        _two_steps(cfg)
        assert server.health()["weight_version"] == 2
    finally:
        server.stop()


def test_flash_varlen_attention_matches_per_sequence_sdpa_on_cuda():
    """The packed trainer's attention on CUDA (FlashAttention varlen, GQA) against float32 SDPA run sequence by
    sequence: outputs and gradients."""
    from relax.backends.training import varlen_attention

    torch.manual_seed(0)
    lengths = [5, 130, 1, 64, 257]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packing = varlen_attention.PackedAttention.of(cu, max(lengths), torch.device("cuda"))
    inputs = [torch.randn(1, heads, sum(lengths), 64, device="cuda", dtype=torch.bfloat16) for heads in (8, 2, 2)]
    flash_inputs = [t.clone().requires_grad_() for t in inputs]
    reference_inputs = [t.float().requires_grad_() for t in inputs]
    flash, _ = varlen_attention.packed_attention_forward(torch.nn.Module().eval(), *flash_inputs, None,
                                                         relax_packed=packing)
    reference = varlen_attention._per_sequence_attend(
        *(t[0].transpose(0, 1) for t in reference_inputs), packing, 64 ** -0.5, 0.0).unsqueeze(0)
    torch.testing.assert_close(flash.float(), reference, atol=2e-2, rtol=2e-2)
    upstream = torch.randn_like(reference)
    (flash.float() * upstream).sum().backward()
    (reference * upstream).sum().backward()
    for fast, exact in zip(flash_inputs, reference_inputs):
        torch.testing.assert_close(fast.grad.float(), exact.grad, atol=5e-2, rtol=5e-2)
    # the keys and values repeated to the query heads first (the path before) give the same outputs and gradients
    repeated_inputs = [t.clone().requires_grad_() for t in inputs]
    repeated, _ = varlen_attention.packed_attention_forward(
        torch.nn.Module().eval(), *repeated_inputs, None,
        relax_packed=varlen_attention.PackedAttention.of(cu, max(lengths), torch.device("cuda"), repeat_kv=True))
    torch.testing.assert_close(repeated, flash, atol=1e-2, rtol=1e-2)
    (repeated.float() * upstream).sum().backward()
    for grouped, previous in zip(flash_inputs, repeated_inputs):
        torch.testing.assert_close(grouped.grad, previous.grad, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows, width", [(4099, 1024), (40000, 128), (1, 64)])
def test_the_compiled_rms_norm_matches_the_float32_reference_on_cuda(rows, width):
    """`compiled_norm.compiled_rms_norm` (Inductor), forward and backward, against the same math in float32, on the
    trainer's input dtype (bf16 rows, a float32 weight); liger's kernel it replaced within the same bounds for the
    output and the input gradient (its weight gradient sums bf16-rounded products and misses the float32 sum by
    more than the compiled one, which is held to 1% of the largest entry)."""
    from liger_kernel.transformers.functional import liger_rms_norm

    from relax.backends.training.compiled_norm import compiled_rms_norm, rms_norm_reference

    torch._dynamo.reset()  # past dynamo's recompile limit (the suite's other models' widths) the call runs eagerly
    torch.manual_seed(0)
    x = torch.randn(1, rows, width, device="cuda", dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(width, device="cuda")
    dy = torch.randn_like(x)
    xr, wr = x.float().requires_grad_(), w.clone().requires_grad_()
    reference = rms_norm_reference(xr, wr, 1e-6)
    reference.backward(dy.float())
    for name, fn in (("compiled", compiled_rms_norm),
                     ("liger", lambda a, b, eps: liger_rms_norm(a, b, eps, 0.0, "llama", False))):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, 1e-6)
        y.backward(dy)
        assert y.dtype == torch.bfloat16 and wi.grad.dtype == torch.float32, name
        torch.testing.assert_close(y.float(), reference, atol=3e-2, rtol=1e-2, msg=name)
        torch.testing.assert_close(xi.grad.float(), xr.grad, atol=5e-2, rtol=2e-2, msg=name)
        if name == "compiled":  # a sum over the rows: its error grows with them, measured against the largest entry
            assert (wi.grad - wr.grad).abs().max() <= 1e-2 * wr.grad.abs().max(), name


@pytest.mark.parametrize("tokens", [4099, 1])
def test_the_fused_qk_norm_rope_is_as_exact_as_the_separate_kernels_on_cuda(tokens):
    """`fused_qk_rope.fused_qk_norm_rope` (`triton_qk_rope`'s kernels) on the 0.6B shape's heads against the path
    before it (the compiled per-head norms, then liger's RoPE) and both against the same math in float32: outputs,
    input and weight gradients no further from float32 than the separate kernels' (plus a rounding's slack)."""
    from benchmarks.train_kernels_gpu import qk_outputs_and_grads, qk_rope_inputs, separate_qk_norm_rope
    from relax.backends.training.fused_qk_rope import fused_qk_norm_rope, qk_norm_rope_reference

    torch._dynamo.reset()
    q, k, weights, cos, sin, dq, dk = qk_rope_inputs(tokens, 16, 8, 128, base=10000.0)

    def run(fn, *inputs):
        return qk_outputs_and_grads(fn, inputs, cos, sin, dq, dk)

    reference = run(qk_norm_rope_reference, q.float(), k.float(), *weights)
    fused, before = run(fused_qk_norm_rope, q, k, *weights), run(separate_qk_norm_rope, q, k, *weights)
    for name, want, got, old in zip(("q", "k", "dq", "dk", "dq_weight", "dk_weight"), reference, fused, before):
        scale = want.abs().max()
        assert (got - want).abs().max() <= (old - want).abs().max() + 1e-2 * scale, name


@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp2"])
def test_offloaded_trainer_frees_the_device_and_comes_back_bit_for_bit(tiny_workspace, fsdp):
    """`--offload-train` on CUDA: after a step the weights and AdamW state go to pinned host memory (the device
    keeps nothing of them), and the next call brings back exactly what left."""
    from dataclasses import replace

    from torch.distributed.tensor import DTensor

    from relax.backends.training.fsdp import FSDPTrainBackend
    from tests.backends.training.test_fsdp_backend import LOSS, make_backend, make_batch

    device = torch.device("cuda", 0)
    settings = replace(make_backend(tiny_workspace / "model").settings, device=device, compute_dtype=torch.bfloat16,
                       fsdp_single_process=fsdp)
    backend = FSDPTrainBackend(tiny_workspace / "model", settings)
    assert backend.fsdp == fsdp
    backend.train_step(make_batch(seed=0), LOSS)

    def local(tensor):  # under FSDP2 parameters and their AdamW state are DTensors
        return tensor._local_tensor if isinstance(tensor, DTensor) else tensor

    def snapshot():
        params = {n: local(p).detach().clone().cpu() for n, p in backend.model.named_parameters()}
        optim = [{k: local(v).clone().cpu() if torch.is_tensor(v) else v for k, v in state.items()}
                 for state in backend.optimizer.state.values()]
        return params, optim

    params, optim = snapshot()
    before = torch.cuda.memory_allocated(device)
    backend.offload()
    assert backend.offloaded
    assert all(local(p).device.type == "cpu" and local(p).is_pinned() for p in backend.model.parameters())
    assert all(local(v).is_pinned() for state in backend.optimizer.state.values() for v in state.values()
               if torch.is_tensor(v) and local(v).device.type == "cpu" and local(v).numel() > 1)
    freed = before - torch.cuda.memory_allocated(device)
    assert freed >= 0.95 * sum(t.numel() * t.element_size() for t in (*params.values(), *(
        v for state in optim for v in state.values() if torch.is_tensor(v) and v.numel() > 1))), freed
    backend.reload()
    assert all(local(p).device == device for p in backend.model.parameters())
    params_after, optim_after = snapshot()
    for name, value in params.items():
        assert torch.equal(params_after[name], value), name
    for state, state_after in zip(optim, optim_after):
        for key, value in state.items():
            assert torch.equal(state_after[key], value) if torch.is_tensor(value) else state_after[key] == value
    backend.offload()
    metrics = backend.train_step(make_batch(seed=1), LOSS)  # reloads on its own
    assert not backend.offloaded and math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])


def test_colocated_grpo_with_offload_on_cuda(tiny_workspace, tmp_path):
    """`--colocate` on CUDA moves both phases' memory: the engine's KV pool, CUDA graphs and weights while
    training, the trainer while rolling out; per-phase peaks are logged."""
    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, "--num-rollout", "2", "--device", "cuda",
                                       "--skip-eval-before-train", "--dump-samples", "0", "--use-tis",
                                       "--colocate", "--engine-core", "on"))
    rows = _two_steps(cfg)
    for row in (r for r in rows if "train/loss" in r):
        for key in ("perf/gpu_peak_gib_rollout", "perf/gpu_peak_gib_train", "perf/gpu_allocated_gib",
                    "perf/offload_s"):
            assert key in row and row[key] >= 0, key


def test_liger_kernels_fusion_and_bf16_parameters_agree_with_the_autocast_path(tiny_workspace):
    """Gradient-accumulation fusion, liger-kernel's RMSNorm, SwiGLU and RoPE with it, and both with FSDP2's bf16
    parameters at one process, against the stock modules under plain autocast: the same log-probs, loss and
    gradient norm up to bf16 rounding; the kernels go on the trainer's instances only."""
    from dataclasses import replace

    from transformers.models.qwen3 import modeling_qwen3

    from relax.backends.training.fsdp import FSDPTrainBackend
    from relax.backends.training.liger import liger_unavailable_reason
    from tests.backends.training.test_fsdp_backend import LOSS, make_backend, make_batch

    device = torch.device("cuda", 0)
    if liger_unavailable_reason(device):
        pytest.skip(liger_unavailable_reason(device))
    base = replace(make_backend(tiny_workspace / "model").settings, device=device, compute_dtype=torch.bfloat16,
                   max_tokens_per_gpu=64, liger_kernel=False, gradient_accumulation_fusion=False,
                   activations_in_compute_dtype=False, attention_repeat_kv=True)
    results = {}
    fused = replace(base, gradient_accumulation_fusion=True)
    # "liger": liger's RMSNorm too (the kernels before); "kernels": today's defaults (compiled RMSNorms, grouped
    # keys/values read by the attention kernel, the residual stream in bf16)
    kernels = replace(fused, liger_kernel=True, rms_norm_kernel="compiled", attention_repeat_kv=False,
                      activations_in_compute_dtype=True)
    for name, settings in (("previous", base), ("fusion", fused),
                           ("liger", replace(fused, liger_kernel=True, rms_norm_kernel="liger")),
                           ("kernels", kernels), ("fsdp-liger", replace(fused, liger_kernel=True, fsdp_single_process=True))):
        backend = FSDPTrainBackend(tiny_workspace / "model", settings)
        assert backend.fsdp == name.startswith("fsdp")
        assert (backend._weight_casts is not None) == (name in ("fusion", "liger", "kernels"))
        log_probs = backend.compute_log_probs(make_batch()).log_probs
        metrics = backend.train_step(make_batch(), LOSS)
        results[name] = (log_probs, metrics)
    previous_lp, previous = results.pop("previous")
    for name, (log_probs, metrics) in results.items():
        for a, b in zip(log_probs, previous_lp):
            torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2, msg=name)
        assert metrics["loss"] == pytest.approx(previous["loss"], rel=2e-2, abs=2e-3), name
        assert metrics["grad_norm"] == pytest.approx(previous["grad_norm"], rel=5e-2), name
    assert modeling_qwen3.Qwen3RMSNorm.forward.__module__ == modeling_qwen3.__name__  # the classes are untouched


def test_fused_gradient_accumulation_is_the_float32_sum_on_cuda():
    """cuBLAS's bf16 GEMM with a float32 output added in place into ``.grad`` (`accumulate_grad`), first into
    no gradient, then into the one there: the float32 sum of the products, as the CPU fallback computes it."""
    from relax.backends.training.master_weights import accumulate_grad

    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    param = torch.nn.Parameter(torch.zeros(384, 200, device=device))
    pairs = [(torch.randn(384, 1000, device=device).bfloat16(), torch.randn(1000, 200, device=device).bfloat16())
             for _ in range(3)]
    for a, b in pairs:
        accumulate_grad(param, a, b)
    exact = sum(a.double() @ b.double() for a, b in pairs)
    assert param.grad.dtype == torch.float32
    torch.testing.assert_close(param.grad.double(), exact, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("temperature, entropy_grad, extra_ids", [(1.0, False, 0), (0.7, True, 2)])
def test_the_triton_head_kernels_match_the_torch_path(monkeypatch, temperature, entropy_grad, extra_ids):
    """`triton_head`'s one-pass log-sum-exp/entropy and logit gradient against the torch chunk path on the same
    bf16 head: log-probs, entropy and the gradients of hidden states and head weight."""
    from relax.backends.training import log_probs as head

    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    tokens, width, vocab = 700, 256, 50_000
    hidden = (torch.randn(tokens, width, device=device) * 0.5).to(torch.bfloat16)
    weight = (torch.randn(vocab, width, device=device) * 0.05).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (tokens, 1 + extra_ids), device=device)
    suppressed = torch.tensor([3, 17, vocab - 1], device=device)
    grad_lp = torch.randn(tokens, 1 + extra_ids, device=device)
    grad_ent = torch.randn(tokens, device=device)
    results = {}
    for fused in (False, True):
        monkeypatch.setattr(head, "_fused_head_available", lambda tensor, fused=fused: fused)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = head.token_log_probs(h, w, ids, temperature=temperature, suppressed_ids=suppressed, chunk_size=256,
                                   entropy=True, entropy_grad=entropy_grad)
        loss = (out.log_probs * grad_lp).sum() + ((out.entropy * grad_ent).sum() if entropy_grad else 0.0)
        loss.backward()
        results[fused] = (out.log_probs.detach(), out.entropy.detach(), h.grad.float(), w.grad.float())
    for name, torch_value, fused_value in zip(("log_probs", "entropy", "grad_hidden", "grad_weight"),
                                              results[False], results[True]):
        error = (fused_value - torch_value).norm() / torch_value.norm()
        assert error < 1e-2, (name, error)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_kept_logits_give_the_triton_heads_gradients_bit_for_bit_without_a_second_head_matmul(monkeypatch,
                                                                                             entropy_grad):
    """``keep_logits`` on the fused path: the backward writes the logit gradient over the forward's bf16 logits
    instead of computing them again (no `_raw_logits` call in it), and the outputs and gradients are the recomputing
    path's bit for bit (the same GEMM gave the same logits); a second backward through the graph recomputes them."""
    from relax.backends.training import log_probs as head

    torch.manual_seed(1)
    device = torch.device("cuda", 0)
    tokens, width, vocab = 900, 256, 50_000
    hidden = (torch.randn(tokens, width, device=device) * 0.5).to(torch.bfloat16)
    weight = (torch.randn(vocab, width, device=device) * 0.05).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (tokens, 1), device=device)
    grad_lp, grad_ent = torch.randn(tokens, 1, device=device), torch.randn(tokens, device=device)
    calls = []
    raw = head._raw_logits
    monkeypatch.setattr(head, "_raw_logits", lambda *a, **k: calls.append(1) or raw(*a, **k))
    results = {}
    for keep in (False, True):
        calls.clear()
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = head.token_log_probs(h, w, ids, chunk_size=256, entropy_grad=entropy_grad, keep_logits=keep)
        forward_calls = len(calls)
        loss = (out.log_probs * grad_lp).sum() + ((out.entropy * grad_ent).sum() if entropy_grad else 0.0)
        loss.backward(retain_graph=True)
        assert len(calls) - forward_calls == (0 if keep else forward_calls)
        results[keep] = (out.log_probs, out.entropy, h.grad.clone(), w.grad.clone())
        # a second backward through the same graph: the first wrote the gradient over the kept logits, so this
        # one recomputes them and gives the first's gradients again
        h.grad, w.grad = None, None
        loss.backward()
        assert torch.equal(h.grad, results[keep][2]) and torch.equal(w.grad, results[keep][3])
    for recomputed, kept in zip(results[False], results[True]):
        assert torch.equal(recomputed, kept)


def test_the_micro_batch_loop_never_waits_for_the_device(tiny_workspace):
    """Forward, loss and backward of every micro-batch queue behind each other with no host synchronization
    (torch's sync debug mode raises on one): inputs go through pinned memory, lengths stay on the host."""
    from dataclasses import replace

    from relax.backends.training.fsdp import FSDPTrainBackend
    from tests.backends.training.test_fsdp_backend import LOSS, make_backend, make_batch

    device = torch.device("cuda", 0)
    settings = replace(make_backend(tiny_workspace / "model").settings, device=device, compute_dtype=torch.bfloat16,
                       max_tokens_per_gpu=64)
    backend = FSDPTrainBackend(tiny_workspace / "model", settings)
    backend.train_step(make_batch(), LOSS)  # warm-up: lazy initialisation may synchronize once
    accumulate = backend._accumulate_gradients

    def strict(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return accumulate(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    backend._accumulate_gradients = strict
    metrics = backend.train_step(make_batch(), LOSS)
    assert math.isfinite(metrics["loss"])
