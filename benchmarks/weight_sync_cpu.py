"""Seconds per weight sync on CPU: in-process copy vs gloo broadcast to one engine process vs disk.

Two models: the quickstart model (``examples/quickstart/model``; a 4-layer Qwen3 of hidden 256 built
from its config when the folder is missing) and a ~100 M-parameter Qwen3-shaped random model. For
each transport, one warm-up sync then ``--repeats`` timed syncs of the whole model, in ``--dtype``
(the engines hold the same dtype), in buckets of ``--bucket-mib`` MiB. A sync is timed end to end:

- in_process: `InProcessPublisher.publish` into an `EmbeddedEngine` in this process;
- broadcast: `BroadcastPublisher.publish` (gloo on 127.0.0.1) until the engine process reports
  that `BroadcastReceiver.receive` returned (the version is served);
- disk: `DiskPublisher.publish` (safetensors + manifest, fsync on) then `DiskReceiver.apply`.

After the timed syncs every engine's weights are hashed and compared with the trainer's.

    python benchmarks/weight_sync_cpu.py            # writes benchmarks/results/weight_sync_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from relax.backends.inference.embedded import EmbeddedEngine
from relax.distributed.process_group import free_loopback_port
from relax.distributed.weight_broadcast import BroadcastPublisher, BroadcastReceiver, WeightSyncGroup
from relax.distributed.weight_disk import DiskPublisher, DiskReceiver
from relax.distributed.weight_sync import InProcessPublisher, bucketize

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart" / "model"
QUICKSTART_FALLBACK = {"vocab_size": 99, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": True}
# 12 x 6.3 M per layer + a 25 M tied embedding = 100.7 M parameters.
QWEN3_100M = {"vocab_size": 32_768, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64, "tie_word_embeddings": True}
TIMEOUT_S = 120.0


SHAPES = {"qwen3-100m": QWEN3_100M}


def model_config(name: str) -> Qwen3Config:
    if name == "quickstart" and (QUICKSTART / "config.json").is_file():
        return AutoConfig.from_pretrained(QUICKSTART)
    return Qwen3Config(**(QUICKSTART_FALLBACK if name == "quickstart" else SHAPES[name]))


def build_model(config: Qwen3Config, dtype: torch.dtype, seed: int | None, device: str = "cpu") -> Qwen3ForCausalLM:
    """Allocate without transformers' init (slow for 100 M parameters on one core), then fill with
    seeded noise (the trainer) or leave as is (an engine, about to be overwritten)."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()  # to_empty gives lm_head its own tensor; tie it back to embed_tokens
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator, device=device) * 0.02)
    return model


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The engine needs a tokenizer object; a sync never uses it."""
    if QUICKSTART.is_dir():
        return AutoTokenizer.from_pretrained(QUICKSTART)
    from tokenizers import Tokenizer, models
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0}, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="<pad>")


def weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        digest.update(name.encode())
        digest.update(parameter.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def new_engine(config: Qwen3Config, dtype: torch.dtype, device: str = "cpu") -> EmbeddedEngine:
    return EmbeddedEngine(build_model(config, dtype, seed=None, device=device), build_tokenizer())


def buckets_of(model: torch.nn.Module, args) -> list:
    return list(bucketize(model.named_parameters(), args.bucket_mib << 20, getattr(torch, args.dtype)))


# ----------------------------------------------------------------------------- transports


def time_syncs(sync, repeats: int) -> list[float]:
    """One warm-up sync, then ``repeats`` timed ones; versions 1, 2, ..."""
    sync(1)
    times = []
    for version in range(2, repeats + 2):
        started = time.perf_counter()
        sync(version)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # GPU copies are asynchronous: the sync ends when they land
        times.append(time.perf_counter() - started)
    return times


def bench_in_process(trainer: torch.nn.Module, config, args) -> tuple[list[float], bool]:
    engine = new_engine(config, getattr(torch, args.dtype), args.trainer_device)
    publisher = InProcessPublisher(engine)
    times = time_syncs(lambda v: asyncio.run(publisher.publish(buckets_of(trainer, args), v)), args.repeats)
    return times, weights_digest(engine.model) == weights_digest(trainer)


def bench_disk(trainer: torch.nn.Module, config, args) -> tuple[list[float], bool]:
    engine = new_engine(config, getattr(torch, args.dtype), args.engine_device)
    with tempfile.TemporaryDirectory(prefix="relax_weight_sync_") as directory:
        publisher, receiver = DiskPublisher(directory, keep_last=2), DiskReceiver(directory, engine)

        def sync(version: int) -> None:
            asyncio.run(publisher.publish(buckets_of(trainer, args), version))
            asyncio.run(receiver.apply(version))

        times = time_syncs(sync, args.repeats)
    return times, weights_digest(engine.model) == weights_digest(trainer)


def _engine_process(port: int, rank: int, world_size: int, config_dict: dict, dtype: str, syncs: int, threads: int,
                    device: str, results) -> None:
    """One engine of the broadcast benchmark (group rank ``rank``): report after each received version."""
    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    engine = new_engine(Qwen3Config(**config_dict), getattr(torch, dtype), device)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    group = WeightSyncGroup.init("127.0.0.1", port, rank, world_size, backend=backend, timeout_s=TIMEOUT_S,
                                 device=torch.device(device))
    receiver = BroadcastReceiver(group, engine)
    for _ in range(syncs):
        metrics = asyncio.run(receiver.receive())
        results.put(("synced", metrics.version, metrics.seconds))
    results.put(("digest", weights_digest(engine.model), 0.0))
    group.close()


def engine_device(args, index: int) -> str:
    """Engine ``index``'s device: ``--engine-device`` on CPU; on CUDA one GPU each, from ``--engine-device`` on."""
    if not args.engine_device.startswith("cuda"):
        return args.engine_device
    first = int(args.engine_device.partition(":")[2] or 0)
    return f"cuda:{first + index}"


def bench_broadcast(trainer: torch.nn.Module, config, args, engines: int = 1) -> tuple[list[float], bool]:
    """A sync ends when every one of ``engines`` engine processes serves the version (one broadcast to all)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_loopback_port()
    processes = [context.Process(target=_engine_process, args=(
        port, rank, engines + 1, config.to_dict(), args.dtype, args.repeats + 1, args.threads,
        engine_device(args, rank - 1), results)) for rank in range(1, engines + 1)]
    for process in processes:
        process.start()
    try:
        backend = "nccl" if args.trainer_device.startswith("cuda") else "gloo"
        group = WeightSyncGroup.init("127.0.0.1", port, 0, engines + 1, backend=backend, timeout_s=TIMEOUT_S,
                                     device=torch.device(args.trainer_device))
        publisher = BroadcastPublisher(group)

        digests: list[str] = []  # an engine done with its last version reports its digest, maybe before the others

        def sync(version: int) -> None:
            asyncio.run(publisher.publish(buckets_of(trainer, args), version))
            synced = 0
            while synced < engines:
                kind, value, _ = results.get(timeout=TIMEOUT_S)
                if kind == "digest":
                    digests.append(value)
                    continue
                assert (kind, value) == ("synced", version), (kind, value)
                synced += 1

        times = time_syncs(sync, args.repeats)
        while len(digests) < engines:
            digests.append(results.get(timeout=TIMEOUT_S)[1])
        group.close()
    finally:
        for process in processes:
            process.join(timeout=TIMEOUT_S)
            if process.is_alive():
                process.kill()
    return times, all(digest == weights_digest(trainer) for digest in digests)


TRANSPORTS = {"in_process": bench_in_process, "broadcast": bench_broadcast, "disk": bench_disk}


def bench_model(name: str, args) -> dict:
    config = model_config(name)
    trainer = build_model(config, getattr(torch, args.dtype), seed=0, device=args.trainer_device)
    parameters = sum(p.numel() for p in trainer.parameters())
    result = {"parameters": parameters, "sync_bytes": sum(t.numel() * t.element_size()
                                                          for bucket in buckets_of(trainer, args) for _, t in bucket),
              "buckets": len(buckets_of(trainer, args)), "transports": {}}
    for transport in args.transports.split(","):
        times, identical = TRANSPORTS[transport](trainer, config, args)
        median = statistics.median(times)
        result["transports"][transport] = {"seconds_per_sync": median, "times": times, "bit_identical": identical,
                                           "gb_per_s": result["sync_bytes"] / median / 1e9}
        print(f"{name:>10} ({parameters / 1e6:6.1f} M params, {result['buckets']} buckets) {transport:>10}: "
              f"{median:7.3f} s/sync  identical={identical}", flush=True)
    fan_out = [int(n) for n in args.engines.split(",") if int(n) > 1] if "broadcast" in args.transports else []
    for engines in fan_out:  # the fan-out to several engines
        times, identical = bench_broadcast(trainer, config, args, engines)
        median = statistics.median(times)
        result["transports"][f"broadcast_to_{engines}"] = {
            "seconds_per_sync": median, "times": times, "bit_identical": identical,
            "gb_per_s": result["sync_bytes"] / median / 1e9}  # per link: every engine receives the whole model
        print(f"{name:>10} broadcast to {engines} engines: {median:7.3f} s/sync  identical={identical}", flush=True)
    base = result["transports"]["in_process"]["seconds_per_sync"]
    result["ratio_vs_in_process"] = {transport: entry["seconds_per_sync"] / base
                                     for transport, entry in result["transports"].items()}
    return result


def main(defaults: dict | None = None, description: str = __doc__) -> None:
    parser = argparse.ArgumentParser(description=description.split("\n")[0])
    parser.add_argument("--models", default="quickstart,qwen3-100m")
    parser.add_argument("--trainer-device", default="cpu", help="where the trainer's weights live")
    parser.add_argument("--engine-device", default="cpu", help="the engine's device (disk and broadcast)")
    parser.add_argument("--dtype", default="float32", help="sync dtype and engine dtype")
    parser.add_argument("--bucket-mib", type=int, default=64, help="--update-weight-buffer-size in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "weight_sync_cpu.json")
    parser.add_argument("--name", default="weight_sync_cpu", help="the result's benchmark name")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help=f"among {', '.join(TRANSPORTS)}")
    parser.add_argument("--engines", default="1", help="engine counts of the broadcast, e.g. 1,3,7 (on CUDA each "
                        "engine takes its own GPU from --engine-device on)")
    parser.set_defaults(**(defaults or {}))
    args = parser.parse_args()
    unknown = set(args.transports.split(",")) - set(TRANSPORTS)
    if unknown or "in_process" not in args.transports.split(","):
        raise SystemExit(f"--transports {args.transports}: among {', '.join(TRANSPORTS)}, in_process included "
                         "(the other transports are compared with it)")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    models = {name: bench_model(name, args) for name in args.models.split(",")}
    report = {
        "benchmark": args.name,
        "what": "seconds per end-to-end sync of the whole model (median of repeats after one warm-up)",
        "config": {"dtype": args.dtype, "bucket_mib": args.bucket_mib, "repeats": args.repeats,
                   "threads_per_process": args.threads, "trainer_device": args.trainer_device,
                   "engine_device": args.engine_device,
                   "in_process": "an engine in the trainer's process, on the trainer's device",
                   "broadcast": f"{'nccl' if args.trainer_device.startswith('cuda') else 'gloo'}, 127.0.0.1, "
                                "1 engine process; broadcast_to_N: one broadcast to N engine processes "
                                "(gb_per_s per link)",
                   "engines": args.engines, "transports": args.transports,
                   "disk": "safetensors per bucket + manifest, fsync on, system temp dir"},
        "models": models,
        "total_s": time.perf_counter() - started,
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "cpu_count": os.cpu_count(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output} in {report['total_s']:.1f} s")


if __name__ == "__main__":
    main()
