"""Apprise notifications (issue 17): a local json:// webhook receives the start and the finish of a run, and the
failure of one with its cause; the secret in the URL reaches neither the messages, nor the console, nor run.log."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relax.core.state import checkpoint
from tests.support.runs import run_relax, tiny_train_args

SECRET = "S3cretT0ken"


@pytest.fixture
def webhook():
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # the http.server API names it
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            received.append({"body": json.loads(body), "auth": self.headers.get("Authorization", "")})
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"json://notify:{SECRET}@127.0.0.1:{server.server_address[1]}/hook", received
    server.shutdown()


def test_start_finish_and_failure_are_notified_without_the_secret(tiny_workspace, tmp_path, webhook):
    url, received = webhook
    run_dir = tmp_path / "run"
    result = run_relax("train", *tiny_train_args(tiny_workspace, run_dir, "--num-rollout", "2",
                                                 "--notify-urls", f"{url},{url}"))
    assert result.returncode == 0, result.stderr[-3000:]
    titles = [m["body"]["title"] for m in received]
    assert len(titles) == 4 and sum("started" in t for t in titles) == 2 and sum("finished" in t for t in titles) == 2
    finished = next(m["body"] for m in received if "finished" in m["body"]["title"])
    assert str(run_dir) in finished["message"] and "2 steps" in finished["message"]
    assert all(m["auth"] for m in received)  # the credentials went where they belong: the request's auth header

    for step in checkpoint.saved_steps(run_dir / "checkpoints"):  # every checkpoint damaged: resuming fails
        (checkpoint.iteration_dir(run_dir / "checkpoints", step) / "trainer_state.json").write_text("{")
    received.clear()
    failed = run_relax("train", *tiny_train_args(tiny_workspace, run_dir, "--num-rollout", "4", "--load", str(run_dir),
                                                 "--notify-urls", url))
    assert failed.returncode == 2
    (message,) = [m["body"] for m in received if "failed" in m["body"]["title"]]
    assert message["type"] == "failure" and "no usable checkpoint" in message["message"]
    for text in (json.dumps([m["body"] for m in received]), result.stderr, result.stdout, failed.stderr,
                 (run_dir / "run.log").read_text(), (run_dir / "config.yaml").read_text()):
        assert SECRET not in text


def test_a_url_apprise_does_not_know_is_refused_by_position_without_showing_it(tiny_workspace, tmp_path):
    result = run_relax("train", *tiny_train_args(tiny_workspace, tmp_path / "run", "--notify-urls",
                                                 f"json://127.0.0.1:9/ok,nosuchscheme://{SECRET}@host"))
    assert result.returncode == 2 and "--notify-urls: URL 2 of 2" in result.stderr
    assert SECRET not in result.stderr and not (tmp_path / "run").exists()


def test_an_unreachable_target_warns_and_the_run_goes_on(tiny_workspace, tmp_path):
    result = run_relax("train", *tiny_train_args(tiny_workspace, tmp_path / "run", "--num-rollout", "1",
                                                 "--notify-urls", "json://127.0.0.1:9/closed"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "not delivered" in (tmp_path / "run" / "run.log").read_text()
