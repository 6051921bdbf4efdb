"""Real `relax serve` apps for tests: uvicorn on 127.0.0.1 in a thread, the served engine at hand."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import httpx
import uvicorn

from relax.backends.inference.embedded import EmbeddedEngine
from relax.distributed.process_group import free_port  # noqa: F401 - the tests' import of it
from relax.serving.app import create_app
from relax.serving.limits import GenerationLimits
from relax.utils.http_server import HTTPLimits, uvicorn_config
from tests.support.waits import PROCESS_PATIENCE_S, wait_until

API_KEY = "test-secret-key"


class ThreadServer:
    """A uvicorn server on a daemon thread, listening on a socket bound here first to port 0: the OS picks a free
    port, and no other process can take it between the pick and the listen (a port found free and then bound by
    the server later can be, on a busy machine)."""

    def __init__(self, config: uvicorn.Config, timeout_s: float = 60.0) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.uv.started or not self.thread.is_alive(), timeout_s, "the server to start")
        if not self.uv.started:
            raise AssertionError(f"the server on {self.url} stopped before it started")

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(10)
        self.socket.close()


class Server:
    """`relax serve`'s app on a uvicorn thread, configured as `relax serve` configures it (`uvicorn_config`: the
    same bounds on bodies, connections and read times); ``engine`` is the served engine (to inspect its weights)."""

    def __init__(self, model_dir: Path, api_key: str | None = API_KEY, weight_update_root: Path | None = None,
                 http_limits: HTTPLimits | None = None, generation_limits: GenerationLimits | None = None,
                 engine: EmbeddedEngine | None = None, max_batch_size: int | None = 256) -> None:
        self.engine = engine or EmbeddedEngine.from_pretrained(str(model_dir), max_batch_size=max_batch_size)
        app = create_app(self.engine, self.engine.tokenizer, model_name="tiny", model_path=str(model_dir),
                         api_key=api_key, batch_window_s=0.005,
                         weight_update_root=None if weight_update_root is None else str(weight_update_root),
                         generation_limits=generation_limits)
        self.thread_server = ThreadServer(uvicorn_config(app, http_limits, log_level="warning"))
        self.port, self.url = self.thread_server.port, self.thread_server.url

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def stop(self) -> None:
        self.thread_server.stop()


class ServeProcess:
    """`relax serve` in a process of its own (`tests.support.runs.popen_relax`) on 127.0.0.1 (a context manager):
    up once /health answers, terminated on exit; ``output`` holds its combined stdout and stderr afterwards."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, timeout_s: float = PROCESS_PATIENCE_S) -> None:
        import subprocess

        from tests.support.runs import popen_relax

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.timeout_s = timeout_s
        self.output = ""
        self._subprocess = subprocess
        self.process = popen_relax("serve", *args, "--port", str(self.port), env=env, merge_stderr=True)

    def _up(self) -> bool:
        return httpx.get(f"{self.url}/health", timeout=1).status_code == 200

    def __enter__(self) -> ServeProcess:
        try:
            wait_until(self._up, self.timeout_s, "relax serve to answer /health", process=self.process)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.output, _ = self.process.communicate(timeout=10)
        except self._subprocess.TimeoutExpired:
            self.process.kill()
            self.output, _ = self.process.communicate(timeout=10)
