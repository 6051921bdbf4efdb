"""Seconds per weight sync from the trainer's GPU to an engine on another GPU: NCCL broadcast vs disk.

The same measurement as `benchmarks/weight_sync_cpu.py` (see its docstring), on a 2-GPU machine, for
randomly initialised Qwen3-0.6B- and Qwen3-4B-shaped models in bfloat16 with 512 MiB buckets
(upstream's --update-weight-buffer-size):

- broadcast: `BroadcastPublisher` on cuda:0 → `BroadcastReceiver` in an engine process on cuda:1,
  over an NCCL weight-sync group (the transport of `--weight-sync-transport broadcast`);
- disk: safetensors written from cuda:0 and loaded into an engine on cuda:1 (the fallback transport);
- in_process: the colocated copy into an engine on the trainer's own GPU, for reference.

    NCCL_NVLS_ENABLE=0 python -m benchmarks.weight_sync_gpu     # writes results/weight_sync_gpu.json
    NCCL_NVLS_ENABLE=0 python -m benchmarks.weight_sync_gpu --engines 1,3,7   # one broadcast to 1, 3 and 7 engines
                                                                                  # on GPUs 1..7 (8 GPUs)
    python -m benchmarks.weight_sync_gpu --gpus 1 --models qwen3-0.6b            # smoke test on one GPU: the engine
                                                                                  # beside the trainer, no broadcast

``--engines`` adds ``broadcast_to_N`` rows: one NCCL broadcast from the trainer to N engine processes, each on its
own GPU, timed until every engine serves the version; ``gb_per_s`` is per link (each engine receives the whole
model). The same option runs on CPU with gloo (`benchmarks/weight_sync_cpu.py --engines 1,3`).
"""

from __future__ import annotations

import sys

from benchmarks import weight_sync_cpu

QWEN3_0_6B = {"vocab_size": 151_936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True}
QWEN3_4B = {"vocab_size": 151_936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True}


def main() -> None:
    # --gpus 1 (a smoke test on one GPU): the engine beside the trainer, no broadcast (NCCL refuses two ranks on one
    # GPU), so in-process and disk only
    one_gpu = "--gpus" in sys.argv and sys.argv[sys.argv.index("--gpus") + 1] == "1"
    if "--gpus" in sys.argv:
        position = sys.argv.index("--gpus")
        del sys.argv[position:position + 2]
    weight_sync_cpu.SHAPES.update({"qwen3-0.6b": QWEN3_0_6B, "qwen3-4b": QWEN3_4B})
    weight_sync_cpu.main(defaults={
        "models": "qwen3-0.6b,qwen3-4b", "dtype": "bfloat16", "bucket_mib": 512, "trainer_device": "cuda:0",
        "engine_device": "cuda:0" if one_gpu else "cuda:1", "name": "weight_sync_gpu",
        "output": weight_sync_cpu.ROOT / "benchmarks" / "results" / "weight_sync_gpu.json",
        **({"transports": "in_process,disk"} if one_gpu else {}),
    }, description=__doc__)


if __name__ == "__main__":
    main()
