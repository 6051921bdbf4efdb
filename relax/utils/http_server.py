"""The uvicorn servers Relax starts beside a run: access logs without query strings, and no signal handling of
their own (SIGINT/SIGTERM belong to the run they are embedded in: `relax.core.graceful_stop`).

uvicorn logs each request's full path, query string included, so a client that sends its token as
``?api_key=...`` (refused, but logged) would leave it in the log; the query string is cut from every access line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

import uvicorn

ACCESS_LOGGER = "uvicorn.access"


class DropQueryString(logging.Filter):
    """Rewrites uvicorn's access record (client, method, path, HTTP version, status) to the path alone."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?<query hidden>", *args[3:])
        return True


def uvicorn_config(app: Any, **kwargs: Any) -> uvicorn.Config:
    """A `uvicorn.Config` whose access log drops query strings (uvicorn configures its loggers in
    `Config.__init__`, so the filter goes on after)."""
    config = uvicorn.Config(app, **kwargs)
    access = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, DropQueryString) for f in access.filters):
        access.addFilter(DropQueryString())
    return config


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves SIGINT/SIGTERM to the run it is embedded in."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class ThreadedServer:
    """An `EmbeddedServer` on a thread and event loop of its own, so it answers while the caller's loop is busy
    (a training step). ``start`` waits until it listens; ``stop`` until it has shut down."""

    def __init__(self, app: Any, host: str, port: int, log_level: str = "warning", name: str = "relax-http") -> None:
        self.server = EmbeddedServer(uvicorn_config(app, host=host, port=port, log_level=log_level))
        self.address = f"{host}:{port}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve())
        except BaseException as error:  # noqa: BLE001 - reported by start()
            self._error = error

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                problem = self._error or ("the server stopped" if not self._thread.is_alive() else "timeout")
                raise RuntimeError(f"the HTTP server did not start on {self.address}: {problem}")
            time.sleep(0.01)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
