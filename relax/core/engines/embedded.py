"""The embedded engine of a run, built from its config (the rollout role, a Serve replica, a scaled-out engine)."""

from __future__ import annotations

from pathlib import Path

import torch

from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine
from relax.backends.models.family import load_model
from relax.config import RelaxConfig


def core_settings(cfg: RelaxConfig) -> CoreSettings:
    return CoreSettings(mode=cfg.engine_core, mem_fraction_static=cfg.mem_fraction_static,
                        max_total_tokens=cfg.max_total_tokens, max_prefill_tokens=cfg.max_prefill_tokens,
                        page_size=cfg.page_size, cuda_graphs=not cfg.disable_cuda_graph,
                        max_graph_batch=cfg.cuda_graph_max_bs, fp8=cfg.rollout_fp8, kv_cache_dtype=cfg.kv_cache_dtype,
                        session_idle_s=cfg.agentic_session_idle_timeout)


def build_engine(model_path: Path, tokenizer, cfg: RelaxConfig, device: torch.device, dtype: torch.dtype):
    model = load_model(model_path, dtype).to(device)
    return EmbeddedEngine(model, tokenizer, max_batch_size=cfg.rollout_max_batch_size, core=core_settings(cfg),
                          max_recoveries=cfg.rollout_engine_max_relaunches if cfg.use_fault_tolerance else 0)
