"""Weight sync (DCS): versioned, bucketed transfer of the trainer's weights into inference engines.

Contract
--------
*Trainer side.* A publisher pushes one version of the weights::

    metrics = await publisher.publish(buckets, version, meta)

``buckets`` is an iterable of buckets, each a ``list[(hf_name, tensor)]`` of about ``bucket_bytes``
(upstream's ``--update-weight-buffer-size``, default 512 MiB), as yielded by
``TrainBackend.named_parameters_for_sync(dtype, bucket_bytes)`` / ``Actor.weight_buckets`` or by
`bucketize`. The tensors are already in the sync dtype (bf16 on GPU, usually). ``meta`` is a small
JSON-serialisable dict carried in the manifest (step, source, ...).

*Manifest.* `Manifest` describes one version: ``version``, per bucket the ``(name, shape, dtype)``
of each tensor in order, and ``meta``. Transports that cross a process boundary send it before any
tensor data (broadcast) or write it last as the commit marker (disk).

*Engine side.* A receiver applies one version to an `WeightTarget`:

1. It gets the manifest and checks it (`check_manifest`) *before touching the engine*: the version
   is the one expected, no tensor is named twice, and, when the engine exposes its model
   (`engine_weight_specs`), every tensor exists there with the same shape and a compatible dtype.
2. It calls `apply_to_engine`: ``pause()`` (no new decode step; the embedded engine stops at a step
   boundary, and steps run on the caller's loop, so none is running once ``pause`` returns),
   ``flush_cache()`` when the engine has one (an HTTP engine's KV/prefix cache holds activations of
   the old weights), ``update_weights(<every tensor of every bucket>, version)``, then ``resume()``
   (also on error).
3. ``engine.weight_version`` switches to ``version`` only after the last bucket landed: all buckets
   go through *one* ``update_weights`` call, which sets the version at its end.

*Failures.* A receiver raises `WeightSyncError` naming the version and, where one is at fault, the
tensor. A manifest that fails the checks leaves the engine untouched (weights and version: it keeps
serving the previous version). A failure while buckets stream in (a lost peer, a corrupt file)
leaves ``weight_version`` unchanged; tensors copied before it may be new, so the next successful
sync must be a complete one, as every sync is. A broadcast receiver that rejects a version still
drains that version's buckets, so the trainer and the other receivers are not left hanging.

*Transports* (all report `SyncMetrics`: seconds, bytes, buckets):

====================  =====================================  ==========================================
in-process            `InProcessPublisher`                   direct ``update_weights`` on engines in the
                                                             trainer's process (colocated mode)
torch.distributed     `weight_broadcast.BroadcastPublisher`  manifest, then one flat buffer per dtype per
broadcast             / `weight_broadcast.BroadcastReceiver` bucket, over a dedicated group of 1 trainer
                                                             + N engine processes (gloo / NCCL)
disk                  `weight_disk.DiskPublisher`            ``<dir>/v{version:08d}/bucket_{i:05d}
                      / `weight_disk.DiskReceiver`           .safetensors`` + ``manifest.json`` written
                                                             last; the last K versions are kept
====================  =====================================  ==========================================
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

NamedTensors = list[tuple[str, torch.Tensor]]
# The pause a weight update holds on an engine: its own owner, so an operator's pause outlives the update.
PAUSE_WEIGHT_UPDATE = "weight_update"


class WeightTarget(Protocol):
    """What weight sync needs of an engine (every `relax.backends.inference.base.InferenceEngine` is one): this
    layer speaks to engines through this protocol, never importing them."""

    weight_version: int
    weight_run: str | None

    async def pause(self, owner: str = ...) -> None: ...

    async def resume(self, owner: str = ...) -> None: ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...
# Upstream's --update-weight-buffer-size default.
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


class WeightSyncError(RuntimeError):
    """A version could not be applied; the engine still serves the version it served before."""

    def __init__(self, message: str, version: int | None = None, tensor: str | None = None) -> None:
        super().__init__(message)
        self.version = version
        self.tensor = tensor


# ----------------------------------------------------------------------------- manifest


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the manifest's spelling)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"manifest names an unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver needs to allocate and check one tensor without seeing it."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), dtype_name(tensor.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


@dataclass(frozen=True)
class Manifest:
    """One version of the weights: tensor specs per bucket, in the order they are sent."""

    version: int
    buckets: tuple[tuple[TensorSpec, ...], ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_buckets(cls, version: int, buckets: Sequence[NamedTensors], meta: dict[str, Any] | None = None) -> Manifest:
        specs = tuple(tuple(TensorSpec.of(name, tensor) for name, tensor in bucket) for bucket in buckets)
        return cls(version, specs, dict(meta or {}))

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for bucket in self.buckets for spec in bucket)

    def tensor_specs(self) -> Iterator[TensorSpec]:
        return itertools.chain.from_iterable(self.buckets)

    def to_json(self) -> str:
        return json.dumps({
            "version": self.version,
            "meta": self.meta,
            "buckets": [[[spec.name, list(spec.shape), spec.dtype] for spec in bucket] for bucket in self.buckets],
        })

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            data = json.loads(text)
            buckets = tuple(
                tuple(TensorSpec(str(name), tuple(int(d) for d in shape), str(dtype)) for name, shape, dtype in bucket)
                for bucket in data["buckets"]
            )
            return cls(int(data["version"]), buckets, dict(data.get("meta") or {}))
        except (ValueError, KeyError, TypeError) as error:
            raise WeightSyncError(f"unreadable weight-sync manifest: {error}") from error


def engine_weight_specs(engine: Any) -> dict[str, TensorSpec] | None:
    """Names, shapes and dtypes of the weights an engine can take, when it holds its model in this process
    (`EmbeddedEngine.model`); None for engines that check names themselves (HTTP adapters)."""
    model = getattr(engine, "model", None)
    if not isinstance(model, torch.nn.Module):
        return None
    named = itertools.chain(model.named_buffers(remove_duplicate=False), model.named_parameters(remove_duplicate=False))
    return {name: TensorSpec.of(name, tensor) for name, tensor in named}


def engine_parameter_names(engine: Any) -> list[frozenset[str]] | None:
    """The parameters an engine holds in this process, each as the set of names it answers to (tied parameters,
    such as ``lm_head.weight`` and ``model.embed_tokens.weight``, are one tensor under two names); None for engines
    that hold no model here. A complete update names at least one name of every set."""
    model = getattr(engine, "model", None)
    if not isinstance(model, torch.nn.Module):
        return None
    names: dict[int, set[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), set()).add(name)
    return [frozenset(group) for group in names.values()]


INITIAL_VERSION = 0  # the checkpoint a run starts from: a new run may send it to engines that served a later one
# Who published a version: one id per trainer process, written into each manifest (`DiskPublisher`). Versions never
# go backwards within one publisher; a new one (a run resumed by a restart, from a checkpoint older than what the
# engines last served) starts its own sequence.
RUN_META_KEY = "run"


def goes_backwards(version: int, served_version: int, new_run: bool = False) -> bool:
    """Versions never go backwards within a run; version 0 starts a new one (a fresh run pushing its initial weights
    into servers that served another run's later versions), and so does a version from a new publisher
    (``new_run``: a run resumed from its checkpoint after a restart re-trains from an older version)."""
    return not new_run and version != INITIAL_VERSION and version < served_version


def from_new_run(manifest: Manifest, served_run: str | None) -> bool:
    """The manifest comes from another publisher than the served weights did."""
    run = manifest.meta.get(RUN_META_KEY)
    return run is not None and run != served_run


def check_manifest(
    manifest: Manifest, expected_version: int | None = None, expected: dict[str, TensorSpec] | None = None,
    served_version: int | None = None, served_run: str | None = None,
) -> None:
    """Raise `WeightSyncError` if ``manifest`` cannot be applied as a whole; checked before the
    engine is touched, so a rejected version leaves it serving the previous one. With ``expected``
    (`engine_weight_specs`), every tensor must exist there with the same shape, and a floating-point
    target must get floating-point values (any precision: the engine casts). A version older than
    ``served_version`` is refused unless it comes from a new run (``served_run``: the publisher of the served
    weights): versions never go backwards (`goes_backwards`)."""
    version = manifest.version
    if expected_version is not None and version != expected_version:
        raise WeightSyncError(
            f"weight sync: manifest says version {version}, the receiver expected version {expected_version}",
            version=version,
        )
    if served_version is not None and goes_backwards(version, served_version, from_new_run(manifest, served_run)):
        raise WeightSyncError(f"weight sync: version {version} is older than the served version {served_version}",
                              version=version)
    seen: set[str] = set()
    for spec in manifest.tensor_specs():
        if spec.name in seen:
            raise WeightSyncError(f"weight sync version {version}: tensor {spec.name!r} appears twice in the manifest",
                                  version=version, tensor=spec.name)
        seen.add(spec.name)
        dtype = spec.torch_dtype  # raises on an unknown dtype
        if expected is None:
            continue
        target = expected.get(spec.name)
        if target is None:
            raise WeightSyncError(f"weight sync version {version}: the engine's model has no tensor named "
                                  f"{spec.name!r}", version=version, tensor=spec.name)
        if target.shape != spec.shape:
            raise WeightSyncError(f"weight sync version {version}: tensor {spec.name!r} has shape {spec.shape} in "
                                  f"the manifest, the engine expects {target.shape}",
                                  version=version, tensor=spec.name)
        if target.torch_dtype.is_floating_point and not dtype.is_floating_point:
            raise WeightSyncError(f"weight sync version {version}: tensor {spec.name!r} is {spec.dtype}, the engine "
                                  f"holds {target.dtype} (a floating-point tensor)", version=version, tensor=spec.name)


def check_bucket(manifest: Manifest, index: int, bucket: NamedTensors) -> None:
    """Raise `WeightSyncError` unless ``bucket`` holds exactly the tensors manifest bucket ``index`` lists."""
    specs = manifest.buckets[index]
    received = {name: tensor for name, tensor in bucket}
    for spec in specs:
        tensor = received.get(spec.name)
        if tensor is None:
            raise WeightSyncError(f"weight sync version {manifest.version}: tensor {spec.name!r} of bucket {index} "
                                  "is missing", version=manifest.version, tensor=spec.name)
        if TensorSpec.of(spec.name, tensor) != spec:
            raise WeightSyncError(
                f"weight sync version {manifest.version}: tensor {spec.name!r} of bucket {index} is "
                f"{tuple(tensor.shape)} {dtype_name(tensor.dtype)}, the manifest says {spec.shape} {spec.dtype}",
                version=manifest.version, tensor=spec.name,
            )
    extra = sorted(set(received) - {spec.name for spec in specs})
    if extra:
        raise WeightSyncError(f"weight sync version {manifest.version}: bucket {index} holds tensor {extra[0]!r}, "
                              "which the manifest does not list", version=manifest.version, tensor=extra[0])


# ----------------------------------------------------------------------------- metrics


@dataclass
class SyncMetrics:
    """What one sync cost, as seen by the side that reports it."""

    transport: str
    version: int
    seconds: float = 0.0
    bytes: int = 0
    buckets: int = 0

    def as_dict(self, prefix: str = "perf/weight_sync") -> dict[str, float]:
        return {f"{prefix}_s": self.seconds, f"{prefix}_bytes": float(self.bytes),
                f"{prefix}_buckets": float(self.buckets)}


class _CountingBuckets:
    """Flattens buckets into named tensors while counting buckets and bytes for `SyncMetrics`."""

    def __init__(self, buckets: Iterable[NamedTensors]) -> None:
        self._buckets = buckets
        self.buckets = 0
        self.bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self._buckets:
            self.buckets += 1
            for name, tensor in bucket:
                self.bytes += tensor.numel() * tensor.element_size()
                yield name, tensor


# ----------------------------------------------------------------------------- engine side


async def apply_to_engine(engine: WeightTarget, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Pause, flush, update, resume: the one place an engine's weights change.

    ``named_tensors`` may be a lazy stream (a receiver pulling buckets off the wire); it is consumed
    inside one ``update_weights`` call so the version switches only once the last bucket landed.
    """
    await engine.pause(PAUSE_WEIGHT_UPDATE)  # its own hold: an operator's pause outlives the update
    try:
        flush_cache = getattr(engine, "flush_cache", None)
        if flush_cache is not None:
            await flush_cache()
        await engine.update_weights(named_tensors, version)
    finally:
        await engine.resume(PAUSE_WEIGHT_UPDATE)


# ----------------------------------------------------------------------------- trainer side


class WeightPublisher(Protocol):
    """The trainer's end of a transport."""

    transport: str

    async def publish(
        self, buckets: Iterable[NamedTensors], version: int, meta: dict[str, Any] | None = None
    ) -> SyncMetrics: ...


def bucketize(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[NamedTensors]:
    """Group tensors into buckets that close once they reach ``bucket_bytes``, cast to ``dtype``
    (``FSDPTrainBackend.named_parameters_for_sync`` buckets its gathered parameters with it)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes (--update-weight-buffer-size) must be >= 1, got {bucket_bytes}")
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named_tensors:
        tensor = tensor.detach() if dtype is None else tensor.detach().to(dtype)
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


class InProcessPublisher:
    """Transport 1: engines living in the trainer's process get the tensors by direct call.

    Names and shapes are checked by the engine itself as the tensors arrive (nothing is serialised,
    so there is no manifest to check first). With several engines the buckets are materialised
    once and reused; with one engine they stream.
    """

    transport = "in_process"

    def __init__(self, engines: WeightTarget | Sequence[WeightTarget]) -> None:
        self.engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]

    async def publish(
        self, buckets: Iterable[NamedTensors], version: int, meta: dict[str, Any] | None = None
    ) -> SyncMetrics:
        started = time.perf_counter()
        if len(self.engines) > 1:
            buckets = [list(bucket) for bucket in buckets]
        counted = None
        for engine in self.engines:
            counted = _CountingBuckets(buckets)
            await apply_to_engine(engine, version, counted)
        metrics = SyncMetrics(self.transport, version, time.perf_counter() - started)
        if counted is not None:
            metrics.bytes, metrics.buckets = counted.bytes, counted.buckets
        return metrics


class WeightSource(Protocol):
    def weight_buckets(self, dtype: torch.dtype, bucket_bytes: int) -> Iterator[NamedTensors]: ...


class WeightSink(Protocol):
    async def update_weights(self, named_tensors, version: int) -> None: ...


async def sync_weights_in_process(
    source: WeightSource, sink: WeightSink, version: int, dtype: torch.dtype, bucket_bytes: int
) -> dict[str, float]:
    """Copy all weights from ``source`` to ``sink`` as ``version``; returns timing metrics.

    The colocated controller's path: ``sink`` is the rollout role (which forwards to its engine)
    and nothing is generating during the sync, so there is no pause; `InProcessPublisher` is the
    same transport for engines that may be serving.
    """
    started = time.perf_counter()
    counted = _CountingBuckets(source.weight_buckets(dtype, bucket_bytes))
    await sink.update_weights(counted, version)
    metrics = SyncMetrics(InProcessPublisher.transport, version, time.perf_counter() - started,
                          counted.bytes, counted.buckets)
    return metrics.as_dict()
