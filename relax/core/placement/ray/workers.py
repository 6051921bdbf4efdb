"""The worker that holds one role in its own Ray process (``--placement ray``).

`RoleWorker` is made a Ray actor by `relax.core.placement.ray.service` (one per role replica). In its process it
builds its own role alone, with the builders in-process placement uses (`relax.core.build.ROLE_BUILDERS`), so the
role objects are identical; its async methods mirror the role's API (generate / evaluate / train /
compute_log_probs / compute_values / save / load / health) plus the weight-sync ends and, for the async modes, a
rollout that writes straight into TransferQueue. The loops call it through the proxies of
`relax.core.placement.ray.proxies`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import ray
import torch

from relax.core import build, rollout_parts, run_settings
from relax.core.engines.scaling_service import rollout_process_scale_manager, start_scaling_server
from relax.core.placement.ray.proxies import RayJudge
from relax.core.state.health import HEARTBEAT_DIR, Heartbeat
from relax.core.streaming.chunks import chunk_fields, chunk_report, concat_fields
from relax.core.streaming.roles import generate_group_by_group, stream_role
from relax.data_plane import StalenessGate
from relax.data_plane.tq_plane import TransferQueueDataPlane
from relax.distributed.process_group import PG_INIT_METHOD_ENV
from relax.distributed.weight_broadcast import BroadcastPublisher, BroadcastReceiver, WeightSyncGroup
from relax.distributed.weight_disk import DiskFollower, DiskPublisher, DiskReceiver
from relax.distributed.weight_sync import dtype_from_name
from relax.utils.heap import freeze_long_lived_objects

logger = logging.getLogger("relax")


def log_to_run_log(run_dir: Path, role: str) -> None:
    """A role's process writes its log records to the run's run.log too (appending beside the controller's), so a
    warning raised there (an engine relaunched by the rollout role's router, a role's own error) is in the run's
    log, not only in Ray's worker logs."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "run.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s %(name)s [{role} role]: %(message)s"))
    handler.setLevel(logging.INFO)
    relax_logger = logging.getLogger("relax")
    relax_logger.addHandler(handler)
    relax_logger.setLevel(logging.INFO)


def process_label(name: str, rank: int) -> str:
    """How a role's process is named (heartbeats, logs, the service's worker table): ``actor``, ``actor-1``, ..."""
    return f"{name}-{rank}" if rank else name


class RoleWorker:
    """One role in its own process; ``name`` is ``actor``, ``rollout``, ``critic`` or ``reference``.

    ``group`` = ``(rank, world_size, init_method)`` makes it one rank of a role spread over several processes: the
    role's FSDP2 process group is the default group of these processes (torchrun's variables and the rendezvous,
    ``file://`` on one node or ``tcp://`` across nodes, set before the role is built), every rank receives the whole
    batch and trains on its share. ``judge``: the Ray name of the GenRM judge's process, which the rollout's rewards
    ask for verdicts; ``with_reference``: an actor that holds the reference beside the policy (--hybrid)."""

    def __init__(self, name: str, cfg: Any, total_steps: int, group: tuple[int, int, str] | None = None,
                 judge: str | None = None, with_reference: bool = False) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.rank = 0
        if group is not None:
            self.rank, world_size, init_method = group
            # Ray gives each process its own GPU as device 0 (CUDA_VISIBLE_DEVICES)
            os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
                               PG_INIT_METHOD_ENV: init_method})

        self.name = name
        self.cfg = cfg
        label = process_label(name, self.rank)
        log_to_run_log(Path(cfg.output_dir), label)
        self._heartbeat = None
        if cfg.use_health_check:  # beats from a thread: a long training step still beats, a stopped process not

            self._heartbeat = Heartbeat(Path(cfg.output_dir) / HEARTBEAT_DIR, label).start()
        device = run_settings.resolve_device(cfg)
        if device.type == "cpu":
            torch.set_num_threads(1)  # roles share the machine's cores; one thread each
        ctx = build.build_context(cfg, total_steps)
        self._engine_settings = (ctx.tokenizer, ctx.device, ctx.dtype)  # what a scaled-out engine is built with
        self.reference = None  # --hybrid: the reference beside the policy in the actor's processes (upstream's)
        self._advantages = None  # the actor's: group-local advantages of the chunks it reads itself
        if name == "rollout" and judge:  # with a judge process (--resource genrm), the rewards ask it for verdicts
            self.role = build.build_rollout(ctx, rewards=rollout_parts.build_reward_computer(cfg, remote=RayJudge(judge)))
        elif name in build.ROLE_BUILDERS:
            self.role = build.ROLE_BUILDERS[name](ctx)
        else:
            raise ValueError(f"no Ray worker for role {name!r}")
        if name == "actor":
            self._advantages = build.build_advantages(ctx)
            if with_reference:
                self.reference = build.build_reference(ctx)
        self._sync_group = None
        self._plane = None
        self._scaling_server = None
        self._between_calls = asyncio.Lock()  # held while the engines generate: no weight load lands inside
        self._follower = None
        freeze_long_lived_objects()  # the role and its imports live as long as this process

    # ---- every role -----------------------------------------------------------------------
    async def health(self) -> dict:
        """Role name, pid, node address, and for the rollout the engine's weight version."""
        report = {"role": self.name, "rank": self.rank, "pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(),
                  "torch_threads": torch.get_num_threads()}
        if self.name == "rollout":
            # (a reward model's run has no engine)
            report["weight_version"] = self.role.engine.weight_version if self.role.engine is not None else None
            report["eval_sets"] = {name: len(samples) for name, samples in self.role.eval_sets.items()}
        return report

    async def save(self, directory: str, include_optimizer: bool = True) -> None:
        self.role.save(Path(directory), include_optimizer=include_optimizer)

    async def load(self, directory: str) -> None:
        self.role.load(Path(directory))

    async def hf_config(self) -> Any:
        return self.role.backend.hf_config

    # ---- actor / reference / critic ---------------------------------------------------------
    async def compute_log_probs(self, samples, gather_ids=None):
        if self.name == "reference":
            return await self.role.compute_log_probs(samples)
        return await self.role.compute_log_probs(samples, gather_ids)

    async def reference_log_probs(self, samples):
        """The reference's log-probs, from the reference this actor process holds (--hybrid)."""
        return await self.reference.compute_log_probs(samples)

    async def compute_values(self, samples):
        return await self.role.compute_values(samples)

    async def stream_role_step(self, step: int) -> int:
        """This role as a streaming role (``--fully-async``; the reference or the advantages): reads the groups of
        partition ``train_{step}`` from TransferQueue as rollout writes them and writes its field back, in this
        process (the samples never pass through the controller)."""
        return await stream_role(self._data_plane(), self.name, self.role, step)

    # ---- advantages / the judge ----------------------------------------------------------------
    async def compute_advantages(self, samples, log_probs=None, ref_log_probs=None, values=None):
        return await self.role.compute(samples, log_probs, ref_log_probs, values)

    async def verdict(self, sample) -> float:
        """The judge's verdict on ``sample`` (its prompt, response, label and index); concurrent calls decode as
        one batch in this process's engine."""
        return await self.role(None, sample)

    async def train(self, samples, *args):
        """Actor: ``(samples, fields, gather_ids)``; critic: ``(samples, returns, old_values)``."""
        return await self.role.train(samples, *args)

    async def streamed_step_unsupported(self, num_samples: int) -> str | None:
        return await self.role.streamed_step_unsupported(num_samples)

    async def train_chunk(self, step: int, samples, fields, expected_samples: int, last: bool) -> None:
        await self.role.train_chunk(step, samples, fields, expected_samples, last)

    async def finish_streamed_step(self, step: int) -> dict[str, float]:
        return await self.role.finish_streamed_step(step)

    async def train_chunk_rows(self, step: int, rows, samples, fields, expected_samples: int, last: bool,
                               needs: tuple[str, ...], dump_limit: int):
        """A chunk of step ``step`` given as TransferQueue ``rows`` (the controller passes keys, not payloads) and
        ``samples`` with their ``fields`` (groups read whole before): this process reads the rows with the streamed
        fields ``needs``, computes their TIS and group-local advantage fields, and trains on the whole chunk; the
        controller gets a `ChunkReport`."""
        read = await self._data_plane().samples_of(rows, needs)
        read_fields = await chunk_fields(read, self._advantages, self.cfg.use_tis) if read else {}
        batch, batch_fields = read + samples, concat_fields(read_fields, fields)
        await self.role.train_chunk(step, batch, batch_fields, expected_samples, last)
        return chunk_report(batch, batch_fields, needs, dump_limit, by_key=len(read))

    # ---- rollout ------------------------------------------------------------------------------
    async def generate(self, rollout_id: int):
        async with self._engine_calls():
            return await self.role.generate(rollout_id)

    async def evaluate(self, step: int):
        async with self._engine_calls():
            return await self.role.evaluate(step)

    async def follow_published_weights(self, root: str, run: str) -> None:
        """From now on the engines load each version the actor publishes under ``root`` as ``run`` by themselves,
        between generations (the trainer publishes and goes on: `relax.distributed.weight_disk.DiskFollower`)."""
        if self._follower is None:
            self._follower = DiskFollower(root, self.role.engine, self._between_calls, run=run)
            self._follower.start()

    async def catch_up_with_published_weights(self) -> int:
        """Load the newest published version now (the end of a run); the version the engines serve."""
        async with self._engine_calls():
            return self.role.engine.weight_version

    @contextlib.asynccontextmanager
    async def _engine_calls(self):
        """A generation with the newest published weights (when following them), and no weight load during it."""
        async with self._between_calls:
            if self._follower is not None:
                await self._follower.catch_up()
            yield

    async def start_scaling_api(self) -> None:
        """Serve the engines' scaling API (--rollout-api-port) from this process, which holds the engines; the
        operations run on this process's event loop, beside the generations."""
        manager = rollout_process_scale_manager(self.cfg, self.role, *self._engine_settings, asyncio.get_running_loop())
        self._scaling_server = await start_scaling_server(self.cfg, manager)

    async def eval_set(self, name: str) -> list:
        return await self.role.eval_set(name)

    async def data_source_state(self) -> dict:
        return self.role.data_source.state_dict()

    async def take_data(self, count: int) -> tuple[int, list]:
        """The next ``count`` rows at the cursor (SFT samples, preference pairs): the loops that train on the
        dataset take them from the process that holds the data source."""
        return self.role.data_source.take(count)

    async def load_data_source_state(self, state: dict) -> None:
        self.role.data_source.load_state_dict(state)

    async def generate_into_plane(self, rollout_id: int) -> tuple[dict, dict]:
        """Generate step ``rollout_id`` and write its groups into TransferQueue partition
        ``train_{rollout_id}`` (then the end marker); returns the rollout metrics and the data
        cursor after this step. The samples never pass through the controller's process."""
        plane = self._data_plane()
        try:
            async with self._engine_calls():
                metrics = await generate_group_by_group(self.role, plane, rollout_id)
            if self._follower is not None:
                metrics.update(self._follower.pop_metrics())
        finally:
            await plane.mark_complete(rollout_id)
        return metrics, self.role.data_source.state_dict()

    def _data_plane(self):
        if self._plane is None:
            self._plane = TransferQueueDataPlane(StalenessGate(self.cfg.max_staleness))
        return self._plane

    async def engine_weights(self) -> dict[str, torch.Tensor]:
        """The engine's parameters and buffers (for checks: weights after a sync)."""
        return {name: tensor.detach().cpu().clone() for name, tensor in self.role.engine.model.state_dict().items()}

    # ---- weight sync --------------------------------------------------------------------------
    async def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    async def join_weight_sync_group(self, host: str, port: int, rank: int, world_size: int, backend: str,
                                     timeout_s: float) -> None:
        self._sync_group = WeightSyncGroup.init(host, port, rank, world_size, backend=backend, timeout_s=timeout_s)

    async def publish_weights(self, version: int, transport: str, dtype: str, bucket_bytes: int,
                              root: str | None = None, run: str | None = None) -> dict[str, float]:
        """The actor's end: push every weight as ``version`` (broadcast to the group, or to disk)."""
        buckets = self.role.weight_buckets(dtype_from_name(dtype), bucket_bytes)
        if self.rank:  # gathering a full tensor is a collective of every rank; rank 0 alone sends it
            for _ in buckets:
                pass
            return {}
        if transport == "broadcast":
            metrics = await BroadcastPublisher(self._sync_group).publish(buckets, version, {"role": self.name})
        else:
            metrics = await DiskPublisher(root, keep_last=2, run=run).publish(buckets, version, {"role": self.name})
        return metrics.as_dict()

    async def receive_weights(self, version: int, transport: str, root: str | None = None) -> dict[str, float]:
        """The rollout's end: apply version ``version`` to the engine (the version switches last)."""
        if transport == "broadcast":
            metrics = await BroadcastReceiver(self._sync_group, self.role.engine).receive(expected_version=version)
        else:
            metrics = await DiskReceiver(root, self.role.engine).apply(version)
        return metrics.as_dict(prefix="perf/weight_receive")

    async def trainer_weights(self, dtype: str) -> dict[str, torch.Tensor]:
        """The actor's weights in Hugging Face naming, as a sync would send them (for checks)."""
        return {name: tensor.detach().cpu().clone()
                for bucket in self.role.weight_buckets(dtype_from_name(dtype), 1 << 30) for name, tensor in bucket}

    async def close(self) -> None:
        if self._follower is not None:
            await self._follower.close()
            self._follower = None
        if self._scaling_server is not None:
            self._scaling_server.stop()
            self._scaling_server = None
        close_engines = getattr(getattr(self.role, "engine", None), "aclose", None)
        if self.name == "rollout" and close_engines is not None:  # a Serve deployment it started, HTTP clients
            await close_engines()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._sync_group is not None:
            self._sync_group.close()
            self._sync_group = None
