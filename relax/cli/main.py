"""`relax` command: train, eval, export, serve, scale, health, config-docs, model-docs."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import faulthandler
import io
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from relax.utils.notify import Notifier, split_urls

USAGE = """usage: relax <command> [options]   (relax --version prints the version)

commands:
  train        train a model with RL (relax train --help lists every setting)
  eval         measure a model or checkpoint on held-out prompt sets
  export       turn a checkpoint into a Hugging Face model folder
  serve        serve a model over HTTP (SGLang native and OpenAI protocols)
  scale        add or remove rollout engines of a running training (its --rollout-api-port)
  health       show a run's health state: each role's heartbeat and errors (--use-health-check)
  config-docs  print the configuration reference (docs/config.md)
  model-docs   print the supported-model table (docs/models.md)
"""


def _quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def setup_logging(run_dir: Path | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(run_dir / "run.log"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=handlers, force=True)
    # The console shows warnings and the progress bar; run.log keeps the per-step lines.
    handlers[0].setLevel(logging.WARNING)
    # httpx logs every request's URL at INFO, and a URL may hold a token (--rm-url): warnings only.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def resolved_config_text(cfg) -> str:
    """config.yaml: every setting, so that `relax train --config` re-runs it; a secret that was set is left out (and
    said so in a comment), never written."""
    settings, set_secrets = cfg.shareable_settings()
    notes = "".join(f"# {name}: set for this run, not saved (give {flag_of(name)} again)\n" for name in set_secrets)
    return notes + yaml.safe_dump(settings, sort_keys=False)


def flag_of(name: str) -> str:
    from relax.config import flag

    return flag(name)


def cmd_train(argv: list[str]) -> int:
    from relax.cli.args import parse_config
    from relax.config import ConfigError

    cfg = parse_config(argv, prog="relax train")
    run_dir = Path(cfg.output_dir)
    primary = int(os.environ.get("RANK", "0")) == 0  # under torchrun, rank 0 writes the run directory
    _quiet_libraries()
    from relax.core.build import preflight
    from relax.core.run_dir import prepare_run_dir

    preflight(cfg)  # settings that fail without loading anything fail here, before a run directory exists
    from relax.cli.supervisor import SUPERVISED_ENV, supervise

    if cfg.max_global_restart and not os.environ.get(SUPERVISED_ENV):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(f"{flag_of('max_global_restart')} supervises one process; under torchrun use its own "
                              "--max-restarts")
        return supervise(argv, cfg, build_notifier(cfg))
    created = prepare_run_dir(cfg) if primary else False
    setup_logging(run_dir if primary else None)
    config_text = resolved_config_text(cfg)
    if primary:
        (run_dir / "config.yaml").write_text(config_text)
    notifier = build_notifier(cfg) if primary else Notifier([])
    try:
        return _train(cfg, run_dir, primary, created, config_text, notifier)
    except BaseException as err:
        if not isinstance(err, KeyboardInterrupt):
            notifier.failed(str(run_dir), _cause_first(err))
        raise


def start_metrics_service(cfg, roles):
    """--use-metrics-service: the Prometheus endpoint, with the engines' health when a router fronts them."""
    if not cfg.use_metrics_service:
        return None
    from relax.cli.supervisor import RESTARTS_ENV
    from relax.config import ConfigError, flag
    from relax.utils.metrics_service import MetricsService

    try:
        return MetricsService(cfg.metrics_service_port, restarts=int(os.environ.get(RESTARTS_ENV, "0")),
                              engine_stats=engine_stats_of(roles)).start()
    except OSError as err:
        raise ConfigError(f"{flag('metrics_service_port')} {cfg.metrics_service_port}: cannot listen on "
                          f"127.0.0.1 ({err.strerror or err})") from None


def engine_stats_of(roles):
    """The router's per-engine state (`EngineRouter.stats`) when the rollout's engines are in this process."""
    stats = getattr(getattr(roles.rollout, "engine", None), "stats", None)
    return stats if callable(stats) else None


def start_health_monitor(cfg, run_dir: Path, service, controller, notifier):
    """--use-health-check: heartbeats of the Ray roles, TransferQueue's actors, the controller's phase."""
    from relax.cli.supervisor import RESTARTS_ENV
    from relax.core.health import HealthMonitor

    roles = list(service.workers) if service is not None else []
    actors = service.transfer_queue_actors() if service is not None else {}
    return HealthMonitor(run_dir, roles, cfg.heartbeat_timeout_s, actors=actors, phase_of=controller.phases.current,
                         notifier=notifier, restarts=int(os.environ.get(RESTARTS_ENV, "0")),
                         engine_stats=engine_stats_of(controller.roles)).start()


def build_notifier(cfg) -> Notifier:
    secrets = [getattr(cfg, name) for name in cfg.secret_fields() if isinstance(getattr(cfg, name), str)]
    return Notifier(split_urls(cfg.notify_urls), secrets, run_name=Path(cfg.output_dir).name)


def _train(cfg, run_dir: Path, primary: bool, created: bool, config_text: str, notifier: Notifier) -> int:
    from relax.core.build import build_roles
    from relax.core.run_dir import remove_if_unused
    from relax.utils.tracking import NullTracker, Tracker

    service = None
    try:
        if cfg.placement == "ray":
            from relax.core.service import RayService

            service = RayService(cfg)
            roles = service.start()
        else:
            roles = build_roles(cfg)
    except BaseException:
        if service is not None:
            service.shutdown()
        if primary:
            remove_if_unused(run_dir, created)  # a start that failed leaves nothing behind
        raise
    if primary:
        print(f"resolved config ({run_dir / 'config.yaml'}):\n{config_text}", file=sys.stderr)
    notifier.started(str(run_dir), roles.total_steps, resumed=bool(cfg.load))
    monitor = None
    try:
        metrics_service = start_metrics_service(cfg, roles) if primary else None
        tracker = Tracker(run_dir, use_tensorboard=cfg.use_tensorboard, use_wandb=cfg.use_wandb,
                          wandb_project=cfg.wandb_project, config=cfg.shareable_settings()[0],
                          clearml_project=cfg.clearml_project if cfg.use_clearml else None,
                          metrics_service=metrics_service) if primary else NullTracker()
        with tracker:
            controller = controller_class(cfg)(cfg, roles, tracker)
            controller.phases.notifier = notifier  # stall reports reach --notify-urls too
            if cfg.use_health_check and primary:
                monitor = start_health_monitor(cfg, run_dir, service, controller, notifier)
                if metrics_service is not None:
                    metrics_service.role_health = monitor.snapshot
            with controller.graceful_stop.installed():
                training = _run_with_scaling_api(controller, cfg, roles)
                last = asyncio.run(monitor.guard(training) if monitor is not None else training)
    finally:
        if monitor is not None:
            monitor.detach_actors()
        if service is not None:
            service.shutdown()
        else:
            close_engines(roles)
        if monitor is not None:  # after the teardown: until then a fatal verdict still bounds it (FATAL_GRACE_S)
            monitor.stop()
    stop = controller.graceful_stop
    if stop.stopped_after_step is not None:
        notifier.stopped(str(run_dir), stop.stopped_after_step, signal.Signals(stop.signal_number).name)
        if primary:
            print(f"stopped by {signal.Signals(stop.signal_number).name} after step {stop.stopped_after_step}, "
                  f"checkpoint saved; continue with the same command plus --load {cfg.save_dir}", file=sys.stderr)
        return stop.exit_code
    if not primary:
        return 0
    notifier.finished(str(run_dir), roles.total_steps, last)
    first = _first_eval_accuracy(run_dir)
    if "eval/accuracy" in last and first is not None:
        print(f"held-out accuracy: {first:.3f} before training -> {last['eval/accuracy']:.3f} after "
              f"({100 * (last['eval/accuracy'] - first):+.1f} points)")
    written = [name for name in ("metrics.jsonl", "plots/", "tensorboard/", "samples/")
               if (run_dir / name.rstrip("/")).exists()]
    print(f"run directory: {run_dir} ({', '.join(written)})")
    print(f"final checkpoint: {controller.last_checkpoint} (relax export {run_dir} OUT_DIR writes a Hugging Face "
          "folder)")
    return _reward_failures_verdict(run_dir)


def _reward_failures_verdict(run_dir: Path) -> int:
    """A run whose reward failed says so at its end (each failure scored 0, so the run learned nothing from those
    samples): a warning when some rewards failed, exit 1 when every one did (the reward is broken, not the model)."""
    from relax.utils.tracking import read_metrics

    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "rollout/num_samples" in row]
    failed = sum(int(row.get("reward/num_errors", 0)) for row in rows)
    scored = sum(int(row["rollout/num_samples"]) for row in rows)
    if not failed:
        return 0
    where = f"see {run_dir / 'run.log'} for each distinct error"
    if failed >= scored:
        print(f"relax train: error: the reward failed on every sample ({failed} of {scored}), each scored 0: the run "
              f"learned nothing from its rewards; {where}", file=sys.stderr)
        return 1
    print(f"relax train: warning: the reward failed on {failed} of {scored} samples (each scored 0); {where}",
          file=sys.stderr)
    return 0


def close_engines(roles) -> None:
    """End what the in-process rollout's engines started (a Serve deployment and its Ray, HTTP clients)."""
    close = getattr(getattr(roles.rollout, "engine", None), "aclose", None)
    if close is not None:
        try:
            asyncio.run(close())
        except Exception as error:  # noqa: BLE001 - the run's result stands; say what was left behind
            logging.getLogger("relax").warning("closing the rollout engines failed: %s", error)


async def _run_with_scaling_api(controller, cfg, roles):
    """The training loop, with the engines' scaling API served beside it when --rollout-api-port is set."""
    from relax.core.scaling_service import scaling_api

    async with scaling_api(cfg, roles):
        return await controller.run()


def controller_class(cfg):
    """The training loop of the configured mode."""
    from relax.core.async_controller import AsyncController
    from relax.core.controller import SFTController, SyncController

    if cfg.loss_type == "sft":
        return SFTController
    if cfg.placement == "ray":  # roles in Ray processes (relax.core.service)
        from relax.core.ray_controller import RayAsyncController, RaySyncController

        return RayAsyncController if cfg.fully_async or cfg.hybrid else RaySyncController
    return AsyncController if cfg.fully_async or cfg.hybrid else SyncController


def _first_eval_accuracy(run_dir: Path) -> float | None:
    from relax.utils.tracking import read_metrics

    for row in read_metrics(run_dir / "metrics.jsonl"):
        if row.get("eval/accuracy") is not None:
            return row["eval/accuracy"]
    return None


def cmd_eval(argv: list[str]) -> int:
    """Evaluate --hf-checkpoint (a model folder) or --load (a checkpoint) on --eval-prompt-data, generating as
    training does: with the media preparer, the multi-turn environment or the custom generate function."""
    from relax.cli.args import parse_config
    from relax.config import ConfigError, flag

    cfg = parse_config(argv, prog="relax eval", inherit_from_load=True)
    setup_logging(None)
    _quiet_libraries()
    import torch
    from transformers import AutoTokenizer

    from relax.backends.inference.embedded import EmbeddedEngine
    from relax.backends.model_family import load_model
    from relax.components.rollout import Rollout
    from relax.core.build import (
        build_generation,
        build_reward_computer,
        check_data_files,
        eval_sampling,
        load_eval_sets,
        load_generate_function,
        preflight,
        resolve_device,
        resolve_dtype,
    )
    from relax.core.checkpoint import CheckpointError, load_hf_model_from_checkpoint, resolve_checkpoint_root

    if cfg.load:  # first: a --load that names nothing is the mistake, not what it would have given
        try:
            resolve_checkpoint_root(cfg.load)
        except CheckpointError as error:
            raise ConfigError(f"{flag('load')} {error}") from None
    if not cfg.eval_prompt_data:
        raise ConfigError(f"{flag('eval_prompt_data')} is required (or --load a run that has one)")
    if not cfg.load:
        preflight(cfg, training=False)  # a bad path, reward or plugin fails before the model loads
    else:
        check_data_files(cfg, training=False)
        load_generate_function(cfg)
    rewards = build_reward_computer(cfg)
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
        from relax.utils.cpu_threads import set_cpu_threads

        set_cpu_threads(model.config.get_text_config().hidden_size, cfg.cpu_threads)
    engine = EmbeddedEngine(model.to(device), tokenizer, max_batch_size=cfg.rollout_max_batch_size)
    rollout = Rollout(engine=engine, data_source=None, rewards=rewards, sampling=eval_sampling(cfg),
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
    line = (f"{name}: accuracy {metrics[f'eval/{name}/accuracy']:.4f}  reward {metrics[f'eval/{name}/reward_mean']:.4f}  "
            f"({int(metrics[f'eval/{name}/num_samples'])} samples)")
    turns = metrics.get(f"eval/{name}/turns_mean")
    return line if turns is None else f"{line}  turns {turns:.2f}"


def cmd_export(argv: list[str]) -> int:
    from relax.cli.args import CommandLineParser

    parser = CommandLineParser(prog="relax export", description="Write a checkpoint as a Hugging Face folder.")
    parser.add_argument("checkpoint", help="checkpoint directory or run directory")
    parser.add_argument("output", help="folder to write (config, safetensors weights, tokenizer)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run's adapters as a peft folder (PeftModel.from_pretrained loads it on the base "
                        "model) instead of the merged model")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the output folder when it exists and is not empty (refused otherwise)")
    args = parser.parse_args(argv)
    _quiet_libraries()
    import shutil

    import torch
    from transformers import AutoTokenizer

    from relax.backends.training import lora
    from relax.config import ConfigError
    from relax.core.checkpoint import (
        PROCESSOR_FILES,
        CheckpointError,
        load_hf_model_from_checkpoint,
        resolve_checkpoint_root,
    )

    output = Path(args.output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not args.overwrite:
        raise ConfigError(f"{output} exists{' and is not empty' if output.is_dir() else ''}; choose another folder "
                          "or replace it with --overwrite")
    try:
        adapters = lora.read_metadata(resolve_checkpoint_root(args.checkpoint))
    except lora.BaseModelChangedError as error:
        raise CheckpointError(str(error)) from None
    if args.adapter and adapters is None:
        raise CheckpointError(f"--adapter: {args.checkpoint} is not a LoRA run's checkpoint (no {lora.METADATA_FILE})")
    model, hf_dir = load_hf_model_from_checkpoint(args.checkpoint, args.step, dtype=getattr(torch, args.dtype),
                                                  merge_adapters=not args.adapter)
    # Written beside the output and renamed into place: a failed export leaves the old folder (or none).
    staging = output.with_name(f".{output.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    if args.adapter:
        lora.save_adapter_folder(model, adapters[0], adapters[1], staging)
    else:
        model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(staging)
    for name in PROCESSOR_FILES:  # a vision-language model's processor: AutoProcessor loads the export
        if (hf_dir / name).is_file() and not (staging / name).exists():
            shutil.copyfile(hf_dir / name, staging / name)
    if output.is_dir():
        shutil.rmtree(output)
    elif output.exists():
        output.unlink()
    os.replace(staging, output)
    print(f"exported {'the LoRA adapters' if args.adapter else 'the model'} to {output}")
    return 0


def cmd_serve(argv: list[str]) -> int:
    # torch's C++ logger writes c10d errors (a failed /init_weights_update_group) with their C++ stack frames to
    # stderr; the error reaches the client and the log as one line anyway. Read once, when torch loads: set first.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    from relax.serving.limits import GenerationLimits
    from relax.utils.http_server import HTTPLimits

    http, work = HTTPLimits(), GenerationLimits()
    from relax.cli.args import CommandLineParser

    parser = CommandLineParser(
        prog="relax serve", description="Serve a model folder with the embedded engine over HTTP: SGLang's native "
        "protocol (/generate, /update_weights_from_disk, ...) and the OpenAI protocol (/v1/...). See docs/serving.md.")
    parser.add_argument("--hf-checkpoint", required=True, help="Hugging Face model folder (config, weights, tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=_port, default=30000, help="port to listen on (1-65535)")
    parser.add_argument("--api-key", default=None,
                        help="bearer token required by the control endpoints (default: $RELAX_API_KEY; none: open)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--cpu-threads", type=int, default=0,
                        help="threads torch computes with on CPU (0: measured at start, as relax train does)")
    parser.add_argument("--served-model-name", default=None, help="model id of /v1/models (default: the folder name)")
    parser.add_argument("--max-batch-size", type=_positive(int), default=256,
                        help="most sequences decoded together (one decode step's rows; the rest wait their turn)")
    parser.add_argument("--batch-window-ms", type=float, default=5.0,
                        help="how long the first waiting request collects others into one engine batch")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--engine-core", default="auto", choices=["auto", "on", "off"],
                        help="the engine core (continuous batching, paged KV, CUDA graphs): auto = on CUDA for the "
                        "models it supports; on = on CPU too; off = the Hugging Face decode loop")
    parser.add_argument("--mem-fraction-static", type=float, default=0.85,
                        help="on CUDA, the share of the free device memory (after the weights) the KV pool takes")
    parser.add_argument("--weight-update-root", default=None,
                        help="/update_weights_from_disk loads only from paths inside this directory (relative "
                        "paths are taken from it); default: any path the server can read")
    limits = parser.add_argument_group("what one client may take (docs/serving.md)")
    limits.add_argument("--max-request-bytes", type=_positive(int), default=http.max_request_bytes,
                        help="largest request body; larger ones get 413")
    limits.add_argument("--max-connections", type=_positive(int), default=http.max_connections,
                        help="open connections at most; past it a new one gets 503 and is closed")
    limits.add_argument("--header-timeout-s", type=_positive(float), default=http.header_timeout_s,
                        help="a request's headers must arrive within this many seconds of its first byte (else 408)")
    limits.add_argument("--body-timeout-s", type=_positive(float), default=http.body_timeout_s,
                        help="a request's body must arrive within this many seconds of its headers (else 408)")
    limits.add_argument("--shutdown-grace-s", type=_positive(int), default=http.shutdown_grace_s,
                        help="on SIGTERM/SIGINT, how long requests in flight may finish before they are aborted")
    limits.add_argument("--max-sequences-per-request", type=_positive(int), default=work.max_sequences_per_request,
                        help="sequences (prompts x n) one request may ask for; more get 400")
    limits.add_argument("--max-tokens-per-request", type=_positive(int), default=work.max_tokens_per_request,
                        help="prompt plus new tokens, summed over a request's sequences; more get 400")
    limits.add_argument("--max-inflight-sequences", type=_positive(int), default=work.max_inflight_sequences,
                        help="sequences the server holds at once; a request past it gets 429 with Retry-After")
    args = parser.parse_args(argv)
    setup_logging(None)
    _quiet_libraries()
    from relax.serving.server import serve

    try:
        http = HTTPLimits(args.max_request_bytes, args.max_connections, args.header_timeout_s, args.body_timeout_s,
                          shutdown_grace_s=args.shutdown_grace_s)
        work = GenerationLimits(args.max_sequences_per_request, args.max_tokens_per_request,
                                args.max_inflight_sequences)
        serve(args.hf_checkpoint, host=args.host, port=args.port, api_key=args.api_key, device=args.device,
              dtype=args.dtype, served_model_name=args.served_model_name, max_batch_size=args.max_batch_size,
              batch_window_ms=args.batch_window_ms, log_level=args.log_level,
              weight_update_root=args.weight_update_root, engine_core=args.engine_core,
              mem_fraction_static=args.mem_fraction_static, http_limits=http, generation_limits=work,
              cpu_threads=args.cpu_threads)
    except ValueError as err:
        print(f"relax serve: error: {err}", file=sys.stderr)
        return 2
    return 0


def _port(text: str) -> int:
    """A TCP port, 1-65535 (argparse's error names the flag)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (1-65535)")
    return port


def _positive(kind: type) -> Any:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{value} must be > 0")
        return value

    parse.__name__ = kind.__name__
    return parse


def cmd_config_docs(argv: list[str]) -> int:
    from relax.cli.args import render_config_reference

    print(render_config_reference())
    return 0


def cmd_model_docs(argv: list[str]) -> int:
    from relax.backends.model_registry import models_markdown

    print(models_markdown(), end="")
    return 0


def cmd_scale(argv: list[str]) -> int:
    from relax.cli.scale import main as scale_main

    return scale_main(argv)


def cmd_health(argv: list[str]) -> int:
    from relax.config import ConfigError
    from relax.core.health import STATE_FILE, format_state, read_state

    from relax.cli.args import CommandLineParser

    parser = CommandLineParser(prog="relax health", description="Show the health state of a run "
                                     f"(<run dir>/{STATE_FILE}, written every second under --use-health-check).")
    parser.add_argument("run_dir", type=Path, help="the run's --output-dir")
    parser.add_argument("--json", action="store_true", help=f"print {STATE_FILE} as it is")
    args = parser.parse_args(argv)
    state = read_state(args.run_dir)
    if state is None:
        raise ConfigError(f"{args.run_dir / STATE_FILE}: no health state (was the run started with "
                          "--use-health-check?)")
    print(json.dumps(state, indent=2) if args.json else format_state(state))
    healthy = all(role.get("healthy", True) for role in state.get("roles", {}).values()) and not state.get("fatal")
    return 0 if healthy else 1


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "export": cmd_export, "serve": cmd_serve, "scale": cmd_scale,
            "health": cmd_health, "config-docs": cmd_config_docs,
            "model-docs": cmd_model_docs}


def _report_native_crashes() -> None:
    """A crash in native code (a segfault in a library) leaves every thread's Python stack on stderr, not nothing;
    where stderr is no file (captured, as under pytest's capsys) there is nowhere to write it."""
    try:
        faulthandler.enable()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _report_native_crashes()
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"relax {_version()}")
        return 0
    if argv[0] not in COMMANDS:
        hints = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f" (did you mean {hints[0]!r}?)" if hints else ""
        print(f"relax: unknown command {argv[0]!r}{hint}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return _run_command(argv[0], argv[1:])
    except KeyboardInterrupt:  # Ctrl-C before the run's own handler is installed (start-up, eval, export)
        print(f"\nrelax {argv[0]}: interrupted", file=sys.stderr)
        return 130


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("relax-rl")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _run_command(command: str, argv: list[str]) -> int:
    from relax.config import ConfigError
    from relax.core.checkpoint import CheckpointError
    from relax.data.dataset import DatasetError

    try:
        return COMMANDS[command](argv)
    except (ConfigError, DatasetError, CheckpointError) as err:
        _log_to_run_file(f"relax {command}: error: {err}")
        print(f"relax {command}: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        fault = _run_fault(err)
        if fault is not None:  # a process died or hung: its name says it all, and a restart may recover
            _log_to_run_file(f"relax {command}: failed: {fault}")
            print(f"relax {command}: failed: {fault}", file=sys.stderr)
            return 1
        _log_to_run_file(f"relax {command}: failed: {_cause_first(err)}", exc_info=err)
        raise


def _causes(err: BaseException) -> list[BaseException]:
    """``err`` and its chain of ``__cause__`` (at most 20: a cycle must not loop)."""
    chain = [err]
    while chain[-1].__cause__ is not None and len(chain) < 20:
        chain.append(chain[-1].__cause__)
    return chain


def _run_fault(err: BaseException):
    """The `RunFault` in ``err``'s chain of causes, or None."""
    from relax.utils.errors import RunFault

    return next((cause for cause in _causes(err) if isinstance(cause, RunFault)), None)


def _cause_first(err: BaseException) -> str:
    """The innermost cause of a chained error first (a full disk's OSError rather than the wrapper's message)."""
    return " <- ".join(f"{type(e).__name__}: {e}" for e in reversed(_causes(err)))


def _log_to_run_file(message: str, exc_info: BaseException | None = None) -> None:
    """Into run.log (the console gets the message from the caller): a run's fatal error stays with its log."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            record = logging.LogRecord("relax", logging.ERROR, __file__, 0, message, None,
                                       (type(exc_info), exc_info, exc_info.__traceback__) if exc_info else None)
            handler.handle(record)


if __name__ == "__main__":
    sys.exit(main())
