"""``/update_weights_from_disk``: load a Hugging Face folder or a versioned weight-sync directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from relax.backends.inference.base import InferenceEngine
from relax.distributed.weight_disk import MANIFEST_NAME, VERSION_DIR, DiskReceiver, complete_versions


class WeightPathError(ValueError):
    """The path holds no weights this server can load (answered with HTTP 400)."""


async def update_weights_from_path(engine: InferenceEngine, model_path: str, weight_version: int | None) -> int:
    """Load the weights under ``model_path`` into ``engine``; returns the version now served.

    - a ``vNNNNNNNN`` directory with a manifest (`relax.distributed.weight_disk`): that version;
    - a root of such directories: ``weight_version`` if given, else the newest complete one;
    - a Hugging Face folder with ``*.safetensors`` files: served as ``weight_version``
      (default: the current version + 1).
    """
    path = Path(model_path)
    if not path.is_dir():
        raise WeightPathError(f"model_path {model_path!r} is not a directory")
    match = VERSION_DIR.match(path.name)
    if match and (path / MANIFEST_NAME).is_file():
        version = int(match.group(1))
        if weight_version is not None and weight_version != version:
            raise WeightPathError(f"weight_version {weight_version} does not match the directory {path.name}")
        await DiskReceiver(path.parent, engine).apply(version)
        return version
    versions = complete_versions(path)
    if versions:
        version = versions[-1] if weight_version is None else weight_version
        if version not in versions:
            raise WeightPathError(f"weight_version {version} is not a complete version under {model_path!r} "
                                  f"(complete: {versions})")
        await DiskReceiver(path, engine).apply(version)
        return version
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightPathError(f"model_path {model_path!r} holds no *.safetensors files and no versioned "
                              "weight directories")
    version = engine.weight_version + 1 if weight_version is None else weight_version
    await engine.update_weights(_read_safetensors(files), version)
    return version


def _read_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """One tensor at a time, file by file (a sharded checkpoint never sits in memory whole)."""
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, handle.get_tensor(name)
