"""Fuzzing the REST APIs from the OpenAPI schemas they publish (schemathesis): `relax serve` as a real subprocess
and the elastic-scaling API on a real uvicorn server, both on 127.0.0.1 with a bearer token configured.

Every generated request (valid and invalid bodies, with and without the token) must get no 5xx, an answer the
schema documents, and never the token back; neither server may log the token. Hand-written bad bodies get 400
naming the field path.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import schemathesis

# Imported here, not lazily by `schemathesis.openapi.from_url` while a server thread runs: pytest rewrites a
# plugin's modules with ast.parse as they import, and CPython 3.11's AST conversion keeps its recursion depth
# per interpreter, not per thread, so two threads parsing at once failed a CI run with "SystemError: AST
# constructor recursion depth mismatch" (python/cpython#106905, fixed in 3.12). pyproject's addopts no longer
# autoload plugins, so pytest leaves schemathesis unrewritten; the import stays for a run that loads it (-p).
import schemathesis.specs.openapi.schemas  # noqa: F401
import torch
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from relax.backends.inference.embedded import EmbeddedEngine
from relax.backends.inference.router import EngineRouter
from relax.distributed.process_group import free_loopback_port
from relax.rollout.scaling import ScaleManager
from relax.serving.scaling_api import create_scaling_app
from tests.support.http_servers import Server, ThreadServer
from tests.support.runs import ROOT, SUBPROCESS_TIMEOUT_S
from tests.support.waits import PROCESS_PATIENCE_S, wait_until

TOKEN = "fuzz-token-7Qx2vLm9"  # distinctive, so that finding it anywhere cannot be a coincidence
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Small and fixed, so that the file stays well under 90 s on a slow 2-core machine and runs the same cases in CI.
FUZZ = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          ignored_auth]


@schemathesis.check
def token_never_echoed(ctx, response, case) -> None:
    """The configured token appears in no response body or header."""
    assert TOKEN.encode() not in response.content, "the API token is in the response body"
    for name, values in response.headers.items():
        assert all(TOKEN not in value for value in values), f"the API token is in the response header {name}"


def fuzz_every_operation(schema_url: str, run_case, skip_paths: tuple[str, ...] = ()) -> int:
    """Load the schema the server publishes and run generated cases (valid and invalid data) of each operation
    through ``run_case``; returns the number of operations fuzzed.

    (A loop rather than schemathesis' pytest integration: its lazy fixture loader does not run under pytest 9.)
    """
    schema = schemathesis.openapi.from_url(schema_url)
    operations = [result.ok() for result in schema.get_all_operations()]
    operations = [operation for operation in operations if operation.path not in skip_paths]
    for operation in operations:
        # Invalid data needs a body or a query to break (any string is a valid path parameter here).
        breakable = len(operation.body) + len(operation.query) > 0
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if breakable else [])
        for mode in modes:
            FUZZ(given(case=operation.as_strategy(generation_mode=mode))(run_case))()
    return len(operations)


def _wait_for(url: str, process: subprocess.Popen | None = None, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer within {timeout_s} s")


# ----------------------------------------------------------------------------- relax serve (a subprocess)


@pytest.fixture(scope="module")
def serve(tiny_workspace, tmp_path_factory):
    """`relax serve` on the tiny model, logging at debug level into a file; yields (base URL, log path). A port
    found free can be taken before the server binds it (a busy machine's Ray workers take many): then it starts
    again on another."""
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RELAX_API_KEY": TOKEN, "OMP_NUM_THREADS": "1"}
    for attempt in range(5):
        port = free_loopback_port()
        with log_path.open("w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "relax.cli.main", "serve", "--hf-checkpoint", str(tiny_workspace / "model"),
                 "--port", str(port), "--device", "cpu", "--log-level", "debug"],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_for(f"{base}/health", process, timeout_s=SUBPROCESS_TIMEOUT_S)
            break
        except AssertionError:
            process.kill()
            process.wait(10)
            if "address already in use" not in log_path.read_text() or attempt == 4:
                raise
    try:
        yield base, log_path
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def test_relax_serve_survives_fuzzing(serve):
    base = serve[0]

    def run_case(case) -> None:
        try:
            case.call_and_validate(headers=AUTH, checks=[*CHECKS, negative_data_rejection, token_never_echoed],
                                   timeout=60)
        finally:
            if case.path == "/pause_generation":  # a paused engine would hold every later generation
                httpx.post(f"{base}/continue_generation", headers=AUTH, timeout=10)

    # /init_weights_update_group waits (up to timeout_s) for a trainer to rendezvous with: a valid fuzzed body
    # would hold the test that long. Its bad bodies are checked by hand below.
    assert fuzz_every_operation(f"{base}/openapi.json", run_case, skip_paths=("/init_weights_update_group",)) >= 12


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/generate", {"input_ids": [5], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ("/generate", {"input_ids": [5], "sampling_params": {"top_p": "high"}}, "sampling_params.top_p"),
    ("/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 10**9}}, "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [5], "sampling_params": {"seed": 2**70}}, "sampling_params.seed"),
    ("/generate", {"input_ids": [5, -1]}, "input_ids.1"),
    ("/generate", {"input_ids": [5, 10**6]}, "input_ids"),
    ("/generate", {"input_ids": [[5], [True]]}, "input_ids.1.0"),
    ("/generate", {"text": "hi", "rid": 7}, "rid"),
    ("/generate", {"input_ids": [[5], []]}, "input_ids.1"),
    ("/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 4.5}}, "sampling_params.max_new_tokens"),
    ("/v1/completions", {"prompt": "1", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"prompt": "1", "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content.0.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**9},
     "max_completion_tokens"),
    ("/abort_request", {"rid": 5}, "rid"),
    ("/update_weights_from_disk", {"model_path": ""}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/nowhere", "weight_version": -1}, "weight_version"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1,
                                    "world_size": 2}, "master_port"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
                                    "world_size": 2, "backend": "mpi"}, "backend"),
    ("/update_weights_from_distributed", {"weight_version": "new"}, "weight_version"),
])
def test_relax_serve_bad_bodies_get_400_naming_the_field(serve, path, body, param):
    response = httpx.post(f"{serve[0]}{path}", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_a_token_in_the_query_string_is_refused_and_never_logged(serve):
    response = httpx.post(f"{serve[0]}/pause_generation", params={"api_key": TOKEN, "token": TOKEN}, timeout=30)
    assert response.status_code == 401
    # relax serve logs at debug level, access log included: test_relax_serve_never_logs_the_token reads it next


def test_a_failed_rendezvous_is_one_line(serve):
    """Nothing listens at the master address: 400 naming it, in one line (torch's C++ log printed the rendezvous
    error with its C++ stack frames); relax_serve_never_logs_the_token reads the log next."""
    response = httpx.post(f"{serve[0]}/init_weights_update_group", headers=AUTH, timeout=60, json={
        "master_address": "127.0.0.1", "master_port": free_loopback_port(), "rank_offset": 1, "world_size": 2,
        "timeout_s": 1.0})
    assert response.status_code == 400 and "\n" not in response.json()["error"]["message"]


def test_relax_serve_never_logs_the_token(serve):
    """Runs after the fuzzing above: the whole debug log of the server holds neither the token nor a traceback."""
    log = serve[1].read_text()
    assert "frame #" not in log and "Exception raised from" not in log  # no C++ stack frames either
    assert "listening on http://127.0.0.1:" in log and "Application startup complete" in log  # the server's log
    assert TOKEN not in log
    assert "Traceback" not in log, log[log.index("Traceback") - 2000:][:6000]


# ----------------------------------------------------------------------------- the scaling API (uvicorn thread)


class _Recorder(logging.Handler):
    """Keeps every formatted record (tracebacks included) of this process while the scaling server runs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def scaling(tiny_workspace):
    """The scaling API over one tiny embedded engine; the 'cluster' has room for two more engines, after which
    the factory fails as a full cluster would. Yields (base URL, log recorder)."""
    initial = EmbeddedEngine.from_pretrained(str(tiny_workspace / "model"))
    room = threading.Semaphore(2)

    async def factory():
        if not room.acquire(blocking=False):
            raise RuntimeError("no room for another engine")
        return EmbeddedEngine(initial.model, initial.tokenizer), None  # shares the weights: cheap to create

    manager = ScaleManager(EngineRouter([initial]), weights=lambda: (1, list(initial.model.named_parameters())),
                           factory=factory)
    recorder = _Recorder()
    # uvicorn's loggers stop propagating once any earlier uvicorn server in this process configured them: the
    # recorder listens on them directly as well as on the root logger.
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access")]
    old_levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(recorder)
        logger.setLevel(logging.DEBUG)
    # log_config=None: uvicorn keeps the loggers as they are (the recorder is on them).
    server = ThreadServer(uvicorn.Config(create_scaling_app(manager, api_key=TOKEN), log_config=None,
                                         log_level="debug"))
    try:
        _wait_for(f"{server.url}/engines")
        yield server.url, recorder
    finally:
        server.stop()
        for logger, level in zip(loggers, old_levels):
            logger.removeHandler(recorder)
            logger.setLevel(level)


def test_scaling_api_survives_fuzzing(scaling):
    def run_case(case) -> None:
        case.call_and_validate(headers=AUTH, checks=[*CHECKS, negative_data_rejection, token_never_echoed],
                               timeout=60)

    assert fuzz_every_operation(f"{scaling[0]}/openapi.json", run_case) == 8


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/scale_out", {"num_replicas": -1}, "num_replicas"),
    ("/scale_out", {"engine_urls": "http://127.0.0.1:1"}, "engine_urls"),
    ("/scale_out", {"num_replicas": 2, "timeout_secs": 0}, "timeout_secs"),
    ("/scale_in", {"num_replicas": 1, "force": "sometimes"}, "force"),
    ("/scale_in", {"engine_urls": ["http://127.0.0.1:1", {}]}, "engine_urls.1"),
])
def test_scaling_bad_bodies_get_400_naming_the_field(scaling, path, body, param):
    response = httpx.post(f"{scaling[0]}{path}", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["param"] == param and param in response.json()["detail"]
    assert httpx.get(f"{scaling[0]}/scale_out", params={"status": "SLEEPING"}).json()["param"] == "query.status"


def test_scaling_server_never_logs_the_token(scaling):
    lines = scaling[1].lines
    assert any(line.startswith("uvicorn") for line in lines)  # the recorder really saw the server
    assert not any(TOKEN in line for line in lines)


# ----------------------------------------------------------------------------- weight, pause and group endpoints
# Bodies that reach the file system and the process-group code, against an in-process `relax serve` app whose
# engine is at hand: every rejected update must leave every weight and the version exactly as they were.

FILE_KINDS = ("valid",) * 8 + ("random_bytes", "huge_header", "truncated", "unknown_tensor", "wrong_shape",
                               "int_dtype", "nan", "empty", "directory")


@pytest.fixture(scope="module")
def weights_server(tiny_workspace, tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_root")
    recorder = _Recorder()
    logging.getLogger().addHandler(recorder)
    server = Server(tiny_workspace / "model", api_key=TOKEN, weight_update_root=root)
    try:
        yield server, root, recorder
    finally:
        server.stop()
        logging.getLogger().removeHandler(recorder)


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.model.named_parameters()}


_folders = iter(range(10**9))


def _new_folder(root: Path) -> Path:
    folder = root / f"case-{next(_folders)}"
    folder.mkdir()
    return folder


def _write_weight_file(path: Path, kind: str, tensors: dict[str, torch.Tensor]) -> None:
    if kind == "directory":
        path.mkdir()
        return
    if kind == "empty":
        path.write_bytes(b"")
        return
    if kind == "random_bytes":
        path.write_bytes(os.urandom(64))
        return
    if kind == "huge_header":
        path.write_bytes((2**62).to_bytes(8, "little") + b"{}")
        return
    tensors = dict(tensors)
    name = next(iter(tensors))
    if kind == "unknown_tensor":
        tensors["model.no_such_layer.weight"] = torch.zeros(2)
    elif kind == "wrong_shape":
        tensors[name] = torch.zeros(3, 5)
    elif kind == "int_dtype":
        tensors[name] = tensors[name].to(torch.int32)
    elif kind == "nan":
        tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(path))
    if kind == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 16])


@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(kinds=st.lists(st.sampled_from(FILE_KINDS), min_size=1, max_size=3),
       version=st.one_of(st.none(), st.sampled_from([-1, 0, 1]), st.integers(0, 2**64)),
       noise=st.floats(0.001, 1.0))
def test_weight_updates_from_disk_are_all_or_nothing(weights_server, kinds, version, noise):
    """A folder of 1-3 files, any of them broken (bytes, header, data, names, shapes, dtypes, values): the update
    is applied whole, or rejected with a 400 that leaves every weight and the version as they were."""
    server, root, _ = weights_server
    engine = server.engine
    before, served = _snapshot(engine), engine.weight_version
    folder = _new_folder(root)
    names = sorted(before)
    for index, kind in enumerate(kinds):
        share = names[index::len(kinds)] or names[:1]
        tensors = {name: before[name] + noise * torch.randn_like(before[name]) for name in share}
        _write_weight_file(folder / f"part-{index}.safetensors", kind, tensors)
    body = {"model_path": folder.name} if version is None else {"model_path": folder.name, "weight_version": version}
    response = httpx.post(f"{server.url}/update_weights_from_disk", json=body, headers=AUTH, timeout=60)
    assert response.status_code in (200, 400), response.text
    assert TOKEN not in response.text
    # a directory named *.safetensors is not a weight file (its share of the parameters is then missing);
    # versions never go backwards, but 0 starts a new run (a fresh trainer's initial weights)
    # every file must be a valid one: each holds a share of the parameters, and an update must name them all
    loadable = all(kind == "valid" for kind in kinds) and (
        version is None or ((version >= served or version == 0) and version <= 2**63 - 1))
    if response.status_code == 400:
        assert not loadable, response.text
        assert engine.weight_version == served
        after = _snapshot(engine)
        assert all(torch.equal(before[name], after[name]) for name in before), "a rejected update changed weights"
    else:
        assert loadable, response.text
        assert engine.weight_version == (served + 1 if version is None else version)
    assert not server.health()["paused"]
    shutil.rmtree(folder)


@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(model_path=st.one_of(
    st.sampled_from(["/", "/etc", "/proc/self", "..", "../..", "../../etc", "nowhere", "link-out", "a-file",
                     "x.safetensors", "case-0/../../..", "\x00", "a\x00b", "~", "." * 300, "\u00fc" * 200]),
    st.text(min_size=1, max_size=400),
    st.lists(st.sampled_from(["..", ".", "a", "x" * 255, "link-out"]), min_size=1, max_size=8).map("/".join)))
def test_weight_paths_outside_the_root_get_400(weights_server, model_path):
    server, root, _ = weights_server
    (root / "a-file").touch()
    (root / "x.safetensors").mkdir(exist_ok=True)
    if not (root / "link-out").is_symlink():
        (root / "link-out").symlink_to("/etc")
    version = server.engine.weight_version
    response = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": model_path}, headers=AUTH,
                          timeout=60)
    assert response.status_code == 400, response.text
    assert server.engine.weight_version == version


def test_missing_and_forbidden_paths_get_the_same_message(weights_server):
    server, root, _ = weights_server

    def message(path: str) -> str:
        response = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": path}, headers=AUTH)
        assert response.status_code == 400
        return response.json()["error"]["message"].replace(repr(path), "PATH")

    assert message("/etc") == message("/no/such/dir") == message("../../..") == message("a" * 300)


@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(timeout=st.one_of(st.floats(0.05, 0.3), st.sampled_from([0, -1, 1e300, 86400.5, float("inf"), float("nan")])),
       port=st.one_of(st.integers(-5, 70000), st.integers()), rank=st.integers(-2, 2**64),
       world=st.integers(-2, 2**64), address=st.sampled_from(["127.0.0.1", "", "256.0.0.1", "\u00fc.invalid", "x" * 300]),
       backend=st.sampled_from(["gloo", "nccl", "mpi"]))
def test_group_endpoints_answer_4xx_at_the_limits(weights_server, timeout, port, rank, world, address, backend):
    server, _, _ = weights_server
    body = json.dumps({"master_address": address, "master_port": port, "rank_offset": rank, "world_size": world,
                       "backend": backend, "timeout_s": timeout})  # json.dumps writes Infinity and NaN literals
    response = httpx.post(f"{server.url}/init_weights_update_group", content=body, timeout=60,
                          headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    distributed = httpx.post(f"{server.url}/update_weights_from_distributed", headers=AUTH, timeout=60,
                             json={"group_name": address, "weight_version": 1})
    assert distributed.status_code == 400, distributed.text


def test_a_weight_update_keeps_the_operators_pause(weights_server):
    server, root, _ = weights_server
    folder = _new_folder(root)
    _write_weight_file(folder / "model.safetensors", "valid", _snapshot(server.engine))
    assert httpx.post(f"{server.url}/pause_generation", headers=AUTH).status_code == 200
    result = {}

    def held_generation():
        result["response"] = httpx.post(f"{server.url}/generate", timeout=60,
                                        json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})

    thread = threading.Thread(target=held_generation)
    thread.start()
    try:
        wait_until(lambda: server.health()["in_flight_requests"] > 0, PROCESS_PATIENCE_S, "the held request")
        update = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": folder.name}, headers=AUTH)
        assert update.status_code == 200, update.text
        assert server.health()["paused"] is True
        thread.join(0.5)
        assert thread.is_alive() and "response" not in result, "a held request ran before /continue_generation"
    finally:
        assert httpx.post(f"{server.url}/continue_generation", headers=AUTH).status_code == 200
        thread.join(30)
    assert result["response"].status_code == 200


def test_weight_endpoints_never_log_the_token_or_a_traceback(weights_server):
    lines = weights_server[2].lines
    assert not any(TOKEN in line for line in lines)
    assert not any("Traceback" in line for line in lines)


# ----------------------------------------------------------------------------- headers that are not ASCII


@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(value=st.binary(min_size=1, max_size=40).map(lambda b: bytes(c for c in b if c >= 0x21 and c != 0x7f)),
       scheme=st.sampled_from([b"Bearer ", b"bearer ", b"", b"Basic "]))
def test_non_ascii_authorization_headers_get_401(scaling, serve, value, scheme):
    """Any byte a header may carry (latin-1 beyond ASCII included) is a wrong token, never a 500."""
    header = {"Authorization": (scheme + value).strip() or b"x"}
    for url in (f"{scaling[0]}/scale_out", f"{serve[0]}/pause_generation"):
        response = httpx.post(url, json={"num_replicas": 1} if "scale" in url else {}, headers=header, timeout=30)
        assert response.status_code == 401, response.text
