"""``/update_weights_from_disk``: load a Hugging Face folder or a versioned weight-sync directory, all or nothing.

Everything a client names is checked before the engine is touched:

- the path, and every file the update would open (each ``*.safetensors`` file or shard, the shard index, a version's
  manifest and buckets), resolved through every link before the ``--weight-update-root`` check. One answer covers
  "missing", "not a directory", "not a regular file", "outside the root" and "unreadable", and no answer quotes a
  file's bytes or size, so the endpoint cannot be used to probe the file system;
- a sharded folder's ``model.safetensors.index.json``: every shard it names must be there (a missing one is named);
- every file's header (a real safetensors file), every tensor's name, shape and dtype against the served model, and
  completeness: an update names every parameter the engine holds (tied parameters once, under any of their
  names), so a folder holding part of a model can never become a new version;
- every value (no NaN or infinity), and the version (never older than the one served, but for 0, a new run's
  initial weights, and for a version another trainer process published: a run resumed from an older checkpoint
  after a restart).

Only then are the weights copied in, with the engine paused under the weight-update hold, so a rejected update leaves
the served weights and version exactly as they were.
"""

from __future__ import annotations

import asyncio
import json
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
    version_dir,
)
from relax.distributed.weight_sync import (
    Manifest,
    TensorSpec,
    WeightSyncError,
    apply_to_engine,
    check_manifest,
    engine_parameter_names,
    engine_weight_specs,
    from_new_run,
    goes_backwards,
)

SHARD_INDEX = "model.safetensors.index.json"


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
    path = Path(model_path) if "\0" not in model_path else None
    if path is not None and root is not None and not path.is_absolute():
        path = root / path
    return _resolved(path, root, model_path, want_dir=True)


def loadable_file(file: Path, root: Path | None, model_path: str) -> Path:
    """The real path of a file an update would open: links resolved, then it must be a regular file inside ``root``
    (a link inside the root to a file outside it is refused like a path outside it, with the same answer)."""
    return _resolved(file, root, model_path, want_dir=False)


def _resolved(path: Path | None, root: Path | None, model_path: str, want_dir: bool) -> Path:
    try:
        if path is None:
            raise ValueError("a NUL byte in the path")
        real = Path(os.path.realpath(path))  # symlinks and ../ resolved before the root check
        inside = root is None or real.is_relative_to(root)
        if not inside or not (real.is_dir() if want_dir else real.is_file()):
            raise ValueError("not loadable")
        if not want_dir and not os.access(real, os.R_OK):
            raise ValueError("not readable")
    except (OSError, ValueError):  # ENAMETOOLONG, EACCES, ELOOP, a NUL byte: all the same answer
        raise _not_loadable(model_path, root) from None
    return real


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
        files = [] if versioned else _folder_files(path, root, model_path)
    except OSError:
        raise _not_loadable(model_path, root) from None
    if versioned is not None:
        version_root, version = versioned
        loadable_file(version_dir(version_root, version) / MANIFEST_NAME, root, model_path)
        receiver = DiskReceiver(version_root, engine)
        manifest = receiver.read_manifest(version)
        _check_version(engine, version, from_new_run(manifest, engine.weight_run))
        buckets = [loadable_file(bucket_path(version_root, version, i), root, model_path)
                   for i in range(len(manifest.buckets))]
        manifest = receiver.check(version)
        check_complete(manifest, engine)
        await asyncio.to_thread(_check_values, buckets)
        await receiver.apply(version)
        return version
    if not files:
        raise _not_loadable(model_path, root)
    version = engine.weight_version + 1 if weight_version is None else weight_version
    _check_version(engine, version)
    manifest = Manifest(version, tuple(_file_specs(file) for file in files))
    check_manifest(manifest, version, engine_weight_specs(engine))
    check_complete(manifest, engine)
    await asyncio.to_thread(_check_values, files)
    await apply_to_engine(engine, version, _read_safetensors(files))
    return version


def _folder_files(path: Path, root: Path | None, model_path: str) -> list[Path]:
    """The safetensors files of a Hugging Face folder, each resolved (`loadable_file`): the shards its
    ``model.safetensors.index.json`` names when it has one (every one must be there), else every
    ``*.safetensors`` file."""
    index = path / SHARD_INDEX
    if not index.exists() and not index.is_symlink():
        return [loadable_file(file, root, model_path) for file in sorted(path.glob("*.safetensors"))]
    index = loadable_file(index, root, model_path)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
        if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in shards):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise WeightPathError(f"{SHARD_INDEX} has no valid weight_map") from None
    files = []
    for shard in shards:
        if Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise WeightPathError(f"{SHARD_INDEX} names {shard!r}, which is not a safetensors file of the folder")
        if not (path / shard).exists():
            raise WeightPathError(f"{SHARD_INDEX} names the shard {shard}, which is missing")
        files.append(loadable_file(path / shard, root, model_path))
    return files


def check_complete(manifest: Manifest, engine: InferenceEngine) -> None:
    """An update must name every parameter the engine holds: a folder holding part of a model would otherwise be
    served as a new version, half old and half new. Tied parameters count once, under any of their names."""
    groups = engine_parameter_names(engine)
    if groups is None:
        return
    named = {spec.name for spec in manifest.tensor_specs()}
    missing = [sorted(names)[0] for names in groups if not names & named]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise WeightPathError(f"the update names {len(named)} tensors but not {missing[0]!r}{more}: an update must "
                              f"give every parameter of the served model ({len(groups)} tensors)")


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
    except ValueError:  # what is wrong with it is not said: the answer must not describe the file's bytes
        raise WeightPathError(f"{file.name} is not a readable safetensors file") from None
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
        except Exception:  # noqa: BLE001 - safetensors raises its own error type for a corrupt file
            raise WeightPathError(f"{file.name} is not a readable safetensors file") from None


def _read_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """One tensor at a time, file by file (a sharded checkpoint never sits in memory whole)."""
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, handle.get_tensor(name)


__all__ = ["WeightPathError", "WeightSyncError", "check_complete", "loadable_file", "resolve_weight_path",
           "update_weights_from_path"]
