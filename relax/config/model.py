"""The model a run starts from and where it runs (sections: model)"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, model_validator

from relax.config.base import flag, setting


class ModelSettings(BaseModel):
    """The model a run starts from and where it runs."""
    hf_checkpoint: str | None = setting(
        None, "Hugging Face model folder (config, weights, tokenizer) that the run starts from, or a GGUF file "
        "(model.gguf), dequantised once into a cached Hugging Face folder (docs/gguf.md).", "model", path=True
    )
    gguf_file: str | None = setting(
        None, "Name of a GGUF file inside the --hf-checkpoint folder (transformers' `gguf_file`): the same as giving "
        "--hf-checkpoint FOLDER/NAME.gguf.", "model", path=True
    )
    dtype: Literal["auto", "float32", "bfloat16"] = setting(
        "auto",
        "Parameter dtype for inference and the training forward. `auto`: bfloat16 on CUDA, float32 on CPU. "
        "Training keeps float32 master weights and optimizer state in every case.",
        "model",
    )
    device: Literal["auto", "cpu", "cuda"] = setting("auto", "Where to run. `auto`: CUDA when available.", "model")
    cpu_threads: int = setting(
        0, "Threads torch computes with on CPU. 0: chosen at start by measuring the model's matrix products at 1, 2, "
        "4, ... threads within the cores the machine's load leaves free (a tiny model is fastest on one; a busy "
        "machine gets fewer); $OMP_NUM_THREADS, when set, is taken instead.", "model", ge=0, le=1024,
    )
    gradient_checkpointing: bool = setting(
        False, "Recompute activations in the backward pass to save memory.", "model"
    )
    moe_grouped_gemm: bool = setting(
        True, "Mixture-of-experts layers as one grouped GEMM per projection over the tokens sorted by expert, in the "
        "compute dtype, the expert weights cast once per step and their gradients summed in float32 (upstream's "
        "Megatron flag of that name). --no-moe-grouped-gemm keeps transformers' own experts, which multiply in the "
        "weights' dtype: float32 in a single-process bf16 run, 3.97x slower on the Qwen3-30B-A3B layer (H200).",
        "model",
    )
    liger_kernel: Literal["auto", "on", "off"] = setting(
        "auto", "Fused kernels in the trainer's language model (Qwen2/3, Llama, Mistral families): liger-kernel's "
        "SwiGLU and RoPE, RMSNorms compiled by torch.compile, and on Qwen3 the per-head query/key norms and RoPE in "
        "one Triton pass. `auto` uses them on CUDA when liger-kernel is installed, `on` requires them.",
        "model",
    )

    @model_validator(mode="after")
    def _check_gguf_file(self) -> Self:
        if self.gguf_file is None:
            return self
        if not self.hf_checkpoint:
            raise ValueError(f"{flag('gguf_file')} names a file inside {flag('hf_checkpoint')}: set that folder too")
        if self.hf_checkpoint.lower().endswith(".gguf"):
            raise ValueError(f"{flag('hf_checkpoint')} {self.hf_checkpoint} is a GGUF file already: drop "
                             f"{flag('gguf_file')} or give the folder")
        if not self.gguf_file.lower().endswith(".gguf") or "/" in self.gguf_file:
            raise ValueError(f"{flag('gguf_file')} {self.gguf_file}: expected a file name ending in .gguf")
        return self

    @property
    def model_source(self) -> str | None:
        """What --hf-checkpoint and --gguf-file name together: a folder, or a GGUF file."""
        if self.gguf_file is None or self.hf_checkpoint is None:
            return self.hf_checkpoint
        return f"{self.hf_checkpoint.rstrip('/')}/{self.gguf_file}"
