"""The elastic-scaling REST API on a running training (in-process placement, `--rollout-api-port`).

The API server runs on the training's own event loop, beside the engines it adds and removes: requests are
answered whenever the loop is free (between decode steps, and between training steps). New engines are embedded
engines built like the first one; they load the trainer's current weights before they join the router.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from relax.backends.inference.router import EngineRouter
from relax.config import RelaxConfig
from relax.core.build import Roles, build_engine
from relax.engine.scaling import ScaleManager

logger = logging.getLogger("relax")

START_TIMEOUT_S = 30.0
WEIGHT_BUCKET_BYTES = 512 * 1024 * 1024


def scale_manager(cfg: RelaxConfig, roles: Roles) -> ScaleManager:
    router = roles.rollout.engine
    if not isinstance(router, EngineRouter):
        raise TypeError("the scaling API needs the rollout engines behind a router (build with --rollout-api-port)")

    async def create_engine():
        engine = build_engine(Path(cfg.hf_checkpoint), roles.tokenizer, cfg, roles.device, roles.inference_dtype)
        return engine, None

    def current_weights():
        version = max(engine.weight_version for engine in router.engines)
        buckets = roles.actor.weight_buckets(roles.inference_dtype, WEIGHT_BUCKET_BYTES)
        return version, itertools.chain.from_iterable(buckets)

    return ScaleManager(router, weights=current_weights, factory=create_engine,
                        drain_timeout_s=cfg.scale_in_drain_timeout)


@asynccontextmanager
async def scaling_api(cfg: RelaxConfig, roles: Roles) -> AsyncIterator[ScaleManager | None]:
    """Serve the API on 127.0.0.1:--rollout-api-port for the duration of the block (nothing without the flag)."""
    if cfg.rollout_api_port is None:
        yield None
        return
    import uvicorn

    from relax.serving.scaling_api import create_scaling_app

    manager = scale_manager(cfg, roles)
    server = uvicorn.Server(uvicorn.Config(create_scaling_app(manager, cfg.rollout_api_key), host="127.0.0.1",
                                           port=cfg.rollout_api_port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_TIMEOUT_S
    while not server.started:
        if task.done() or loop.time() > deadline:
            raise RuntimeError(f"the scaling API did not start on 127.0.0.1:{cfg.rollout_api_port} "
                               f"(--rollout-api-port): {task.exception() if task.done() else 'timeout'}")
        await asyncio.sleep(0.01)
    logger.info("scaling API on http://127.0.0.1:%d (docs/engines.md)", cfg.rollout_api_port)
    try:
        yield manager
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
