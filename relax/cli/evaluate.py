"""`relax eval`: measure a model folder or a checkpoint on held-out prompt sets, generating as training does."""

from __future__ import annotations

import asyncio
from pathlib import Path

from relax.backends.inference.embedded import EmbeddedEngine
from relax.backends.models.family import load_model
from relax.cli.args import parse_config
from relax.cli.common import quiet_libraries, setup_logging, with_model_folders
from relax.components.rollout import Rollout
from relax.config import ConfigError, flag
from relax.core.engines.embedded import core_settings
from relax.core.preflight import check_data_files, preflight
from relax.core.rollout_parts import (
    build_eval_reward_computer,
    build_generation,
    build_reward_computer,
    load_eval_sets,
    load_generate_function,
)
from relax.core.run_settings import eval_sampling, resolve_device, resolve_dtype
from relax.core.state.checkpoint import CheckpointError, load_hf_model_from_checkpoint, resolve_checkpoint_root
from relax.utils.cpu_threads import set_cpu_threads


def cmd_eval(argv: list[str]) -> int:
    """Evaluate --hf-checkpoint (a model folder) or --load (a checkpoint) on --eval-prompt-data, generating as
    training does: with the media preparer, the multi-turn environment or the custom generate function."""
    cfg = with_model_folders(parse_config(argv, prog="relax eval", inherit_from_load=True))
    setup_logging(None)
    quiet_libraries()
    import torch
    from transformers import AutoTokenizer

    if cfg.load:  # first: a --load that names nothing is the mistake, not what it would have given
        try:
            resolve_checkpoint_root(cfg.load)
        except CheckpointError as error:
            raise ConfigError(f"{flag('load')} {error}") from None
    if not cfg.eval_prompt_data:
        raise ConfigError(f"{flag('eval_prompt_data')} is required (or --load a run that has one)")
    if cfg.loss_type == "rm":
        raise ConfigError(f"relax eval evaluates a policy by generating; a {flag('loss_type')} rm run's evaluation, its "
                          "held-out pair accuracy, is in its metrics.jsonl")
    if not cfg.load:
        preflight(cfg, training=False)  # a bad path, reward or plugin fails before the model loads
    else:
        check_data_files(cfg, training=False)
        load_generate_function(cfg)
    rewards = build_reward_computer(cfg)
    eval_rewards = build_eval_reward_computer(cfg)
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    if cfg.load:
        model, model_path = load_hf_model_from_checkpoint(cfg.load, dtype=dtype)
    elif cfg.hf_checkpoint:
        model, model_path = load_model(cfg.hf_checkpoint, dtype), Path(cfg.hf_checkpoint)
    else:
        raise ConfigError(f"set {flag('hf_checkpoint')} (a model folder) or {flag('load')} (a checkpoint)")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if device.type == "cpu":
        set_cpu_threads(model.config.get_text_config().hidden_size, cfg.cpu_threads)
    # the run's engine settings (its KV pool, pages, runner, FP8): the held-out prompts were kept for that pool
    engine = EmbeddedEngine(model.to(device), tokenizer, max_batch_size=cfg.rollout_max_batch_size,
                            core=core_settings(cfg))
    rollout = Rollout(engine=engine, data_source=None, rewards=rewards, eval_rewards=eval_rewards,
                      sampling=eval_sampling(cfg),
                      n_samples_per_prompt=1, seed=cfg.rollout_seed, eval_sets=load_eval_sets(cfg, tokenizer),
                      n_samples_per_eval_prompt=cfg.n_samples_per_eval_prompt,
                      **build_generation(cfg, model_path, tokenizer))
    with torch.inference_mode():
        metrics, _ = asyncio.run(rollout.evaluate(step=0))
    for name in cfg.eval_prompt_data:
        print(eval_summary(name, metrics))
    return 0


def eval_summary(name: str, metrics: dict[str, float]) -> str:
    """One line per eval set; multi-turn sets also show the mean model turns per episode."""
    accuracy = metrics.get(f"eval/{name}/accuracy")  # none when a reward model scores the set (no --eval-rm-type)
    line = (f"{name}: {'' if accuracy is None else f'accuracy {accuracy:.4f}  '}"
            f"reward {metrics[f'eval/{name}/reward_mean']:.4f}  ({int(metrics[f'eval/{name}/num_samples'])} samples)")
    turns = metrics.get(f"eval/{name}/turns_mean")
    return line if turns is None else f"{line}  turns {turns:.2f}"
