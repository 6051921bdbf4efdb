"""`relax export`: a checkpoint as a Hugging Face folder (or a LoRA run's adapters as a peft folder)."""

from __future__ import annotations

import os
from pathlib import Path

from relax.backends.training import lora
from relax.cli.args import CommandLineParser
from relax.cli.common import quiet_libraries
from relax.config import ConfigError
from relax.core.state.checkpoint import (
    PROCESSOR_FILES,
    CheckpointError,
    load_hf_model_from_checkpoint,
    resolve_checkpoint_root,
)


def cmd_export(argv: list[str]) -> int:
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
    quiet_libraries()
    import shutil

    import torch
    from transformers import AutoTokenizer

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
    # Written beside the output and renamed into place: a failed export leaves the old folder (or none). Made before
    # the model loads, so that an output nobody can write to fails at once, naming it.
    staging = output.with_name(f".{output.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
    except OSError as error:
        raise ConfigError(f"{output}: cannot write there ({error.strerror or error})") from None
    try:
        model, hf_dir = load_hf_model_from_checkpoint(args.checkpoint, args.step, dtype=getattr(torch, args.dtype),
                                                      merge_adapters=not args.adapter)
        if args.adapter:
            lora.save_adapter_folder(model, adapters[0], adapters[1], staging)
        else:
            model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(hf_dir).save_pretrained(staging)
        for name in PROCESSOR_FILES:  # a vision-language model's processor: AutoProcessor loads the export
            if (hf_dir / name).is_file() and not (staging / name).exists():
                shutil.copyfile(hf_dir / name, staging / name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if output.is_dir():
        shutil.rmtree(output)
    elif output.exists():
        output.unlink()
    os.replace(staging, output)
    print(f"exported {'the LoRA adapters' if args.adapter else 'the model'} to {output}")
    return 0
