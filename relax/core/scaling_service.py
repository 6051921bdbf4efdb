"""The elastic-scaling REST API on a running training (in-process placement, `--rollout-api-port`).

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

from relax.backends.inference.http_sglang import SGLangHTTPEngine
from relax.backends.inference.router import EngineRouter
from relax.config import RelaxConfig
from relax.core.build import Roles, build_engine, rollout_weights_dir
from relax.engine.scaling import ScaleManager
from relax.serving.server import resolve_api_key

logger = logging.getLogger("relax")

START_TIMEOUT_S = 30.0


def scale_manager(cfg: RelaxConfig, roles: Roles, loop: asyncio.AbstractEventLoop) -> ScaleManager:
    router = roles.rollout.engine
    if not isinstance(router, EngineRouter):
        raise TypeError("the scaling API needs the rollout engines behind a router (build with --rollout-api-port)")

    async def create_engine():
        engine = await asyncio.to_thread(build_engine, Path(cfg.hf_checkpoint), roles.tokenizer, cfg, roles.device,
                                         roles.inference_dtype)
        return engine, None

    weights_dir = rollout_weights_dir(cfg)

    async def connect_engine(url: str) -> SGLangHTTPEngine:
        # A server of the SGLang protocol (`relax serve`, SGLang) that sees --rollout-weights-dir: it loads each
        # version the trainer publishes there, the first one before it is routed to
        return SGLangHTTPEngine(url, api_key=cfg.rollout_engine_api_key, weights_dir=weights_dir)

    def current_weights():
        version = max(engine.weight_version for engine in router.engines)
        buckets = roles.actor.weight_buckets(roles.inference_dtype, cfg.update_weight_buffer_size)
        return version, itertools.chain.from_iterable(buckets)

    # Engines that are a Serve deployment: ray_native scaling sets its replica count instead of building engines
    deployment = next((getattr(e, "deployment", None) for e in router.engines if hasattr(e, "deployment")), None)
    return ScaleManager(router, weights=current_weights, factory=None if deployment else create_engine,
                        connector=connect_engine, drain_timeout_s=cfg.scale_in_drain_timeout,
                        max_engines=cfg.scale_out_max_engines, loop=loop, replicas=deployment)


@asynccontextmanager
async def scaling_api(cfg: RelaxConfig, roles: Roles) -> AsyncIterator[ScaleManager | None]:
    """Serve the API on 127.0.0.1:--rollout-api-port for the duration of the block (nothing without the flag)."""
    if cfg.rollout_api_port is None:
        yield None
        return
    from relax.serving.scaling_api import create_scaling_app
    from relax.utils.http_server import ThreadedServer

    manager = scale_manager(cfg, roles, asyncio.get_running_loop())
    await manager.refresh_replicas()
    api_key = resolve_api_key(cfg.rollout_api_key)
    server = ThreadedServer(create_scaling_app(manager, api_key), "127.0.0.1", cfg.rollout_api_port,
                            name="relax-scaling-api")
    try:
        server.start(START_TIMEOUT_S)
    except RuntimeError as error:
        raise RuntimeError(f"{error} (--rollout-api-port)") from None
    logger.warning("scaling API on http://127.0.0.1:%d (docs/engines.md); its control endpoints %s",
                   cfg.rollout_api_port, "need a bearer token" if api_key else "are open: no --rollout-api-key or "
                   "$RELAX_API_KEY set")
    try:
        yield manager
    finally:
        server.stop()
