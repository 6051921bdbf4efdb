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
from tests.conftest import tiny_train_args

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TEXT_CASES = {
    "grpo-tis": ["--use-tis"],
    "ppo": ["--advantage-estimator", "ppo", "--critic-lr", "1e-3", "--use-tis"],
    "opd-forward-kl-loss": ["--use-opd", "--teacher-hf-checkpoint", "{teacher}", "--opd-kl-type", "forward_kl",
                            "--opd-loss-coef", "0.5", "--opd-log-prob-top-k", "4", "--use-tis"],
    "opd-engine-teacher": ["--use-opd", "--teacher-hf-checkpoint", "{teacher}", "--opd-type", "engine", "--use-tis"],
    "fully-async": ["--fully-async", "--max-staleness", "1", "--use-tis"],
}


def _two_steps(cfg):
    from relax.cli.main import controller_class
    from relax.core.build import build_roles
    from relax.utils.tracking import Tracker, read_metrics

    roles = build_roles(cfg)
    assert roles.device.type == "cuda" and roles.inference_dtype == torch.bfloat16
    with Tracker(cfg.output_dir, use_tensorboard=False) as tracker:
        asyncio.run(controller_class(cfg)(cfg, roles, tracker).run())
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
    _two_steps(cfg)


@pytest.mark.parametrize("kind", ["image", "audio"])
def test_multimodal_paths_on_cuda(kind, tmp_path):
    from tests.tiny_mm_assets import build_tiny_omni, build_tiny_vl, make_audio_rows, make_image_rows

    model = build_tiny_omni(tmp_path) if kind == "audio" else build_tiny_vl(tmp_path)
    rows = make_audio_rows(tmp_path, 8) if kind == "audio" else make_image_rows(tmp_path, 8)
    cfg = parse_config([
        "--hf-checkpoint", str(model), "--prompt-data", str(rows), "--input-key", "prompt", "--label-key", "label",
        "--multimodal-keys", json.dumps({kind: kind + "s"}), "--apply-chat-template", "--device", "cuda",
        "--custom-rm-path", "tests.e2e_rewards:digit_fraction", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--rollout-max-response-len", "3", "--micro-batch-size", "8",
        "--num-rollout", "2", "--use-tis", "--dump-samples", "0", "--output-dir", str(tmp_path / "run"),
    ])
    _two_steps(cfg)


def test_fully_async_with_an_external_engine_on_cuda(tiny_workspace, tmp_path):
    """The fully-async trainer on CUDA with the rollout on a `relax serve` app: the trainer roles compute on the
    worker thread (relax.core.compute_thread), which must bind the CUDA device of the process."""
    from tests.http_servers import API_KEY, Server

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
