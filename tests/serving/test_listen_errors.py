"""A server whose address cannot be listened on: every server Relax starts fails at once, naming the flag that chose
the address, with exit status 2 from the command line, before a model loads (uvicorn alone logged the reason and
exited with status 1 or 3 after the load, and the threaded servers raised `SystemExit` into the run)."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from relax.cli.main import main
from relax.utils.http_server import ListenError, ThreadedServer, listening_socket
from tests.support.runs import tiny_train_args


@pytest.fixture
def taken_port():
    """A port another process's socket listens on (here: this process's, which the servers cannot share)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    yield holder.getsockname()[1]
    holder.close()


def _relax(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def test_a_taken_port_or_a_foreign_host_is_named(taken_port):
    with pytest.raises(ListenError, match=f"--some-port {taken_port}: cannot listen on 127.0.0.1:{taken_port} "):
        listening_socket("127.0.0.1", taken_port, "--some-port")
    for host in ("no-such-host.invalid", "999.1.1.1"):
        with pytest.raises(ListenError, match=f"--host {host}: not an address this machine can listen on"):
            listening_socket(host, 0, "--port")
    free = listening_socket("127.0.0.1", 0, "--port")
    assert free.getsockname()[1] > 0
    free.close()


def test_a_threaded_server_on_a_taken_port_raises_and_leaves_no_thread(taken_port):
    async def app(scope, receive, send):  # never reached
        raise AssertionError("served")

    before = threading.active_count()
    server = ThreadedServer(app, "127.0.0.1", taken_port, where="--rollout-api-port")
    with pytest.raises(ListenError, match=f"--rollout-api-port {taken_port}: cannot listen"):
        server.start()
    assert threading.active_count() == before


def test_a_threaded_server_serves_on_the_socket_it_bound():
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    server = ThreadedServer(app, "127.0.0.1", 0, where="--metrics-service-port")
    server.start()
    port = server.port
    try:
        assert port > 0 and httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text == "ok"
    finally:
        server.stop()
    with socket.socket() as probe:  # the port is let go at the stop
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
        probe.listen()


def test_relax_serve_on_a_taken_port_fails_before_loading_the_model(taken_port, tiny_workspace, capsys, monkeypatch):
    from relax.backends.inference import embedded

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(embedded.EmbeddedEngine, "from_pretrained", refuse)
    code, err = _relax(capsys, "serve", "--hf-checkpoint", str(tiny_workspace / "model"), "--port", str(taken_port))
    assert code == 2 and f"--port {taken_port}: cannot listen on 127.0.0.1:{taken_port}" in err, err
    code, err = _relax(capsys, "serve", "--hf-checkpoint", str(tiny_workspace / "model"), "--host",
                       "no-such-host.invalid")
    assert code == 2 and "--host no-such-host.invalid: not an address" in err, err


@pytest.mark.parametrize("flags", [("--rollout-api-port", "{port}"),
                                   ("--use-metrics-service", "--metrics-service-port", "{port}")])
def test_relax_train_with_a_taken_port_fails_before_a_run_directory_exists(flags, taken_port, tiny_workspace,
                                                                           tmp_path, capsys):
    args = tiny_train_args(tiny_workspace, tmp_path / "run", *(flag.format(port=taken_port) for flag in flags))
    code, err = _relax(capsys, "train", *args)
    flag_name = flags[-2]
    assert code == 2 and f"{flag_name} {taken_port}: cannot listen on 127.0.0.1:{taken_port}" in err, err
    assert not (tmp_path / "run").exists()
