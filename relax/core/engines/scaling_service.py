"""The elastic-scaling REST API on a running training (`--rollout-api-port`): in the trainer's process with the
in-process placement, in the rollout role's process under ``--placement ray`` (where the engines live).

The API answers from a thread and event loop of its own, so it stays responsive while a training step holds the
training's loop; the operations it starts run on the training's loop, beside the engines they add and remove. New
engines are embedded engines built like the first one (in a worker thread, so `timeout_secs` holds while a model
loads), or external servers named by ``engine_urls`` (`relax serve` or SGLang, which must see --rollout-weights-dir);
either loads the trainer's current weights before it joins the router. With --rollout-serve-replicas the engines are
a Ray Serve deployment: ``num_replicas`` sets its replica count (Serve starts, health-checks and drains replicas).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from relax.backends.inference.embedded import EmbeddedEngine
from relax.backends.inference.remote.sglang import SGLangHTTPEngine
from relax.backends.inference.router import EngineRouter
from relax.config import RelaxConfig
from relax.core.engines.embedded import build_engine
from relax.core.engines.factory import rollout_weights_dir
from relax.core.roles import Roles
from relax.rollout.scaling import ScaleManager
from relax.serving.scaling_api import create_scaling_app
from relax.serving.server import resolve_api_key
from relax.utils.http_server import ThreadedServer

logger = logging.getLogger("relax")

START_TIMEOUT_S = 30.0


def scale_manager(cfg: RelaxConfig, roles: Roles, loop: asyncio.AbstractEventLoop) -> ScaleManager:
    """The manager of the in-process rollout's engines; a new engine gets the trainer's current weights."""
    router = _router(roles.rollout.engine)

    def current_weights():
        version = max(engine.weight_version for engine in router.engines)
        buckets = roles.actor.weight_buckets(roles.inference_dtype, cfg.update_weight_buffer_size)
        return version, itertools.chain.from_iterable(buckets)

    return _manager(cfg, router, roles.tokenizer, roles.device, roles.inference_dtype, current_weights, loop)


def rollout_process_scale_manager(cfg: RelaxConfig, rollout, tokenizer, device, dtype,
                                  loop: asyncio.AbstractEventLoop) -> ScaleManager:
    """The manager of the engines of the rollout role's own process (``--placement ray``): the trainer is in another
    process, so a new engine gets the weights an engine of this process serves (every engine serves the version
    the trainer last pushed)."""
    router = _router(rollout.engine)

    def current_weights():
        holder = next((e for e in router.engines if isinstance(e, EmbeddedEngine)), None)
        if holder is None:
            raise RuntimeError("no engine of the rollout process holds the weights in memory to give a new engine "
                               "(external servers and Serve replicas load them from --rollout-weights-dir)")
        return holder.weight_version, list(holder.model.state_dict().items())

    return _manager(cfg, router, tokenizer, device, dtype, current_weights, loop)


def _router(engine) -> EngineRouter:
    if not isinstance(engine, EngineRouter):
        raise TypeError("the scaling API needs the rollout engines behind a router (build with --rollout-api-port)")
    return engine


def _manager(cfg: RelaxConfig, router: EngineRouter, tokenizer, device, dtype, current_weights,
             loop: asyncio.AbstractEventLoop) -> ScaleManager:
    async def create_engine():
        engine = await asyncio.to_thread(build_engine, Path(cfg.hf_checkpoint), tokenizer, cfg, device, dtype)
        return engine, None

    weights_dir = rollout_weights_dir(cfg)

    async def connect_engine(url: str) -> SGLangHTTPEngine:
        # A server of the SGLang protocol (`relax serve`, SGLang) that sees --rollout-weights-dir: it loads each
        # version the trainer publishes there, the first one before it is routed to
        return SGLangHTTPEngine(url, api_key=cfg.rollout_engine_api_key, weights_dir=weights_dir)

    # Engines that are a Serve deployment: ray_native scaling sets its replica count instead of building engines
    deployment = next((getattr(e, "deployment", None) for e in router.engines if hasattr(e, "deployment")), None)
    return ScaleManager(router, weights=current_weights, factory=None if deployment else create_engine,
                        connector=connect_engine, drain_timeout_s=cfg.scale_in_drain_timeout,
                        max_engines=cfg.scale_out_max_engines, loop=loop, replicas=deployment)


async def start_scaling_server(cfg: RelaxConfig, manager: ScaleManager):
    """The API on 127.0.0.1:--rollout-api-port, answering from a thread of its own; returns the server (``stop()``)."""
    await manager.refresh_replicas()
    api_key = resolve_api_key(cfg.rollout_api_key)
    server = ThreadedServer(create_scaling_app(manager, api_key), "127.0.0.1", cfg.rollout_api_port,
                            name="relax-scaling-api", where="--rollout-api-port")
    try:
        server.start(START_TIMEOUT_S)
    except RuntimeError as error:
        raise RuntimeError(f"{error} (--rollout-api-port)") from None
    logger.warning("scaling API on http://127.0.0.1:%d (docs/engines.md); its control endpoints %s",
                   cfg.rollout_api_port, "need a bearer token" if api_key else "are open: no --rollout-api-key or "
                   "$RELAX_API_KEY set")
    return server


@asynccontextmanager
async def scaling_api(cfg: RelaxConfig, roles: Roles) -> AsyncIterator[ScaleManager | None]:
    """Serve the API for the duration of the block (nothing without --rollout-api-port; under --placement ray the
    rollout role's process serves it, `relax.core.placement.ray.workers.RoleWorker.start_scaling_api`)."""
    if cfg.rollout_api_port is None or cfg.placement == "ray":
        yield None
        return
    manager = scale_manager(cfg, roles, asyncio.get_running_loop())
    server = await start_scaling_server(cfg, manager)
    try:
        yield manager
    finally:
        server.stop()
