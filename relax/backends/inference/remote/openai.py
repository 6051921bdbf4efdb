"""`InferenceEngine` over HTTP against an OpenAI-protocol server (vLLM, `relax serve`, ...).

Generation is ``POST /v1/completions`` with the prompt as a list of token ids, ``logprobs: 1``,
``max_tokens`` and the sampling options (``top_k``, ``stop_token_ids``, ``ignore_eos`` are vLLM's
extensions). The OpenAI protocol returns the sampled tokens as strings; to get ids back:

- the request sets vLLM's ``return_tokens_as_token_ids: true``, with which vLLM answers each token as
  ``"token_id:<id>"``: those are parsed exactly;
- servers that ignore that option (`relax serve` among them: its ``logprobs.tokens`` are
  ``tokenizer.decode([id])``) need ``tokenizer``: each string is mapped back through the table
  ``decode([id]) -> id`` of the served vocabulary. A string that several ids decode to (byte-fallback
  pieces, for instance) cannot be mapped and raises an error naming the server.

There is no per-token weight version in this protocol: outputs carry the version last reported by the
server (``GET /get_model_info``) or set by `update_weights`. Weight updates use ``POST
/update_weights_from_disk`` (SGLang's endpoint, which `relax serve` has) through a shared filesystem like
`SGLangHTTPEngine`; a server without it (plain vLLM) raises NotImplementedError. Abort cancels the
HTTP request (vLLM aborts a request whose connection closes); pause holds new requests in this client and
also pauses the server when it has ``/pause_generation``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from relax.backends.inference.base import (
    PAUSE_OPERATOR,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    InferenceEngine,
    PauseHolds,
)
from relax.backends.inference.remote.sglang import (
    EngineHTTPError,
    HTTPClient,
    SGLangHTTPEngine,
    _as_version,
    distinct_seeds,
)

TOKEN_ID_PREFIX = "token_id:"


class OpenAIHTTPEngine(InferenceEngine):
    def __init__(self, base_url: str, model: str, api_key: str | None = None, tokenizer: Any = None,
                 timeout_s: float = 600.0, weights_dir: str | Path | None = None,
                 control_timeout_s: float = 30.0) -> None:
        self.http = HTTPClient(base_url, api_key, timeout_s)
        self.base_url = self.http.base_url
        self.model = model
        self.tokenizer = tokenizer
        self.control_timeout_s = control_timeout_s
        # Weight loading speaks SGLang's endpoint; the SGLang adapter does the disk half.
        self._weights = SGLangHTTPEngine(base_url, api_key, weights_dir=weights_dir)
        self._weights.http = self.http
        self.weights_dir = self._weights.weights_dir
        self._weight_version = 0
        self._pauses = PauseHolds()
        self._tasks: dict[str, asyncio.Task] = {}
        self._token_ids: dict[str, int | None] | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r}, model={self.model!r})"

    @property
    def weight_version(self) -> int:
        return self._weight_version

    # ---------------------------------------------------------------------------- generation

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        requests = distinct_seeds(requests)
        tasks = []
        for request in requests:
            task = asyncio.ensure_future(self._generate_one(request))
            self._tasks[request.request_id] = task
            tasks.append(task)
        try:
            outputs = []
            for request, task in zip(requests, tasks):
                try:
                    outputs.append(await task)
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                        raise
                    outputs.append(GenerationOutput(request.request_id, [], [], "abort", self._weight_version))
            return outputs
        finally:
            for request, task in zip(requests, tasks):
                if self._tasks.get(request.request_id) is task:
                    del self._tasks[request.request_id]
                task.cancel()

    async def _generate_one(self, request: GenerationRequest) -> GenerationOutput:
        if request.multimodal_inputs:
            raise NotImplementedError(f"{self!r}: multimodal requests are not supported over HTTP yet "
                                      f"(request {request.request_id})")
        while self._pauses:
            await asyncio.sleep(0.01)
        p = request.sampling_params
        body: dict[str, Any] = {
            "model": self.model, "prompt": list(request.input_ids), "max_tokens": p.max_new_tokens,
            "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "logprobs": 1, "n": 1,
            "stop": list(p.stop) or None, "stop_token_ids": list(p.stop_token_ids), "ignore_eos": p.ignore_eos,
            "return_tokens_as_token_ids": True, "skip_special_tokens": False, "include_stop_str_in_output": True,
        }
        if p.seed is not None:
            body["seed"] = p.seed
        answer = await self.http.request("POST", "/v1/completions", json=body)
        try:
            choice = answer["choices"][0]
            logprobs = choice.get("logprobs") or {}
            tokens = logprobs.get("tokens") or []
            log_probs = [float(value) for value in logprobs.get("token_logprobs") or []]
        except (KeyError, IndexError, TypeError, ValueError) as error:
            raise EngineHTTPError(f"POST {self.base_url}/v1/completions: unexpected answer for request "
                                  f"{request.request_id}: {str(answer)[:200]}", self.base_url,
                                  "/v1/completions") from error
        output_ids = [self._token_id(token) for token in tokens]
        if len(log_probs) != len(output_ids):
            raise EngineHTTPError(f"POST {self.base_url}/v1/completions: {len(output_ids)} tokens but "
                                  f"{len(log_probs)} log-probs", self.base_url, "/v1/completions")
        finish = choice.get("finish_reason")
        reason: FinishReason = finish if finish in ("stop", "length", "abort") else "stop"
        # The server's text keeps special tokens (we ask for them, to get every id back): "951<|im_end|>" would fail
        # rule rewards such as exact_match. With a tokenizer, decode as the embedded engine does.
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True) if self.tokenizer is not None \
            else choice.get("text") or ""
        return GenerationOutput(request.request_id, output_ids, log_probs, reason, self._weight_version, text=text)

    def _token_id(self, token: str) -> int:
        if token.startswith(TOKEN_ID_PREFIX):
            return int(token[len(TOKEN_ID_PREFIX):])
        if self.tokenizer is None:
            raise EngineHTTPError(
                f"{self.base_url}/v1/completions answered token strings, not ids (it ignores "
                "return_tokens_as_token_ids); give OpenAIHTTPEngine a tokenizer to map them back", self.base_url,
                "/v1/completions")
        if self._token_ids is None:
            table: dict[str, int | None] = {}
            for token_id in range(len(self.tokenizer)):
                text = self.tokenizer.decode([token_id])
                table[text] = None if text in table else token_id  # None: ambiguous
            self._token_ids = table
        token_id = self._token_ids.get(token)
        if token_id is None:
            raise EngineHTTPError(f"{self.base_url}/v1/completions: token string {token!r} maps to "
                                  f"{'several' if token in self._token_ids else 'no'} token ids of the tokenizer; "
                                  "use a server that honours return_tokens_as_token_ids (vLLM)", self.base_url,
                                  "/v1/completions")
        return token_id

    # ---------------------------------------------------------------------------- control

    async def abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            task = self._tasks.get(request_id)
            if task is not None:
                task.cancel()

    async def pause(self, owner: str = PAUSE_OPERATOR) -> None:
        if self._pauses.hold(owner):
            await self.http.request("POST", "/pause_generation", json={}, timeout_s=self.control_timeout_s,
                                    allow_404=True)

    async def resume(self, owner: str = PAUSE_OPERATOR) -> None:
        if self._pauses.release(owner):
            await self.http.request("POST", "/continue_generation", json={}, timeout_s=self.control_timeout_s,
                                    allow_404=True)

    async def health(self) -> dict[str, Any]:
        await self.http.request("GET", "/v1/models", timeout_s=self.control_timeout_s)
        info = await self.http.request("GET", "/get_model_info", timeout_s=self.control_timeout_s, allow_404=True)
        if isinstance(info, dict) and "weight_version" in info:
            self._weight_version = _as_version(info["weight_version"], self._weight_version)
        return {"status": "ok", "url": self.base_url, "weight_version": self._weight_version, "paused": bool(self._pauses)}

    # ---------------------------------------------------------------------------- weights

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self.publish_weights(named_tensors, version)
        await self.load_weights(version)

    async def publish_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self._weights.publish_weights(named_tensors, version)

    async def load_weights(self, version: int | None = None) -> int:
        try:
            self._weight_version = await self._weights.load_weights(version)
        except EngineHTTPError as error:
            if error.status in (404, 405):
                raise NotImplementedError(
                    f"{self.base_url} has no /update_weights_from_disk endpoint (a plain OpenAI/vLLM server): "
                    "it cannot take weight updates from relax; serve the model with `relax serve` or SGLang"
                ) from error
            raise
        return self._weight_version

    async def aclose(self) -> None:
        await self.http.aclose()
