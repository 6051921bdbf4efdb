"""Service: Ray placement of the roles (``--placement ray``).

`RayService.start` starts a local Ray bound to 127.0.0.1 (or joins ``--ray-address``), reserves a
placement group with one bundle per role replica from ``--resource`` (GPUs per replica, or CPUs
on a machine without GPUs), starts one `RoleWorker` Ray actor per role the run needs
(`relax.core.roles`), wires the weight-sync transport between the actor and the rollout, and,
for the async modes, a TransferQueue controller. It returns `RayRoles`: the `Roles` the
controllers already drive, with proxies in place of the role objects. `shutdown` ends all of it.

Plain Ray actors rather than Ray Serve deployments for these roles: the actor's process group and the weight-sync
group need fixed, long-lived members that Serve (which replaces replicas at will) does not give, and the controller
is each role's only caller, so Serve's proxy and router would add processes without use. The rollout *engines* are
where replication pays: they are a Serve deployment with ``--rollout-serve-replicas`` (`relax.core.engines.serve_deployment`;
docs/placement.md says what was tried).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from relax.config import ConfigError, RelaxConfig, flag
from relax.core.build import build_advantages, build_context, needs_reference
from relax.core.placement.ray.proxies import (
    RemoteActor,
    RemoteAdvantages,
    RemoteCritic,
    RemoteReference,
    RemoteRollout,
    named_call,
    settle_calls,
)
from relax.core.placement.ray.workers import RoleWorker, process_label
from relax.core.roles import PLACEABLE_ROLES, Roles, roles_for_config
from relax.data_plane.tq_plane import start_local_transfer_queue, transfer_queue_actors
from relax.distributed.process_group import free_loopback_port
from relax.serving.server import resolve_api_key
from relax.utils.local_ray import set_local_ray_environment, start_local_ray
from relax.utils.memory import free_bytes
from relax.utils.urls import redact_url

logger = logging.getLogger("relax")

START_TIMEOUT_S = 300.0  # Ray's reservation of the roles' resources; a call to a started role
# Building a role in its process: importing torch and loading its model, minutes for a large model from network
# storage or on a busy machine. A hang guard only: a build that fails raises at once with the worker's traceback.
ROLE_BUILD_TIMEOUT_S = 1800.0
# What one role process takes before its model: an interpreter that imported torch, transformers and Relax's role
# worker (0.41 GiB resident, measured on Linux on 2026-12-07).
ROLE_PROCESS_BYTES = 400 * 2**20
SYNC_GROUP_TIMEOUT_S = 120.0


@dataclass
class RayRoles(Roles):
    """`Roles` whose model-holding roles are proxies of Ray actors; ``service`` owns them."""

    service: RayService | None = None


def config_for_workers(cfg: RelaxConfig) -> RelaxConfig:
    """The config the Ray processes get: with the scaling API's token of ``$RELAX_API_KEY`` filled in here, in
    `relax train`. The rollout's Ray process serves the API and may run on a node (--ray-address) whose environment
    never had the variable: reading it there served the API open."""
    if cfg.rollout_api_port is not None and cfg.rollout_api_key is None and resolve_api_key(None):
        return cfg.model_copy(update={"rollout_api_key": resolve_api_key(None)})
    return cfg


def bundle_for(per_replica: float, use_gpus: bool) -> dict[str, float]:
    """One replica's reservation: GPUs (plus one CPU for the process) or, without GPUs, CPUs (at least one:
    upstream writes `[1, 0]` for a role without a GPU)."""
    if use_gpus and per_replica > 0:
        return {"GPU": per_replica, "CPU": 1.0}
    return {"CPU": max(per_replica, 1.0)}


def placed_roles(cfg: RelaxConfig) -> list[str]:
    """The roles that get a Ray process: those the run needs among `PLACEABLE_ROLES`, and the light ones that
    have a home by default (advantages: the controller; the judge: the rollout's process) when --resource names
    them."""
    needed = roles_for_config(cfg)
    placed = [name for name in PLACEABLE_ROLES if name in needed]
    if "advantages" in needed and "advantages" in cfg.resource:
        placed.append("advantages")
    if cfg.genrm_model_path is not None and "genrm" in cfg.resource:
        placed.append("genrm")
    return placed


class RayService:
    def __init__(self, cfg: RelaxConfig) -> None:
        self.cfg = cfg
        self.use_gpus = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        self.workers: dict[str, Any] = {}
        self.placement_group = None
        self.started_ray = False
        self.started_transfer_queue = False
        self.transfer_queue_handles: dict[str, Any] = {}
        self.sync_dtype: torch.dtype | None = None
        self.weight_root = Path(cfg.output_dir) / "weight_sync"
        # This run's name in the versions it publishes there; the engines follow only these (a resumed run's
        # directory may hold a dead run's newer versions, which must never be served).
        self.weight_run = uuid.uuid4().hex
        self.reference_in_actor = False

    @property
    def async_mode(self) -> bool:
        return self.cfg.fully_async or self.cfg.hybrid

    # ---- start ------------------------------------------------------------------------------
    def start(self) -> RayRoles:
        self.cfg = config_for_workers(self.cfg)
        cfg = self.cfg
        ctx = build_context(cfg)  # validates inputs before any process starts; tokenizer and steps for the driver
        self.total_steps = ctx.total_steps  # the workers get the run's length: only the rollout reads the prompts
        self.sync_dtype = ctx.dtype
        roles = placed_roles(cfg)
        advantages = build_advantages(ctx)
        # --hybrid (upstream's): the reference lives in the actor's processes, beside the policy
        self.reference_in_actor = cfg.hybrid and needs_reference(cfg, advantages)
        if self.reference_in_actor and "reference" in cfg.resource:
            raise ConfigError(f"{flag('resource')} reference: with --hybrid the reference runs in the actor's "
                              "processes, beside the policy (upstream's hybrid); drop the entry, the actor's "
                              "resources hold it")
        if "reference" in roles and (self.reference_in_actor or not needs_reference(cfg, advantages)):
            roles.remove("reference")
        check_resource_covers(cfg, roles)
        if cfg.ray_address:
            check_ray_address(cfg.ray_address)
        else:
            check_machine_holds(cfg, roles, self.use_gpus)
        try:
            self._start_ray(roles)
            self._start_workers_and_transfer_queue(roles)
            if cfg.resolved_weight_sync_transport == "broadcast" and cfg.loss_type != "rm":  # (rm: no engine)
                self._join_weight_sync_group()
            if cfg.rollout_api_port is not None:  # the engines live in the rollout's process: it serves the API
                self._wait(self.workers["rollout"].start_scaling_api.remote())
            health = self._wait(self.workers["rollout"].health.remote())
        except BaseException:
            self.shutdown()
            raise
        logger.info("Ray placement: %s", {name: self._wait(w.health.remote())["pid"] for name, w in self.workers.items()})
        return RayRoles(
            tokenizer=ctx.tokenizer,
            rollout=RemoteRollout(self.workers["rollout"], health["eval_sets"]),
            actor=RemoteActor(self.ranks("actor"), cfg.train_batch_size),
            advantages=RemoteAdvantages(self.workers["advantages"], advantages) if "advantages" in self.workers
            else advantages,
            reference=(RemoteReference(self.ranks("reference")) if "reference" in self.workers
                       else RemoteReference(self.ranks("actor"), inside="actor") if self.reference_in_actor else None),
            total_steps=ctx.total_steps, device=ctx.device, inference_dtype=ctx.dtype,
            critic=RemoteCritic(self.ranks("critic")) if "critic" in self.workers else None,
            service=self,
        )

    def replicas(self, name: str) -> int:
        return int(self.cfg.resource.get(name, [1, 1])[0])

    def ranks(self, name: str) -> list[Any]:
        """The processes of role ``name`` in rank order."""
        return [self.workers[process_label(name, rank)] for rank in range(self.replicas(name))]

    def _start_ray(self, roles: list[str]) -> None:
        set_local_ray_environment()
        if not ray.is_initialized():
            # Workers import `relax` and dotted-path plugins (reward functions) as this process does.
            paths = [os.getcwd(), *(p for p in sys.path if p and os.path.isdir(p))]
            env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "OMP_NUM_THREADS": "1",
                   "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false"}
            if self.cfg.ray_address:
                ray.init(address=self.cfg.ray_address, runtime_env={"env_vars": env}, log_to_driver=False,
                         logging_level="warning")
            else:
                # Logical CPUs: the bundles, plus TransferQueue's controller and storage unit, whatever the cores.
                # and the rollout engines' Serve replicas (one CPU each) and Serve's controller
                reserved = (sum(self._bundle(name).get("CPU", 0) * self.replicas(name) for name in roles) + 3
                            + (self.cfg.rollout_serve_replicas + 1 if self.cfg.rollout_serve_replicas else 0))
                start_local_ray(max(8, int(reserved + 0.999)), runtime_env={"env_vars": env})
            self.started_ray = True

    def _start_workers_and_transfer_queue(self, roles: list[str]) -> None:
        """The role processes and (async modes) TransferQueue's controller and storage unit start at once: each is
        mostly a Python process importing torch, and TransferQueue starts its two one after the other (5 of a
        12 s start on two cores); the workers attach to it only when they first stream."""
        if not self.async_mode:
            self._start_workers(roles)
            return
        # Leaving the pool waits for TransferQueue's start, also when a worker failed: the shutdown of a failed
        # start must see what it started.
        with ThreadPoolExecutor(1, thread_name_prefix="relax-transfer-queue-start") as pool:
            transfer_queue = pool.submit(self._start_transfer_queue)
            self._start_workers(roles)
        transfer_queue.result()

    def _bundle(self, name: str) -> dict[str, float]:
        _, per_replica = self.cfg.resource.get(name, [1, 1])
        return bundle_for(float(per_replica), self.use_gpus)

    def _start_workers(self, roles: list[str]) -> None:
        processes = [(name, rank) for name in roles for rank in range(self.replicas(name))]
        bundles = [self._bundle(name) for name, _ in processes]
        self.placement_group = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.placement_group.ready(), timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(f"{flag('resource')}: Ray could not reserve {bundles} within {START_TIMEOUT_S:.0f} s; "
                              f"the cluster has {ray.cluster_resources()}") from None
        # A role on several processes: one process group over them
        rendezvous = {name: self._rendezvous(name, [processes.index((name, rank)) for rank in range(self.replicas(name))])
                      for name in roles if self.replicas(name) > 1}
        worker_class = ray.remote(RoleWorker)
        # The judge's process starts first, under a name of this run: the rollout's rewards call it by that name.
        judge = f"relax-genrm-{uuid.uuid4().hex[:12]}" if "genrm" in roles else None
        order = sorted(range(len(processes)), key=lambda i: processes[i][0] != "genrm")
        for index in order:
            (name, rank), bundle = processes[index], bundles[index]
            group = (rank, self.replicas(name), rendezvous[name]) if name in rendezvous else None
            self.workers[process_label(name, rank)] = worker_class.options(
                name=judge if name == "genrm" else None, num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                max_concurrency=16 if name != "genrm" else 256,  # the judge batches many verdicts at once
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                     placement_group_bundle_index=index),
            ).remote(name, self.cfg, self.total_steps, group, judge, name == "actor" and self.reference_in_actor)
        # Building a role loads its model; a failure surfaces here with the worker's traceback.
        for name, worker in self.workers.items():
            self._wait(worker.health.remote(), ROLE_BUILD_TIMEOUT_S)

    def _rendezvous(self, name: str, bundles: list[int]) -> str:
        """Where the processes of role ``name`` (in ``bundles``) meet: a fresh file when they share one node (no
        port: one picked here could be taken before rank 0 binds it), else a TCP port on rank 0's node."""
        nodes = placement_group_table(self.placement_group)["bundles_to_node_id"]
        if len({nodes[index] for index in bundles}) == 1:
            path = Path(self.cfg.output_dir).resolve() / ".process_groups" / f"{name}-{uuid.uuid4().hex}"
            path.parent.mkdir(parents=True, exist_ok=True)
            return f"file://{path}"
        address = next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == nodes[bundles[0]])
        return f"tcp://{address}:{29500 + os.getpid() % 1000}"

    def _start_transfer_queue(self) -> None:
        start_local_transfer_queue(num_storage_units=1)  # Ray is up: this starts the TQ controller only
        self.started_transfer_queue = True
        # Looked up now, while they answer: a lookup asks the controller, which may be the process that stopped
        self.transfer_queue_handles = transfer_queue_actors()

    def _join_weight_sync_group(self) -> None:
        actor, rollout = self.workers["actor"], self.workers["rollout"]
        host = self._wait(actor.node_ip.remote())
        port = free_loopback_port() if host == "127.0.0.1" else 29500 + os.getpid() % 1000
        backend = "nccl" if self.use_gpus else "gloo"
        joins = [worker.join_weight_sync_group.remote(host, port, rank, 2, backend, SYNC_GROUP_TIMEOUT_S)
                 for rank, worker in enumerate((actor, rollout))]
        ray.get(joins, timeout=SYNC_GROUP_TIMEOUT_S + 10)

    # ---- weight sync ----------------------------------------------------------------------
    async def sync_weights(self, version: int) -> dict[str, float]:
        """Push the actor's weights to the rollout's engine as ``version`` over the configured transport."""
        started = time.perf_counter()
        transport = self.cfg.resolved_weight_sync_transport
        dtype = str(self.sync_dtype).removeprefix("torch.")
        root = str(self.weight_root) if transport == "disk" else None
        rollout = self.workers["rollout"]
        publish = self._publish(version, transport, dtype, root)
        if transport == "broadcast":
            # One collective: the rollout's death must be named, not the actor's broadcast error it causes.
            sent, received = await settle_calls(
                [publish, named_call("rollout", rollout.receive_weights.remote(version, transport))])
        else:  # the receiver reads a version only once its manifest is committed
            sent = await publish
            received = await named_call("rollout", rollout.receive_weights.remote(version, transport, root))
        metrics = {**sent, **received}
        metrics["perf/weight_sync_s"] = time.perf_counter() - started
        return metrics

    async def publish_weights(self, version: int) -> dict[str, float]:
        """Write the actor's weights as ``version`` under the disk root and return: the engines follow the root
        themselves (`RoleWorker.follow_published_weights`)."""
        started = time.perf_counter()
        metrics = await self._publish(version, "disk", str(self.sync_dtype).removeprefix("torch."),
                                      str(self.weight_root), run=self.weight_run)
        metrics["perf/weight_sync_s"] = time.perf_counter() - started
        return metrics

    async def _publish(self, version: int, transport: str, dtype: str, root: str | None, run: str | None = None):
        """Every actor rank gathers (a collective), rank 0 sends; rank 0's metrics."""
        results = await settle_calls([
            named_call("actor", rank.publish_weights.remote(version, transport, dtype,
                                                            self.cfg.update_weight_buffer_size, root, run))
            for rank in self.ranks("actor")])
        return results[0]

    # ---- checks -------------------------------------------------------------------------------
    def engine_weights(self) -> dict[str, torch.Tensor]:
        return self._wait(self.workers["rollout"].engine_weights.remote())

    def trainer_weights(self) -> dict[str, torch.Tensor]:
        dtype = str(self.sync_dtype).removeprefix("torch.")
        return self._wait([rank.trainer_weights.remote(dtype) for rank in self.ranks("actor")])[0]

    def health(self) -> dict[str, dict]:
        return {name: self._wait(worker.health.remote()) for name, worker in self.workers.items()}

    def end_process(self, name: str) -> None:
        """Kill the process of role worker or TransferQueue actor ``name`` through Ray: calls to it fail at once
        from then on (Ray reaps a stopped process a few seconds later), so the teardown never waits on it."""
        handle = self.workers.get(name) or self.transfer_queue_handles.get(name)
        if handle is None:
            raise KeyError(f"no Ray process named {name!r} in this run")
        ray.kill(handle, no_restart=True)

    def transfer_queue_actors(self) -> dict[str, object]:
        """TransferQueue's controller and storage-unit actors by name (for `relax.core.state.health.HealthMonitor`)."""
        return dict(self.transfer_queue_handles)

    @staticmethod
    def _wait(ref: Any, timeout: float = START_TIMEOUT_S) -> Any:
        return ray.get(ref, timeout=timeout)

    # ---- stop ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """End the role processes, TransferQueue and (when this service started it) Ray."""
        if not ray.is_initialized():
            return
        for worker in self.workers.values():
            try:
                ray.get(worker.close.remote(), timeout=10)
            except Exception:  # a dead worker has nothing to close
                logger.debug("role worker did not close", exc_info=True)
            ray.kill(worker)
        self.workers.clear()
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self.started_transfer_queue:
            import transfer_queue as tq

            try:
                tq.close()
            except Exception:
                logger.warning("TransferQueue did not close cleanly", exc_info=True)
            self.started_transfer_queue = False
            self.transfer_queue_handles = {}
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False


def check_resource_covers(cfg: RelaxConfig, roles: list[str]) -> None:
    """With an explicit --resource, every role the run places needs an entry (no silent default)."""
    missing = [name for name in roles if name not in cfg.resource]
    if cfg.resource and missing:
        raise ConfigError(f"{flag('resource')} has no entry for {missing}, which this run needs "
                          f"(its roles: {roles}); add e.g. " + ", ".join(f'"{m}": [1, 0]' for m in missing))


def check_machine_holds(cfg: RelaxConfig, roles: list[str], use_gpus: bool) -> None:
    """A local Ray (no --ray-address) runs every role process on this machine. Asking for more GPUs than it has
    waited `START_TIMEOUT_S` for a reservation that never came, and more processes than its memory holds started
    them all (a local Ray is given as many logical CPUs as the bundles ask, whatever the cores): 10,000 actor
    replicas ran the machine out of memory instead of an error. Both are refused here, naming --resource."""
    replicas = {name: int(cfg.resource.get(name, [1, 1])[0]) for name in roles}
    if use_gpus:
        asked = sum(replicas[name] * float(cfg.resource.get(name, [1, 1])[1]) for name in roles)
        have = torch.cuda.device_count()
        if asked > have:
            shares = json.dumps({name: [1, round(have / len(roles), 2)] for name in roles})
            raise ConfigError(f"{flag('resource')}: the role processes ask for {asked:g} GPUs (a role left out takes "
                              f"1), this machine has {have}; give each a share, e.g. '{shares}', or join a larger "
                              f"cluster with {flag('ray_address')}")
    processes = sum(replicas.values())
    available = free_bytes(torch.device("cpu"))
    if available is not None and processes * ROLE_PROCESS_BYTES > available:
        raise ConfigError(f"{flag('resource')}: {processes:,} role processes take about "
                          f"{processes * ROLE_PROCESS_BYTES / 2**30:,.0f} GiB before their models "
                          f"({ROLE_PROCESS_BYTES / 2**30:.1f} GiB each: an interpreter with torch and transformers), "
                          f"more than the {available / 2**30:.1f} GiB this machine has available; ask for fewer "
                          f"replicas, or join a larger cluster with {flag('ray_address')}")


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, naming the flag, when --ray-address points at nothing (Ray itself retries for a minute) or
    is not an address Ray takes (``auto``, ``local``, ``HOST:PORT``, a Ray Client's ``ray://HOST:PORT``)."""
    if address in ("auto", "local"):
        return
    scheme, separator, rest = address.partition("://")
    shown = redact_url(address) if separator else address  # a URL may carry credentials
    expected = "expected HOST:PORT, ray://HOST:PORT (a Ray Client server) or auto"
    if separator and scheme != "ray":
        raise ConfigError(f"{flag('ray_address')} {shown}: {expected}")
    host, _, port = (rest if separator else address).rpartition(":")
    host = host.strip("[]")  # an IPv6 literal
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{flag('ray_address')} {shown if separator else repr(address)}: {expected}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(f"{flag('ray_address')} {shown}: no Ray head answers there ({err})") from None
