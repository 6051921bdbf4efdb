"""The uvicorn servers Relax starts (`relax serve`, the scaling API, the agent gateway, the metrics endpoint): what
one client may take from them, access logs without query strings, and no signal handling of their own when they
are embedded in a run (SIGINT/SIGTERM belong to the run: `relax.core.loops.graceful_stop`).

Bounds (`HTTPLimits`), the same on every server, since uvicorn alone leaves them open:
- connections: past ``max_connections`` open connections a new one is answered 503 and closed at once;
- time to send a request: its headers within ``header_timeout_s`` of the connection's first byte (or of the
  request's first byte on a kept-alive connection), its body within ``body_timeout_s`` of the headers; a client
  that trickles, stalls, or sends a body shorter than its ``Content-Length`` gets 408 and the connection closes
  (uvicorn has no such deadline: a byte every few seconds held a connection forever);
- body size: a ``Content-Length`` above ``max_request_bytes`` is answered 413 before any of the body is read, and a
  chunked body is cut off with 413 when it passes the limit;
- idle kept-alive connections close after ``keep_alive_s``; a graceful stop waits ``shutdown_grace_s`` for the
  requests in flight, then cancels them (a server's handlers abort the work of a cancelled request).

uvicorn logs each request's full path, query string included, so a client that sends its token as
``?api_key=...`` (refused, but logged) would leave it in the log; the query string is cut from every access line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

ACCESS_LOGGER = "uvicorn.access"


@dataclass(frozen=True)
class HTTPLimits:
    """What one client may take from a server (see the module doc); every field has a flag on `relax serve`."""

    max_request_bytes: int = 16 * 1024 * 1024
    max_connections: int = 512
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: int = 5
    shutdown_grace_s: int = 30

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_connections", "header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")


def _plain_response(status: int, reason: bytes, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": status}}).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, reason, len(body))) + body


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and the header and body deadlines (`HTTPLimits`).

    A deadline is one timer per connection: armed when a request's first byte arrives (the connection's opening
    counts as that for its first request), moved to the body deadline when the headers are parsed, cleared when the
    body is complete. Past it the connection closes: 408 when no response has started, and a handler still waiting
    for the body sees the client as gone."""

    limits = HTTPLimits()  # set by `bounded_protocol`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        if len(self.server_state.connections) >= self.limits.max_connections:
            transport.write(_plain_response(503, b"Service Unavailable", "too many connections: retry later"))
            transport.close()
            self.transport = transport
            return
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self in self.server_state.connections or self.cycle is not None:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if self._deadline is None and idle and (self.cycle is None or self.conn.their_state is h11.IDLE):
            self._arm(self.limits.header_timeout_s)  # the first byte of a new request on a kept-alive connection
        cycle = self.cycle
        super().data_received(data)
        self._follow(cycle)

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()  # may parse a pipelined request
        self._follow(cycle)

    def _follow(self, previous_cycle: Any) -> None:
        cycle = self.cycle
        if cycle is not previous_cycle and cycle is not None:  # a request's headers were parsed
            self._arm(self.limits.body_timeout_s) if cycle.more_body else self._disarm()
        elif cycle is not None and not cycle.more_body and not cycle.response_complete:
            self._disarm()  # its body is complete: the handler's time is its own

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            self.transport.write(_plain_response(408, b"Request Timeout",
                                                 "the request was not received in time: connection closed"))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def bounded_protocol(limits: HTTPLimits) -> type[BoundedH11Protocol]:
    """A `BoundedH11Protocol` class bound to ``limits`` (uvicorn instantiates the class per connection)."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"limits": limits})


class BodyLimit:
    """ASGI middleware: the body is read whole before the app runs, and one above ``max_bytes`` is answered 413, by
    its ``Content-Length`` before any of it is read, or as soon as a chunked body passes the limit. The app then
    reads the buffered body; its next ``receive`` waits for the client to go away (`http.disconnect`), which is how
    a handler learns that nobody waits for its answer."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._refuse(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left, or its body deadline passed
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._refuse(send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any) -> None:
        body = json.dumps({"error": {"message": f"the request body is larger than the server's limit of "
                                                f"{self.max_bytes} bytes (--max-request-bytes)",
                                     "type": "request_too_large", "param": None, "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


async def client_gone(receive: Any) -> None:
    """Returns when the client of a request disconnects: call it once the body has been read (`BodyLimit` read it
    already), when the next message of ``receive`` is the disconnect. A handler races it against its work, to stop
    work nobody waits for."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def wait_unless_client_gone(work: asyncio.Future, receive: Any) -> None:
    """Wait for ``work`` or for its client to disconnect (`client_gone`), whichever comes first, or until this handler
    is cancelled; ``work.done()`` then says which, and the caller stops the work nobody waits for any more."""
    gone = asyncio.ensure_future(client_gone(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()


class DropQueryString(logging.Filter):
    """Rewrites uvicorn's access record (client, method, path, HTTP version, status) to the path alone."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?<query hidden>", *args[3:])
        return True


def uvicorn_config(app: Any, limits: HTTPLimits | None = None, **kwargs: Any) -> uvicorn.Config:
    """A `uvicorn.Config` for every server Relax runs: the bounds of ``limits`` (default `HTTPLimits()`) and an
    access log without query strings (uvicorn configures its loggers in `Config.__init__`, so the filter goes on
    after)."""
    limits = limits or HTTPLimits()
    config = uvicorn.Config(BodyLimit(app, limits.max_request_bytes), http=bounded_protocol(limits),
                            timeout_keep_alive=limits.keep_alive_s,
                            timeout_graceful_shutdown=limits.shutdown_grace_s, **kwargs)
    access = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, DropQueryString) for f in access.filters):
        access.addFilter(DropQueryString())
    return config


class ListenError(OSError):
    """A server's address cannot be listened on; the message names the flag that chose it and the reason."""


def listening_socket(host: str, port: int, port_flag: str, host_flag: str = "--host") -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, for uvicorn's ``serve(sockets=...)``. Bound by the caller,
    before a model loads, so that a port another process holds or a host that is no address of this machine fails
    at once as a `ListenError` naming the flag, not after the load in uvicorn, which logs the reason and exits with
    status 1 or 3 from inside the server."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as err:
        raise ListenError(f"{host_flag} {host}: not an address this machine can listen on "
                          f"({getattr(err, 'strerror', None) or err})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may reuse a TIME_WAIT port
        sock.bind(address)
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as err:
        sock.close()
        raise ListenError(f"{port_flag} {port}: cannot listen on {host}:{port} ({err.strerror or err})") from None
    return sock


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves SIGINT/SIGTERM to the run it is embedded in."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class ThreadedServer:
    """An `EmbeddedServer` on a thread and event loop of its own, so it answers while the caller's loop is busy
    (a training step). ``start`` waits until it listens; ``stop`` until it has shut down."""

    def __init__(self, app: Any, host: str, port: int, log_level: str = "warning", name: str = "relax-http",
                 limits: HTTPLimits | None = None, where: str | None = None) -> None:
        self.server = EmbeddedServer(uvicorn_config(app, limits, host=host, port=port, log_level=log_level))
        self.host, self.requested_port, self.address = host, port, f"{host}:{port}"
        self.where = where or "port"  # the flag that chose the port, for the error
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._error: BaseException | None = None
        self._socket: socket.socket | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve(sockets=[self._socket]))
        except BaseException as error:  # noqa: BLE001 - reported by start()
            self._error = error

    def start(self, timeout_s: float = 30.0) -> None:
        """Listen (a `ListenError` naming ``where`` when the port is taken) and serve from the thread."""
        self._socket = listening_socket(self.host, self.requested_port, self.where)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                problem = self._error or ("the server stopped" if not self._thread.is_alive() else "timeout")
                self.stop(0)
                self._socket.close()
                raise RuntimeError(f"the HTTP server did not start on {self.address}: {problem}")
            time.sleep(0.01)

    @property
    def port(self) -> int:
        """The port it listens on (the one the OS chose, when started on port 0)."""
        return self._socket.getsockname()[1] if self._socket is not None else self.requested_port

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
