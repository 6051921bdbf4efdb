"""`InferenceEngine` over HTTP against a server speaking SGLang's native protocol (`relax serve` or real SGLang).

One `generate` call is one ``POST /generate`` batch (``input_ids``, per-request ``sampling_params``,
``return_logprob: true``), so the server sees the call's requests together and decodes them as one batch. Weight updates go through a shared filesystem: the tensors are
written with `relax.distributed.weight_disk.DiskPublisher` under ``weights_dir`` (a versioned
``vNNNNNNNN`` directory with a manifest) and the server is told to load that directory with
``POST /update_weights_from_disk``. **This transport needs ``weights_dir`` to be readable by the server at
the same path** (one machine, or a shared/network filesystem).

Errors name the server URL and the endpoint. Connection failures, timeouts and HTTP 5xx raise
`EngineUnavailableError` (the `EngineRouter` retries those on another engine); other HTTP errors raise
`EngineHTTPError`. The API key (``Authorization: Bearer``) is never logged or put in an error message.

HTTP traffic runs on a background event loop of its own (`io_loop`): a trainer that computes on the
caller's loop (the in-process fully-async trainer blocks it for seconds per step) must not hold back the
requests of the next rollout or the answers of the current one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import torch

from relax.backends.inference.base import (
    PAUSE_OPERATOR,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    InferenceEngine,
    OutputCallback,
    OutputReporter,
    PauseHolds,
    positions_by_group,
)
from relax.backends.models.routing_replay import decode_routes
from relax.distributed.weight_disk import DiskPublisher, complete_versions, version_dir
from relax.utils.urls import join_url, parse_http_url, redact_url, scrub, url_secrets

logger = logging.getLogger(__name__)

SEED_STRIDE = 1_000_003  # distinct seeds for requests that share one (see `distinct_seeds`)
# One POST /generate carries at most this many sequences (a larger call is split into concurrent posts): well below
# what relax serve takes per request (--max-sequences-per-request, 1024).
MAX_SEQUENCES_PER_POST = 512
# A server that is full answers 429 with Retry-After; the client waits that long (at most this) and retries, within
# the request's timeout.
MAX_RETRY_AFTER_S = 5.0


class EngineHTTPError(RuntimeError):
    """An engine server answered with an error (or an unreadable body); ``retryable`` is False."""

    retryable = False

    def __init__(self, message: str, url: str = "", endpoint: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.url, self.endpoint, self.status = url, endpoint, status


class EngineUnavailableError(EngineHTTPError):
    """The server could not be reached, timed out or failed (HTTP 5xx): another engine may serve the request."""

    retryable = True


def distinct_seeds(requests: Sequence[GenerationRequest]) -> list[GenerationRequest]:
    """Give requests that share a seed distinct ones: the k-th request (k = 0, 1, ...) with seed s gets
    ``s + k * 1_000_003`` (mod 2**63), so the first keeps its seed.

    A rollout step seeds all its requests alike, which an in-process engine turns into one generator for the
    batch; a server seeds each request on its own, so equal seeds would give every sample of a GRPO group the
    same response. Applying this twice changes nothing more (the seeds are already distinct)."""
    seen: dict[int, int] = {}
    result = []
    for request in requests:
        seed = request.sampling_params.seed
        if seed is None:
            result.append(request)
            continue
        count = seen.get(seed, 0)
        seen[seed] = count + 1
        if count:
            params = replace(request.sampling_params, seed=(seed + count * SEED_STRIDE) % (2**63))
            request = replace(request, sampling_params=params)
        result.append(request)
    return result


_io_loop: asyncio.AbstractEventLoop | None = None
_io_loop_lock = threading.Lock()


def io_loop() -> asyncio.AbstractEventLoop:
    """The process's HTTP event loop, on a daemon thread started at first use."""
    global _io_loop
    with _io_loop_lock:
        if _io_loop is None:
            _io_loop = asyncio.new_event_loop()
            threading.Thread(target=_io_loop.run_forever, name="relax-http-io", daemon=True).start()
        return _io_loop


async def on_io_loop(coroutine: Any) -> Any:
    """Run ``coroutine`` on `io_loop` and await its result here; cancelling the caller cancels it there."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, io_loop()))


class HTTPClient:
    """An `httpx.AsyncClient` on the HTTP loop (`io_loop`), bounded timeouts, bearer token, and errors that
    name the URL and endpoint."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float, connect_timeout_s: float = 10.0) -> None:
        try:
            parse_http_url(base_url)
        except ValueError as error:
            raise ValueError(f"engine address {redact_url(base_url)} {error}") from None
        self._url = base_url.rstrip("/")  # credentials and query included: used to reach the server only
        self.base_url = redact_url(self._url)  # what logs, errors and the engine's name show
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._secrets = url_secrets(self._url) + ([api_key] if api_key else [])  # never in an error message
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._http: httpx.AsyncClient | None = None  # created and used on the HTTP loop only

    def _client(self) -> httpx.AsyncClient:
        if self._http is None or self._http.is_closed:
            self._http = httpx.AsyncClient(headers=self._headers, timeout=self.timeout,
                                           limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return self._http

    async def request(self, method: str, endpoint: str, json: Any = None, timeout_s: float | None = None,
                      allow_404: bool = False) -> Any:
        """The decoded JSON body (None for an empty one); raises `EngineUnavailableError` / `EngineHTTPError`."""
        return await on_io_loop(self._request(method, endpoint, json, timeout_s, allow_404))

    async def _request(self, method: str, endpoint: str, json: Any, timeout_s: float | None,
                       allow_404: bool) -> Any:
        where = join_url(self.base_url, endpoint)
        timeout = self.timeout if timeout_s is None else httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
        deadline = time.monotonic() + (timeout.read if timeout_s is None else timeout_s)
        while True:
            try:
                response = await self._client().request(method, join_url(self._url, endpoint), json=json,
                                                        timeout=timeout)
            except httpx.TimeoutException as error:
                raise EngineUnavailableError(f"{method} {where}: timed out ({type(error).__name__})", self.base_url,
                                             endpoint) from error
            except httpx.TransportError as error:
                raise EngineUnavailableError(f"{method} {where}: cannot reach the engine ({type(error).__name__}: "
                                             f"{scrub(str(error), self._secrets)})", self.base_url, endpoint) from error
            wait = _retry_after(response)
            if wait is None or time.monotonic() + wait > deadline:
                break
            await asyncio.sleep(wait)  # the server is full for now (429): its requests in flight will finish
        if response.status_code == 404 and allow_404:
            return None
        if response.status_code >= 400:
            kind = EngineUnavailableError if response.status_code >= 500 else EngineHTTPError
            raise kind(f"{method} {where}: HTTP {response.status_code}: {scrub(_error_message(response), self._secrets)}",
                       self.base_url, endpoint, response.status_code)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            if endpoint == "/health":
                return None  # real SGLang answers /health with an empty or plain body
            raise EngineHTTPError(f"{method} {where}: the answer is not JSON: {scrub(response.text[:200], self._secrets)!r}",
                                  self.base_url, endpoint, response.status_code) from None

    async def aclose(self) -> None:
        if self._http is not None:
            client, self._http = self._http, None
            await on_io_loop(client.aclose())


def _retry_after(response: httpx.Response) -> float | None:
    """Seconds to wait before retrying a 429 (its Retry-After, bounded), else None."""
    if response.status_code != 429:
        return None
    try:
        return min(max(float(response.headers.get("retry-after", "1")), 0.0), MAX_RETRY_AFTER_S)
    except ValueError:
        return 1.0


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key])
    return str(body)[:300]


def _as_version(value: Any, fallback: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return fallback  # real SGLang may report a non-numeric version name


def _sampling_body(request: GenerationRequest) -> dict[str, Any]:
    """SGLang's ``sampling_params`` of one request."""
    p = request.sampling_params
    params: dict[str, Any] = {
        "max_new_tokens": p.max_new_tokens, "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
        "stop": list(p.stop), "stop_token_ids": list(p.stop_token_ids), "ignore_eos": p.ignore_eos,
        "no_stop_trim": True,  # keep a matched stop string in "text", as the embedded engine does
    }
    if p.seed is not None:
        params["seed"] = p.seed
    return params


class SGLangHTTPEngine(InferenceEngine):
    """An SGLang-protocol server at ``base_url``.

    ``weights_dir``: where `update_weights` writes versioned safetensors for the server to load (the server
    must see the same path: a shared filesystem). ``timeout_s`` bounds one generation request (the read
    timeout); control calls use ``control_timeout_s``."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0,
                 weights_dir: str | Path | None = None, control_timeout_s: float = 30.0,
                 weights_timeout_s: float = 600.0, keep_last_versions: int = 2) -> None:
        self.http = HTTPClient(base_url, api_key, timeout_s)
        self.base_url = self.http.base_url
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.control_timeout_s = control_timeout_s
        self.weights_timeout_s = weights_timeout_s
        self.keep_last_versions = keep_last_versions
        self._weight_version = 0
        self._pauses = PauseHolds()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    @property
    def weight_version(self) -> int:
        """The version last reported by the server (health, generation or weight update)."""
        return self._weight_version

    def note_weight_version(self, version: int) -> None:
        """Record a version the server confirmed it serves (after a weight update by another transport)."""
        self._weight_version = version

    # ---------------------------------------------------------------------------- generation

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """All requests in one ``POST /generate`` batch (per-request sampling params, as SGLang takes them): the
        server sees the whole call at once and can decode it as one batch."""
        requests = distinct_seeds(requests)
        for request in requests:
            if request.multimodal_inputs:
                raise NotImplementedError(f"{self!r}: multimodal requests are not supported over HTTP yet "
                                          f"(request {request.request_id})")
        if not requests:
            return []
        if len(requests) > MAX_SEQUENCES_PER_POST:  # a server bounds one request's sequences (relax serve: 1024)
            chunks = [requests[i:i + MAX_SEQUENCES_PER_POST] for i in range(0, len(requests), MAX_SEQUENCES_PER_POST)]
            return [output for chunk in await asyncio.gather(*(self.generate(c) for c in chunks)) for output in chunk]
        body = {"input_ids": [list(r.input_ids) for r in requests],
                "sampling_params": [_sampling_body(r) for r in requests], "return_logprob": True,
                "rid": [r.request_id for r in requests]}
        if any(r.return_routed_experts for r in requests):
            body["return_routed_experts"] = True
        results = await self.http.request("POST", "/generate", json=body)
        if not isinstance(results, list) or len(results) != len(requests):
            raise EngineHTTPError(f"POST {self.base_url}/generate: expected {len(requests)} results for a batch, got "
                                  f"{str(results)[:200]}", self.base_url, "/generate")
        return [self._parse_generation(request, result) for request, result in zip(requests, results)]

    async def generate_streaming(self, requests: Sequence[GenerationRequest],
                                 on_output: OutputCallback | None) -> list[GenerationOutput]:
        """`generate`, one ``POST /generate`` per prompt group, all at once: each group is reported when its answer
        comes (the server batches the concurrent posts as it batches one; each request keeps the seed one batched
        call would give it, so the samples are the same)."""
        requests = distinct_seeds(requests)
        groups = positions_by_group(requests)
        if len(groups) <= 1:
            return await super().generate_streaming(requests, on_output)
        report = OutputReporter(len(requests), on_output)

        async def post(positions: list[int]) -> None:
            for position, output in zip(positions, await self.generate([requests[p] for p in positions])):
                report(position, output)

        await asyncio.gather(*(post(positions) for positions in groups.values()))
        return [report.outputs[position] for position in range(len(requests))]

    def _parse_generation(self, request: GenerationRequest, result: Any) -> GenerationOutput:
        if not isinstance(result, dict) or not isinstance(result.get("meta_info"), dict):
            raise EngineHTTPError(f"POST {self.base_url}/generate: unexpected answer for request "
                                  f"{request.request_id}: {str(result)[:200]}", self.base_url, "/generate")
        meta = result["meta_info"]
        entries = meta.get("output_token_logprobs") or []
        log_probs = [float(entry[0]) for entry in entries]
        output_ids = result.get("output_ids")
        if output_ids is None:
            output_ids = [int(entry[1]) for entry in entries]
        output_ids = [int(token) for token in output_ids]
        if len(log_probs) != len(output_ids):
            raise EngineHTTPError(f"POST {self.base_url}/generate: {len(output_ids)} output ids but "
                                  f"{len(log_probs)} log-probs for request {request.request_id}", self.base_url,
                                  "/generate")
        version = _as_version(meta.get("weight_version"), self._weight_version)
        self._weight_version = version
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        reason: FinishReason = kind if kind in ("stop", "length", "abort") else "stop"
        versions = meta.get("output_token_weight_versions")
        routed = None
        if request.return_routed_experts:
            if not isinstance(meta.get("routed_experts"), str):
                raise EngineHTTPError(f"POST {self.base_url}/generate: no routed experts for request "
                                      f"{request.request_id} (an SGLang server needs --enable-return-routed-experts)",
                                      self.base_url, "/generate")
            routed = decode_routes(meta["routed_experts"])
        return GenerationOutput(
            request_id=request.request_id, output_ids=output_ids, output_log_probs=log_probs, finish_reason=reason,
            weight_version=version, text=result.get("text") or "",
            output_weight_versions=[int(v) for v in versions] if versions else None, routed_experts=routed,
        )

    # ---------------------------------------------------------------------------- control

    async def abort(self, request_ids: Sequence[str]) -> None:
        # One call per id: SGLang's /abort_request takes a single rid.
        await asyncio.gather(*(self.http.request("POST", "/abort_request", json={"rid": rid},
                                                 timeout_s=self.control_timeout_s) for rid in request_ids))

    async def pause(self, owner: str = PAUSE_OPERATOR) -> None:
        if self._pauses.hold(owner):  # the server is paused once, whoever else holds a pause here
            await self.http.request("POST", "/pause_generation", json={}, timeout_s=self.control_timeout_s)

    async def resume(self, owner: str = PAUSE_OPERATOR) -> None:
        if self._pauses.release(owner):
            await self.http.request("POST", "/continue_generation", json={}, timeout_s=self.control_timeout_s)

    async def health(self) -> dict[str, Any]:
        body = await self.http.request("GET", "/health", timeout_s=self.control_timeout_s)
        state = body if isinstance(body, dict) else {"status": "ok"}
        if "weight_version" in state:
            self._weight_version = _as_version(state["weight_version"], self._weight_version)
        return {**state, "url": self.base_url}

    # ---------------------------------------------------------------------------- weights

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write ``named_tensors`` as ``version`` under ``weights_dir``, then have the server load it."""
        await self.publish_weights(named_tensors, version)
        await self.load_weights(version)

    async def publish_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """The trainer's half: write one versioned directory (engines sharing ``weights_dir`` need it once)."""
        root = self._require_weights_dir()
        await DiskPublisher(root, keep_last=self.keep_last_versions).publish([list(named_tensors)], version)

    async def load_weights(self, version: int | None = None) -> int:
        """The server's half: load ``version`` (default: the newest complete one) from ``weights_dir``."""
        root = self._require_weights_dir()
        if version is None:
            versions = complete_versions(root)
            if not versions:
                raise FileNotFoundError(f"{self!r}: no complete weight version under {root}")
            version = versions[-1]
        body = {"model_path": str(version_dir(root, version).resolve()), "weight_version": version}
        answer = await self.http.request("POST", "/update_weights_from_disk", json=body,
                                         timeout_s=self.weights_timeout_s)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineHTTPError(f"POST {self.base_url}/update_weights_from_disk: {answer.get('message')}",
                                  self.base_url, "/update_weights_from_disk")
        served = answer.get("weight_version") if isinstance(answer, dict) else None
        self._weight_version = _as_version(served, version)
        return self._weight_version

    def _require_weights_dir(self) -> Path:
        if self.weights_dir is None:
            raise ValueError(f"{self!r}: weight updates need weights_dir (--rollout-weights-dir), a directory the "
                             "server can read at the same path")
        return self.weights_dir

    async def aclose(self) -> None:
        await self.http.aclose()
