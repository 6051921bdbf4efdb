"""``/update_weights_from_disk``: load a Hugging Face folder or a versioned weight-sync directory, all or nothing.

Everything a client names is checked before the engine is touched: the path (inside ``--weight-update-root`` when
the server has one, with one answer for "missing", "not a directory" and "outside the root", so the endpoint
cannot be used to probe the file system), every file's header (a real safetensors file), every tensor's name, shape
and dtype against the served model, every value (no NaN or infinity), and the version (never older than the one
served, but for 0, a new run's initial weights, and for a version another trainer process published: a run resumed
from an older checkpoint after a restart). Only then are the weights copied in, with the engine paused under the weight-update hold, so a rejected
update leaves the served weights and version exactly as they were.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from relax.backends.inference.base import InferenceEngine
from relax.distributed.weight_disk import (
    MANIFEST_NAME,
    TORCH_DTYPE_OF_CODE,
    VERSION_DIR,
    DiskReceiver,
    bucket_path,
    complete_versions,
    read_safetensors_header,
)
from relax.distributed.weight_sync import (
    Manifest,
    TensorSpec,
    WeightSyncError,
    apply_to_engine,
    check_manifest,
    engine_weight_specs,
    from_new_run,
    goes_backwards,
)


class WeightPathError(ValueError):
    """The request names no weights this server can load (answered with HTTP 400 naming ``param``)."""

    def __init__(self, message: str, param: str = "model_path") -> None:
        super().__init__(message)
        self.param = param


def _not_loadable(model_path: str, root: Path | None) -> WeightPathError:
    where = f" under --weight-update-root {root}" if root is not None else ""
    return WeightPathError(f"{model_path!r} is not a weight directory this server can load{where}: a Hugging Face "
                           "folder of *.safetensors files, a root of versioned weight-sync directories, or one "
                           "vNNNNNNNN directory")


def resolve_weight_path(model_path: str, root: Path | None) -> Path:
    """The real directory ``model_path`` names (relative paths are taken from ``root`` when set). Every way of not
    being a readable directory inside ``root`` gives the same error."""
    try:
        path = Path(model_path)
        if root is not None and not path.is_absolute():
            path = root / path
        path = Path(os.path.realpath(path))  # symlinks and ../ resolved before the root check
        if (root is not None and not path.is_relative_to(root)) or not path.is_dir():
            raise _not_loadable(model_path, root)
    except (OSError, ValueError) as error:  # ENAMETOOLONG, EACCES, a NUL byte in the path
        if isinstance(error, WeightPathError):
            raise
        raise _not_loadable(model_path, root) from None
    return path


async def update_weights_from_path(engine: InferenceEngine, model_path: str, weight_version: int | None,
                                   root: str | Path | None = None) -> int:
    """Load the weights under ``model_path`` into ``engine``; returns the version now served.

    - a ``vNNNNNNNN`` directory with a manifest (`relax.distributed.weight_disk`): that version;
    - a root of such directories: ``weight_version`` if given, else the newest complete one;
    - a Hugging Face folder with ``*.safetensors`` files: served as ``weight_version``
      (default: the current version + 1).
    """
    root = Path(os.path.realpath(root)) if root is not None else None
    path = resolve_weight_path(model_path, root)
    try:
        versioned = _versioned(path, weight_version, model_path, root)
        files = [] if versioned else [f for f in sorted(path.glob("*.safetensors")) if f.is_file()]
    except OSError:
        raise _not_loadable(model_path, root) from None
    if versioned is not None:
        version_root, version = versioned
        receiver = DiskReceiver(version_root, engine)
        _check_version(engine, version, from_new_run(receiver.read_manifest(version), engine.weight_run))
        manifest = receiver.check(version)
        await asyncio.to_thread(_check_values, [bucket_path(version_root, version, i)
                                                for i in range(len(manifest.buckets))])
        await receiver.apply(version)
        return version
    if not files:
        raise _not_loadable(model_path, root)
    version = engine.weight_version + 1 if weight_version is None else weight_version
    _check_version(engine, version)
    manifest = Manifest(version, tuple(_file_specs(file) for file in files))
    check_manifest(manifest, version, engine_weight_specs(engine))
    await asyncio.to_thread(_check_values, files)
    await apply_to_engine(engine, version, _read_safetensors(files))
    return version


def _versioned(path: Path, weight_version: int | None, model_path: str, root: Path | None) -> tuple[Path, int] | None:
    """(root of versions, version) when ``path`` is one version directory or a root of them, else None."""
    match = VERSION_DIR.match(path.name)
    if match and (path / MANIFEST_NAME).is_file():
        version = int(match.group(1))
        if weight_version is not None and weight_version != version:
            raise WeightPathError(f"weight_version {weight_version} does not match the directory {path.name}",
                                  "weight_version")
        return path.parent, version
    versions = complete_versions(path)
    if not versions:
        return None
    version = versions[-1] if weight_version is None else weight_version
    if version not in versions:
        raise WeightPathError(f"weight_version {version} is not a complete version under {model_path!r} "
                              f"(complete: {versions})", "weight_version")
    return path, version


def _check_version(engine: InferenceEngine, version: int, new_run: bool = False) -> None:
    if goes_backwards(version, engine.weight_version, new_run):
        raise WeightPathError(f"weight_version {version} is older than the served version {engine.weight_version} "
                              "(versions never go backwards within a run; 0, or a version another trainer process "
                              "published, starts a new one)", "weight_version")


def _file_specs(file: Path) -> tuple[TensorSpec, ...]:
    try:
        header = read_safetensors_header(file)
    except ValueError as error:
        raise WeightPathError(f"{file.name} {error}") from None
    specs = []
    for name, entry in header.items():
        dtype = TORCH_DTYPE_OF_CODE.get(entry["dtype"])
        if dtype is None:
            raise WeightPathError(f"{file.name}: tensor {name!r} has dtype {entry['dtype']!r}, which this server "
                                  "cannot load")
        specs.append(TensorSpec(name, tuple(entry["shape"]), dtype))
    return tuple(specs)


def _check_values(files: list[Path]) -> None:
    """Read every tensor once (one at a time) before any is applied: a file safetensors refuses, or a
    floating-point tensor with NaN or infinity, rejects the whole update."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    tensor = handle.get_tensor(name)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        raise WeightPathError(f"{file.name}: tensor {name!r} holds NaN or infinite values")
        except WeightPathError:
            raise
        except Exception as error:  # noqa: BLE001 - safetensors raises its own error type for a corrupt file
            raise WeightPathError(f"{file.name} cannot be read as safetensors ({error})") from None


def _read_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """One tensor at a time, file by file (a sharded checkpoint never sits in memory whole)."""
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, handle.get_tensor(name)


__all__ = ["WeightPathError", "WeightSyncError", "resolve_weight_path", "update_weights_from_path"]
