"""`RelaxServerEngine`: a `relax serve` process this run starts, talks to over SGLang's protocol, and relaunches.

``--rollout-engine-protocol relax`` puts each rollout engine in a process of its own: a crash, a leak or a hang
of the engine costs that process, not the trainer. The engine is started on the base model at first use, loads
each weight version from the run's weights directory (``--weight-update-root`` bounds it to that directory), and
is stopped with the run (it also dies with the run's process: `ServerProcess`). `relaunch` replaces a dead or
hung one; `EngineRouter` calls it under ``--use-fault-tolerance`` and brings the new process to the current
weights before routing to it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax.backends.inference.base import PAUSE_OPERATOR, GenerationOutput, GenerationRequest
from relax.backends.inference.embedded import CoreSettings
from relax.backends.inference.remote.server_process import ServerProcess, wait_until_free
from relax.backends.inference.remote.sglang import SGLangHTTPEngine

SERVER_MODULE = "relax.cli.main"  # python -m relax.cli.main serve ...
API_KEY_ENV = "RELAX_API_KEY"  # the variable `relax serve` reads its token from (relax.serving.server)
logger = logging.getLogger("relax")


@dataclass(frozen=True)
class RelaxServerSettings:
    """How the server is started: the trainer's device and compute dtype, so log-probs match the trainer's, and the
    run's engine settings (its KV pool, pages, prefill budget, CUDA graphs: `relax serve`'s flags of the same
    names)."""

    device: str = "cpu"
    dtype: str = "float32"
    core: CoreSettings = field(default_factory=lambda: CoreSettings(mem_fraction_static=0.85))
    max_batch_size: int | None = None
    startup_timeout_s: float = 600.0  # a cold start on a busy 2-core machine takes tens of seconds


def core_arguments(core: CoreSettings) -> list[str]:
    """`relax serve`'s flags for the engine settings ``core`` (the ones a server takes: no FP8 projections, no agent
    sessions)."""
    return ["--engine-core", core.mode, "--mem-fraction-static", str(core.mem_fraction_static),
            "--kv-cache-dtype", core.kv_cache_dtype, "--page-size", str(core.page_size),
            "--max-prefill-tokens", str(core.max_prefill_tokens), "--cuda-graph-max-bs", str(core.max_graph_batch),
            *(["--max-total-tokens", str(core.max_total_tokens)] if core.max_total_tokens is not None else []),
            *([] if core.cuda_graphs else ["--disable-cuda-graph"])]


class RelaxServerEngine(SGLangHTTPEngine):
    """`relax serve --hf-checkpoint <model_dir>` on ``127.0.0.1:port``, started lazily (or with `start`) and
    stopped by `aclose`."""

    def __init__(self, model_dir: str | Path, weights_dir: str | Path, port: int, log_dir: str | Path,
                 settings: RelaxServerSettings | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0) -> None:
        super().__init__(f"http://127.0.0.1:{port}", api_key=api_key, timeout_s=timeout_s, weights_dir=weights_dir)
        self.model_dir = Path(model_dir).resolve()
        self.settings = settings or RelaxServerSettings()
        self.api_key = api_key
        self.server = ServerProcess("relax serve", "127.0.0.1", port, Path(log_dir) / f"relax_serve_{port}.log",
                                    sys.executable)
        self._starting: asyncio.Task | None = None
        self._ready = False  # the process answers /health (a started one may still be loading)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    @property
    def server_pid(self) -> int | None:
        """The server process's pid (None while none runs): `relax health` shows it, operators signal it."""
        return self.server.pid

    def arguments(self) -> list[str]:
        s = self.settings
        weights_root = self._require_weights_dir().resolve()
        return ["serve", "--hf-checkpoint", str(self.model_dir), "--host", "127.0.0.1",
                "--port", str(self.server.port), "--device", s.device, "--dtype", s.dtype, *core_arguments(s.core),
                "--weight-update-root", str(weights_root), "--log-level", "warning",
                *(["--max-batch-size", str(s.max_batch_size)] if s.max_batch_size else [])]

    def environment(self) -> dict[str, str]:
        # The key goes through the environment, not --api-key: a command line is readable by every local user.
        env = {key: value for key, value in os.environ.items() if key != API_KEY_ENV}
        return {**env, **({API_KEY_ENV: self.api_key} if self.api_key else {})}

    # ---------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the server on the base model (weight version 0) and wait until it answers."""
        self._ready = False
        self._require_weights_dir().mkdir(parents=True, exist_ok=True)  # --weight-update-root must exist
        await wait_until_free(self.server.host, self.server.port, self.server.stop_timeout_s)
        self.server.start(SERVER_MODULE, self.arguments(), self.environment(), banner=f"serving {self.model_dir}")
        await self.http.aclose()  # a new process: connections pooled to the previous one are dead
        await self.server.wait_ready(self.http, self.settings.startup_timeout_s)
        self._ready = True
        self.note_weight_version(0)
        logger.info("relax serve at %s is up (pid %s)", self.base_url, self.server.pid)

    async def relaunch(self) -> None:
        """Replace a dead or hung server: kill its process group at once and start a new one (base weights;
        the router loads the current version into it before it routes to it)."""
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        self.server.kill()
        self._ready, self._starting = False, None
        await self._ensure_started()

    def _start_in_background(self) -> asyncio.Task:
        """The first start (running or ended; a failed one is retried only by `relaunch`). A task, so that a
        caller that gives up waiting (a timed-out health probe) does not abandon a half-started server."""
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self.start())
        return self._starting

    async def _ensure_started(self) -> None:
        if not self._ready:
            await asyncio.shield(self._start_in_background())

    async def aclose(self) -> None:
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        await asyncio.to_thread(self.server.stop)
        await super().aclose()

    # ---------------------------------------------------------------------------- every call needs the server

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        await self._ensure_started()
        return await super().generate(requests)

    async def health(self) -> dict[str, Any]:
        if not self._ready:
            starting = self._start_in_background()
            if not starting.done():
                # Starting (its own start-up bound applies): alive counts as healthy, so the router's health
                # checks of a call that waits for the start do not give up on it.
                if self.server.started:
                    self.server.check_alive()
                return {"status": "starting", "url": self.base_url, "pid": self.server.pid}
            await starting  # ended: raises its error if it failed
        self.server.check_alive()  # a dead process says so, with its log's tail, instead of "connection refused"
        return {**await super().health(), "pid": self.server.pid, "starts": self.server.starts}

    async def load_weights(self, version: int | None = None) -> int:
        await self._ensure_started()
        return await super().load_weights(version)

    async def abort(self, request_ids: Sequence[str]) -> None:
        if self.server.started:
            await super().abort(request_ids)

    async def pause(self, owner: str = PAUSE_OPERATOR) -> None:
        await self._ensure_started()
        await super().pause(owner)

    async def resume(self, owner: str = PAUSE_OPERATOR) -> None:
        await self._ensure_started()
        await super().resume(owner)
