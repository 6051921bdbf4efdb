"""LoRA adapters through peft (``--lora-rank``): injected into the Hugging Face model in place, so every module keeps
its path and the trainer's code sees the same model; only the adapters train, sit in the optimizer and the
checkpoint; the engine gets merged weights (``W + alpha/r * B @ A``) under the base model's names.

Target names are the Hugging Face module names (``q_proj``, ``down_proj``, ...) or upstream's Megatron names, mapped
to them (``linear_qkv`` = q/k/v projections, ``linear_proj`` = the attention output, ``linear_fc1`` = gate and up,
``linear_fc2`` = down), or ``all-linear``. ``--lora-scope`` chooses the towers: ``language`` leaves the vision and
audio encoders without adapters, ``vision`` adapts only the vision encoder, ``all`` both.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

MEGATRON_NAMES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                  "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
SCOPES = ("all", "language", "vision")
# Module paths of the encoders (the vision tower's names across the Qwen-VL, Qwen-Omni and Kimi families).
_TOWER = r"(?:.*\.)?(?:visual|vision_tower|vision_model|audio_tower)(?:\..*)?"
_VISION = r"(?:.*\.)?(?:visual|vision_tower|vision_model)(?:\..*)?"
ADAPTER_NAME = "default"
METADATA_FILE = "lora.json"  # in a checkpoint root: what `relax export` needs to rebuild the adapters


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    target_modules: tuple[str, ...] = ("linear_qkv", "linear_proj")
    scope: str = "all"

    def hf_targets(self) -> list[str] | str:
        if tuple(self.target_modules) == ("all-linear",):
            return "all-linear"
        names: list[str] = []
        for name in self.target_modules:
            for mapped in MEGATRON_NAMES.get(name, (name,)):
                if mapped not in names:
                    names.append(mapped)
        return names

    def peft_config(self):
        from peft import LoraConfig

        targets = self.hf_targets()
        if self.scope == "vision":  # only modules inside the vision tower
            if targets == "all-linear":
                raise ValueError("--lora-scope vision needs --target-modules names (all-linear would adapt the "
                                 "language model's head too)")
            targets = rf"{_VISION}\.(?:{'|'.join(map(re.escape, targets))})"
            return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets, lora_dropout=0.0,
                              bias="none")
        exclude = _TOWER if self.scope == "language" else None
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets, exclude_modules=exclude,
                          lora_dropout=0.0, bias="none")


def inject(model: nn.Module, settings: LoraSettings) -> int:
    """Add the adapters to ``model`` in place; every other parameter is frozen. Returns the adapter parameters'
    element count. Raises ValueError naming the targets when no module matched them."""
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(settings.peft_config(), model, adapter_name=ADAPTER_NAME)
    except ValueError as error:
        raise ValueError(f"--target-modules {' '.join(settings.target_modules)} (--lora-scope {settings.scope}): "
                         f"{error}") from None
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(is_adapter(name))
    return sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merged_named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of ``model`` under the base model's names, the adapted ones merged (``base + delta``): what an
    inference engine without adapters loads. Tensors are gathered (``full_tensor``) when sharded."""
    from peft.tuners.lora import LoraLayer

    def full(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    adapted = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    for name, parameter in model.named_parameters():
        if is_adapter(name):
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        if owner in adapted and leaf == "weight":
            layer = adapted[owner]
            with torch.no_grad():
                delta = _delta_weight(layer)
                yield f"{owner}.weight", full(parameter).detach() + delta.to(parameter.dtype)
        else:
            yield (f"{owner}.{leaf}" if owner in adapted else name), full(parameter).detach()


def _delta_weight(layer) -> torch.Tensor:
    """``scale * B @ A`` of one adapted linear layer, in float32. Not peft's ``get_delta_weight``: under FSDP the
    factors are shards, and they are gathered here before the product."""
    a = layer.lora_A[ADAPTER_NAME].weight
    b = layer.lora_B[ADAPTER_NAME].weight
    a = a.full_tensor() if hasattr(a, "full_tensor") else a
    b = b.full_tensor() if hasattr(b, "full_tensor") else b
    delta = b.float() @ a.float()
    if getattr(layer, "fan_in_fan_out", False):
        delta = delta.T
    return delta * layer.scaling[ADAPTER_NAME]


FINGERPRINT_SAMPLES = 16  # chunks read from each weight file for `base_fingerprint`
FINGERPRINT_CHUNK = 4096


class BaseModelChangedError(ValueError):
    """A LoRA checkpoint's base model is not the one its adapters were trained on."""


def base_fingerprint(base_model: str | Path) -> str:
    """What identifies a base model folder without reading all of it: its config.json, and for every safetensors
    file its name, size, header (tensor names, shapes, offsets) and `FINGERPRINT_SAMPLES` chunks spread over its
    data. Another model, or the same one changed in place, gives another fingerprint."""
    folder = Path(base_model)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for file in sorted(folder.glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        offsets = [size * index // FINGERPRINT_SAMPLES for index in range(FINGERPRINT_SAMPLES)]
        with open(file, "rb") as handle:
            for offset in [*offsets, max(0, size - FINGERPRINT_CHUNK)]:  # the header, spread samples, the end
                handle.seek(offset)
                digest.update(handle.read(FINGERPRINT_CHUNK))
    return digest.hexdigest()


def write_metadata(root: Path, settings: LoraSettings, base_model: str | Path) -> None:
    payload = {**asdict(settings), "target_modules": list(settings.target_modules),
               "base_model": str(Path(base_model).resolve()), "base_fingerprint": base_fingerprint(base_model)}
    staging = Path(root) / f"{METADATA_FILE}.partial"
    staging.write_text(json.dumps(payload, indent=2))
    staging.replace(Path(root) / METADATA_FILE)  # a kill mid-write leaves the previous one


def read_metadata(root: Path, base_model: str | Path | None = None) -> tuple[LoraSettings, Path] | None:
    """The adapters' settings and base model of a LoRA run's checkpoints (None: not a LoRA run); raises
    `BaseModelChangedError` when the base model (the recorded one, or ``base_model`` that a resumed run names) is
    missing or is not the one the adapters were trained on."""
    path = Path(root) / METADATA_FILE
    if not path.is_file():
        return None
    payload = json.loads(path.read_text())
    base = Path(payload.pop("base_model"))
    fingerprint = payload.pop("base_fingerprint", None)
    payload["target_modules"] = tuple(payload["target_modules"])
    check_base_model(Path(base_model) if base_model is not None else base, fingerprint, path)
    return LoraSettings(**payload), base


def check_base_model(base: Path, fingerprint: str | None, source: Path) -> None:
    """``base`` is there and still the model of ``fingerprint`` (recorded in ``source``)."""
    if not (base / "config.json").is_file():
        raise BaseModelChangedError(f"{source} names the base model {base}, which is not there: the adapters "
                                    "apply to that model only")
    if fingerprint is not None and base_fingerprint(base) != fingerprint:
        raise BaseModelChangedError(f"the base model {base} has changed since the adapters in {source.parent} "
                                    "were trained on it (its config or weights differ): the adapters apply to "
                                    "the model they were trained on")


def save_adapter_folder(model: nn.Module, settings: LoraSettings, base_model: str | Path, output: Path) -> None:
    """A folder ``peft.PeftModel.from_pretrained(base, output)`` loads: adapter_config.json and
    adapter_model.safetensors."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    output.mkdir(parents=True, exist_ok=True)
    config = settings.peft_config()
    config.base_model_name_or_path = str(base_model)
    config.save_pretrained(str(output))
    # peft's names relative to the model, under the prefix a PeftModel saves them with
    state = {f"base_model.model.{name}": tensor.detach().contiguous()
             for name, tensor in get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME).items()}
    save_file(state, str(output / "adapter_model.safetensors"))


def merge_into_base(model: nn.Module) -> nn.Module:
    """``model`` with the adapters merged into their base layers and removed (the plain Hugging Face model)."""
    from peft.tuners.lora import LoraLayer

    replacements: list[tuple[nn.Module, str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            module.merge(adapter_names=[ADAPTER_NAME])
            parent_name, _, child = name.rpartition(".")
            replacements.append((model.get_submodule(parent_name) if parent_name else model, child,
                                 module.get_base_layer()))
    for parent, child, base in replacements:
        setattr(parent, child, base)
    if hasattr(model, "peft_config"):
        del model.peft_config
    return model


def parse_targets(values: Sequence[str]) -> tuple[str, ...]:
    """``--target-modules`` values: names separated by spaces or commas."""
    return tuple(name for value in values for name in re.split(r"[\s,]+", value) if name)
