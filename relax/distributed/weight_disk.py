"""Weight sync transport 3: safetensors files in versioned directories (see `weight_sync`).

The fallback when trainer and engines share a filesystem but no network group (or an engine
starts later and needs the latest weights). Layout under the sync directory::

    v00000007/bucket_00000.safetensors
    v00000007/bucket_00001.safetensors
    v00000007/manifest.json          <- written last: a version exists once this file does

The manifest is written to a temporary name, flushed to disk and renamed into place, so a reader
sees either no manifest or a whole one. A directory without one is a publish in progress or a
crash between buckets; receivers ignore it and the next publish's garbage collection removes it.
After each publish the publisher keeps the newest ``keep_last`` complete versions; keep at least
2 so that a receiver reading the previous one is not pulled from under it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import struct
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from relax.distributed.weight_sync import (
    RUN_META_KEY,
    Manifest,
    NamedTensors,
    SyncMetrics,
    TensorSpec,
    WeightSyncError,
    WeightTarget,
    apply_to_engine,
    check_bucket,
    check_manifest,
    engine_weight_specs,
)
from relax.utils.aio import cancel_and_wait
from relax.utils.durable import fsync_path

_publisher_runs: dict[int, str] = {}


def publisher_run() -> str:
    """This process's id in the manifests it publishes (see RUN_META_KEY). Keyed by pid, not drawn at import: a
    process forked from one that had imported this module (a supervisor's child, a forkserver's run) is a new
    publisher, whose older versions engines must take."""
    return _publisher_runs.setdefault(os.getpid(), uuid.uuid4().hex)


MANIFEST_NAME = "manifest.json"
VERSION_DIR = re.compile(r"^v(\d{8})$")
# safetensors' dtype codes, for checking file headers against the manifest without loading data.
SAFETENSORS_DTYPES = {
    "float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
TORCH_DTYPE_OF_CODE = {code: name for name, code in SAFETENSORS_DTYPES.items()}


logger = logging.getLogger("relax")


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def bucket_path(root: Path, version: int, index: int) -> Path:
    return version_dir(root, version) / f"bucket_{index:05d}.safetensors"


def complete_versions(root: Path) -> list[int]:
    """Versions whose manifest has landed, oldest first."""
    return sorted(version for version, path in _version_dirs(root) if (path / MANIFEST_NAME).is_file())


def _version_dirs(root: Path) -> Iterator[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return
    for path in root.iterdir():
        match = VERSION_DIR.match(path.name)
        if match and path.is_dir():
            yield int(match.group(1)), path


def collect_garbage(root: Path, keep_last: int) -> list[int]:
    """Delete complete versions older than the newest ``keep_last`` and manifest-less directories
    older than the newest complete version (crash leftovers); returns the versions removed.
    Newer manifest-less directories are left alone: they may be a publish in progress."""
    complete = complete_versions(root)
    if not complete:
        return []
    kept = set(complete[-keep_last:])
    newest = complete[-1]
    removed = []
    for version, path in _version_dirs(root):
        if version not in kept and (version in complete or version < newest):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(version)
    return sorted(removed)


# ----------------------------------------------------------------------------- trainer


class DiskPublisher:
    """Writes each version as bucket files plus a manifest under ``root``.

    ``fsync`` makes a published version survive a machine crash, not only a process crash (the
    manifest could otherwise reach the disk before the buckets it names).
    """

    transport = "disk"

    def __init__(self, root: str | Path, keep_last: int = 2, fsync: bool = True, run: str | None = None) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.fsync = fsync
        self.run = run  # written into each manifest (default: this process's id): followers of a run load its versions

    async def publish(
        self, buckets: Iterable[NamedTensors], version: int, meta: dict[str, Any] | None = None
    ) -> SyncMetrics:
        """Stream the buckets to files (one bucket in memory at a time), then commit the manifest.
        A crash before the commit leaves a directory that receivers ignore."""
        started = time.perf_counter()
        directory = version_dir(self.root, version)
        if directory.exists():  # a leftover of a crashed publish, or a re-publish of this version
            shutil.rmtree(directory)
        # Later versions are a dead run's (this run resumed from an older checkpoint): they would hide this one
        # from engines loading the newest version, and the garbage collection would delete this one first.
        for later, path in _version_dirs(self.root):
            if later > version:
                shutil.rmtree(path, ignore_errors=True)
        directory.mkdir(parents=True)
        specs = []
        for index, bucket in enumerate(buckets):
            specs.append(self._write_bucket(version, index, bucket))
        manifest = Manifest(version, tuple(specs), {RUN_META_KEY: self.run or publisher_run(), **(meta or {})})
        self._commit_manifest(directory, manifest)
        collect_garbage(self.root, self.keep_last)
        return SyncMetrics(self.transport, version, time.perf_counter() - started, manifest.nbytes, len(specs))

    def _write_bucket(self, version: int, index: int, bucket: NamedTensors) -> tuple[TensorSpec, ...]:
        path = bucket_path(self.root, version, index)
        tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in bucket}
        save_file(tensors, path, metadata={"version": str(version), "bucket": str(index)})
        if self.fsync:
            fsync_path(path)
        return tuple(TensorSpec.of(name, tensor) for name, tensor in bucket)

    def _commit_manifest(self, directory: Path, manifest: Manifest) -> None:
        temporary = directory / f".{MANIFEST_NAME}.tmp"
        with open(temporary, "w") as file:
            file.write(manifest.to_json())
            file.flush()
            if self.fsync:
                os.fsync(file.fileno())
        os.replace(temporary, directory / MANIFEST_NAME)
        if self.fsync:
            fsync_path(directory)


# ----------------------------------------------------------------------------- engines


class DiskReceiver:
    """Applies versions found under ``root`` to one engine."""

    transport = "disk"

    def __init__(self, root: str | Path, engine: WeightTarget) -> None:
        self.root = Path(root)
        self.engine = engine

    def latest_version(self, run: str | None = None) -> int | None:
        """The newest complete version (of publisher ``run`` only, when given)."""
        for version in reversed(complete_versions(self.root)):
            if run is None:
                return version
            try:
                if self.read_manifest(version).meta.get(RUN_META_KEY) == run:
                    return version
            except WeightSyncError:  # removed meanwhile, or unreadable: an older one may do
                continue
        return None

    async def poll(self, timeout_s: float, interval_s: float = 0.05) -> SyncMetrics:
        """Wait (at most ``timeout_s``) for a complete version newer than the engine's, apply the
        newest one. Raises TimeoutError when none appears; the engine keeps serving meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            latest = self.latest_version()
            if latest is not None and latest > self.engine.weight_version:
                return await self.apply(latest)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no weight version newer than {self.engine.weight_version} appeared under "
                                   f"{self.root} within {timeout_s} s")
            await asyncio.sleep(interval_s)

    def check(self, version: int) -> Manifest:
        """Version ``version``'s manifest, checked against the engine and against every bucket file's header
        (raises `WeightSyncError`); nothing is loaded."""
        manifest = self.read_manifest(version)
        check_manifest(manifest, version, engine_weight_specs(self.engine), self.engine.weight_version,
                       self.engine.weight_run)
        for index in range(len(manifest.buckets)):
            self._check_bucket_header(manifest, index)
        return manifest

    async def apply(self, version: int) -> SyncMetrics:
        """Check version ``version`` (`check`), then load it into the engine."""
        started = time.perf_counter()
        manifest = self.check(version)
        await apply_to_engine(self.engine, version, self._stream(manifest))
        self.engine.weight_run = manifest.meta.get(RUN_META_KEY)
        return SyncMetrics(self.transport, version, time.perf_counter() - started, manifest.nbytes,
                           len(manifest.buckets))

    def read_manifest(self, version: int) -> Manifest:
        path = version_dir(self.root, version) / MANIFEST_NAME
        try:
            text = path.read_text()
        except FileNotFoundError as error:
            raise WeightSyncError(f"weight sync version {version}: no manifest at {path} (incomplete or removed "
                                  "version)", version=version) from error
        return Manifest.from_json(text)

    def _check_bucket_header(self, manifest: Manifest, index: int) -> None:
        """Every tensor the manifest lists is in the bucket file with its shape and dtype."""
        version = manifest.version
        path = bucket_path(self.root, version, index)
        header = _read_header(path, version)
        for spec in manifest.buckets[index]:
            entry = header.get(spec.name)
            if entry is None:
                raise WeightSyncError(f"weight sync version {version}: tensor {spec.name!r} is missing from {path}",
                                      version=version, tensor=spec.name)
            expected_dtype = SAFETENSORS_DTYPES.get(spec.dtype, entry["dtype"])
            if tuple(entry["shape"]) != spec.shape or entry["dtype"] != expected_dtype:
                raise WeightSyncError(
                    f"weight sync version {version}: tensor {spec.name!r} in {path} is {tuple(entry['shape'])} "
                    f"{entry['dtype']}, the manifest says {spec.shape} {spec.dtype}", version=version, tensor=spec.name,
                )

    def _stream(self, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
        """Load one bucket file at a time, in manifest order."""
        for index, specs in enumerate(manifest.buckets):
            path = bucket_path(self.root, manifest.version, index)
            try:
                tensors = load_file(path)
            except (OSError, RuntimeError) as error:  # removed or truncated under us
                raise WeightSyncError(f"weight sync version {manifest.version}: reading {path} failed ({error})",
                                      version=manifest.version) from error
            bucket = [(spec.name, tensors[spec.name]) for spec in specs if spec.name in tensors]
            check_bucket(manifest, index, bucket)
            yield from bucket


# safetensors itself refuses headers over 100 MB; a length beyond the file is a corrupt or hostile file.
MAX_HEADER_BYTES = 100 * 1024 * 1024


class DiskFollower:
    """An engine that follows the versions published under ``root`` (the pull side of the disk transport) by one
    publisher (``run``, `DiskPublisher.run`): the trainer publishes and goes on; this applies the newest complete version in the background whenever
    ``between_calls`` (an `asyncio.Lock` its owner holds while the engine generates) is free, and on demand before a
    generation (`catch_up`). A version pulled from under it (the publisher keeps only the newest few) is skipped for
    the next one; the engine keeps serving its current version meanwhile."""

    def __init__(self, root: str | Path, engine: WeightTarget, between_calls: asyncio.Lock,
                 interval_s: float = 0.1, run: str | None = None) -> None:
        self.receiver = DiskReceiver(root, engine)
        # Only versions this run published: a dead run's newer versions left under the root (a resume) are never
        # served, and the run's own versions are loaded even where they are older than what the engine served.
        self.run = run
        self.between_calls = between_calls
        self.interval_s = interval_s
        self.applied: list[SyncMetrics] = []  # since the last `pop_metrics`
        self._failed: int | None = None  # a version that could not be loaded: wait for a newer one
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._follow(), name="relax-weight-follower")

    async def catch_up(self) -> None:
        """Apply the run's newest published version now unless the engine serves it (or a newer one of the run)
        already; the caller holds ``between_calls``."""
        engine = self.receiver.engine
        latest = self.receiver.latest_version(self.run)
        if latest is None or latest == self._failed:
            return
        if (self.run is None or engine.weight_run == self.run) and latest <= engine.weight_version:
            return  # serving this version of this run already (or a newer one of it)
        try:
            self.applied.append(await self.receiver.apply(latest))
        except (WeightSyncError, FileNotFoundError) as error:  # removed meanwhile, or damaged: wait for a newer one
            self._failed = latest
            logger.warning("weight version %d could not be loaded (%s); waiting for the next one", latest, error)

    def pop_metrics(self) -> dict[str, float]:
        applied, self.applied = self.applied, []
        if not applied:
            return {}
        return {"perf/weight_pull_s": sum(m.seconds for m in applied), "perf/weight_pull_versions": float(len(applied))}

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.between_calls.locked():
                async with self.between_calls:
                    await self.catch_up()

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor entries of a safetensors file's JSON header (8-byte little-endian length, then JSON), each with a
    ``dtype`` code and a ``shape``; raises ValueError saying what is wrong with a file that is not one."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            prefix = file.read(8)
            if len(prefix) < 8:
                raise ValueError("shorter than a safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError("has a header length beyond the end of the file")  # no sizes: never describe a file
            header = json.loads(file.read(length))
    except OSError as error:
        raise ValueError(f"cannot be read ({error.strerror or error})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("has no valid JSON header (not a safetensors file)") from None
    if not isinstance(header, dict):
        raise ValueError("has a header that is not a JSON object")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
                and all(isinstance(d, int) and d >= 0 for d in entry["shape"])):
            raise ValueError(f"has a malformed header entry for tensor {name!r}")
    return header


def _read_header(path: Path, version: int) -> dict[str, dict]:
    try:
        return read_safetensors_header(path)
    except ValueError as error:
        raise WeightSyncError(f"weight sync version {version}: bucket file {path} {error}", version=version) from error
