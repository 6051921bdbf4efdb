"""The FastAPI app of `relax serve`: an `InferenceEngine` behind SGLang's native HTTP protocol and
the OpenAI protocol.

Generation requests from concurrent HTTP calls are merged into few engine calls by a
`RequestBatcher`. Control endpoints (abort, pause, continue, flush, weight updates) require
``Authorization: Bearer <api_key>`` when an API key is set; the key is never logged or echoed.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from relax.backends.inference.base import GenerationOutput, GenerationRequest, InferenceEngine, SamplingParams
from relax.backends.inference.batcher import RequestBatcher
from relax.backends.routing_replay import encode_routes
from relax.distributed.weight_broadcast import BroadcastReceiver, WeightSyncGroup
from relax.distributed.weight_sync import WeightSyncError
from relax.serving.auth import bearer_token_dependency
from relax.serving.protocol import (
    NEW_TOKEN_FIELDS,
    TOKEN_ID_MARKER,
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    SGLangSamplingParams,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    describe_validation_errors,
)
from relax.serving.weights import WeightPathError, update_weights_from_path

HEALTH_GENERATE_TIMEOUT_S = 20.0
# The OpenAI endpoints answer server-sent events when the body asks for "stream": true (the schema is an event's).
STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk as JSON; the last event is [DONE]"}}}}}}}


class BadRequest(HTTPException):
    """HTTP 400 with a message naming the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message)
        self.param = param


@dataclass(frozen=True)
class ModelLimits:
    """What a prompt must fit: token ids below ``vocab_size`` and prompt + new tokens within ``context_length``
    (None: unknown, not checked). Outside them the engine fails deep inside a forward (an index error, or a
    mask of max_new_tokens columns allocated up front), which would be a 500 or an out-of-memory."""

    vocab_size: int | None = None
    context_length: int | None = None

    @classmethod
    def of(cls, engine: InferenceEngine) -> ModelLimits:
        model = getattr(engine, "model", None)  # the embedded engine's Hugging Face model
        if model is None:
            return cls()
        text_config = model.config.get_text_config()
        return cls(model.get_input_embeddings().num_embeddings,
                   getattr(text_config, "max_position_embeddings", None))

    def check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, prompt_field: str,
              length_field: str) -> None:
        """Raise `BadRequest` naming ``prompt_field`` or ``length_field`` for the first prompt that does not fit."""
        for index, prompt in enumerate(prompts):
            if self.vocab_size is not None:
                bad = next((token for token in prompt if not 0 <= token < self.vocab_size), None)
                if bad is not None:
                    raise BadRequest(f"{prompt_field}: token id {bad} of prompt {index} is outside the "
                                     f"vocabulary [0, {self.vocab_size})", prompt_field)
            if self.context_length is None:
                continue
            if len(prompt) >= self.context_length:
                raise BadRequest(f"{prompt_field}: prompt {index} has {len(prompt)} tokens; the model's context "
                                 f"length is {self.context_length}", prompt_field)
            if len(prompt) + max_new_tokens > self.context_length:
                raise BadRequest(f"{length_field}: {len(prompt)} prompt tokens + {max_new_tokens} new tokens exceed "
                                 f"the model's context length {self.context_length}", length_field)

    def publish(self, openapi: dict[str, Any]) -> None:
        """Write the limits into the app's OpenAPI document, so that clients and fuzzers see the bounds this
        server enforces."""
        _publish_token_id_maximum(openapi, None if self.vocab_size is None else self.vocab_size - 1)
        if self.context_length is None:
            return
        schemas = openapi.get("components", {}).get("schemas", {})
        for model, fields in NEW_TOKEN_FIELDS.items():
            for name in fields:
                field = schemas.get(model, {}).get("properties", {}).get(name, {})
                for option in field.get("anyOf", [field]):
                    if option.get("type") == "integer":
                        option["maximum"] = self.context_length - 1  # the prompt takes at least one token


def _publish_token_id_maximum(node: Any, maximum: int | None) -> None:
    """Replace each token-id marker of a JSON schema by ``maximum`` (None: drop the marker)."""
    if isinstance(node, dict):
        if node.pop(TOKEN_ID_MARKER, False) and maximum is not None:
            node["maximum"] = maximum
        children = list(node.values())
    else:
        children = node if isinstance(node, list) else []
    for child in children:
        _publish_token_id_maximum(child, maximum)


def _error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    # OpenAI's error shape; SGLang clients read "error.message" or the status alone.
    kind = "invalid_request_error" if status == 400 else "authentication_error" if status == 401 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def create_app(
    engine: InferenceEngine,
    tokenizer: Any,
    model_name: str = "default",
    model_path: str | None = None,
    api_key: str | None = None,
    batch_window_s: float = 0.005,
    weight_update_root: str | None = None,
) -> FastAPI:
    """Build the app; the engine must run on the event loop that serves the app (uvicorn's).
    ``weight_update_root``: /update_weights_from_disk refuses paths outside it (`relax.serving.weights`)."""
    batcher = RequestBatcher(engine, window_s=batch_window_s)
    limits = ModelLimits.of(engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    # Every 4xx has one documented shape; declaring "4XX" also keeps FastAPI from publishing a 422 that this
    # app never sends (bad bodies are 400).
    errors = {"4XX": {"model": ErrorResponse, "description": "bad request (400, naming the field), missing or "
                      "wrong token (401), ..."}}
    app = FastAPI(title="relax serve", description="The relax embedded inference engine over HTTP "
                  "(SGLang native protocol and OpenAI protocol).", lifespan=lifespan, responses=errors)
    app.state.engine, app.state.batcher, app.state.tokenizer = engine, batcher, tokenizer

    def openapi_with_limits() -> dict[str, Any]:
        if app.openapi_schema is None:
            limits.publish(FastAPI.openapi(app))  # FastAPI.openapi builds and caches app.openapi_schema
        return app.openapi_schema

    app.openapi = openapi_with_limits
    control = [Depends(bearer_token_dependency(api_key))]

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(error.errors())
        return JSONResponse(_error_body(message, 400, param), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(_error_body(str(error.detail), error.status_code, getattr(error, "param", None)),
                            status_code=error.status_code, headers=getattr(error, "headers", None))

    # ------------------------------------------------------------------------- helpers

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])

    async def run(requests: list[GenerationRequest]) -> list[GenerationOutput]:
        try:
            return await batcher.generate(requests)
        except (ValueError, TypeError) as error:  # the engine's request validation
            raise BadRequest(str(error)) from error

    def trimmed_text(output: GenerationOutput, stop: list[str]) -> str:
        """The output text cut before the first matched stop string (OpenAI and SGLang default)."""
        text = output.text
        if output.finish_reason == "stop" and stop:
            cuts = [text.find(s) for s in stop if s and s in text]
            if cuts:
                text = text[: min(cuts)]
        return text

    # ------------------------------------------------------------------------- SGLang native

    @app.post("/generate")
    async def generate(body: GenerateRequest) -> Any:
        if body.text is not None:
            texts = body.text if isinstance(body.text, list) else [body.text]
            prompts = [encode(text) for text in texts]
        else:
            prompts = body.input_ids if body.is_batch else [body.input_ids]  # type: ignore[list-item]
        if not prompts:
            raise BadRequest("input_ids/text: the batch is empty", "input_ids" if body.text is None else "text")
        for index, prompt in enumerate(prompts):
            if not prompt:
                field = "text" if body.text is not None else "input_ids"
                raise BadRequest(f"{field}[{index}]: the prompt has no tokens", field)
        params = body.sampling_params if isinstance(body.sampling_params, list) else \
            [body.sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise BadRequest(f"sampling_params: {len(params)} sets for {len(prompts)} prompts", "sampling_params")
        limits.check(prompts, max(p.max_new_tokens for p in params), "text" if body.text is not None else "input_ids",
                     "sampling_params.max_new_tokens")
        if isinstance(body.rid, list):
            if len(body.rid) != len(prompts):
                raise BadRequest(f"rid: {len(body.rid)} ids for {len(prompts)} prompts", "rid")
            rids = body.rid
        else:
            base = body.rid or uuid.uuid4().hex
            rids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
        requests = [GenerationRequest(rid, list(prompt), p.to_engine(), return_routed_experts=body.return_routed_experts)
                    for rid, prompt, p in zip(rids, prompts, params)]
        started = time.perf_counter()
        outputs = await run(requests)
        latency = time.perf_counter() - started
        results = [_sglang_result(out, req, p, body.return_logprob, latency, trimmed_text)
                   for out, req, p in zip(outputs, requests, params)]
        return results if body.is_batch else results[0]

    @app.get("/health")
    async def health() -> dict[str, Any]:
        # The pid lets an operator (and the chaos tests) find the process behind an engine URL.
        return {**await engine.health(), **batcher.stats(), "pid": os.getpid()}

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        state = await engine.health()
        if state.get("paused"):
            return JSONResponse({"status": "paused", "weight_version": engine.weight_version})
        prompt = [tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0]
        request = GenerationRequest(f"health-{uuid.uuid4().hex}", prompt,
                                    SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
        try:
            [output] = await asyncio.wait_for(batcher.generate([request]), HEALTH_GENERATE_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - any failure means unhealthy
            await batcher.abort([request.request_id])
            return JSONResponse(_error_body(f"generation failed: {type(error).__name__}: {error}", 503),
                                status_code=503)
        if not all(math.isfinite(lp) for lp in output.output_log_probs):  # NaN weights generate garbage
            return JSONResponse(_error_body("generation failed: the served weights give non-finite log-probs", 503),
                                status_code=503)
        return JSONResponse({"status": "ok", "weight_version": engine.weight_version})

    @app.post("/abort_request", dependencies=control)
    async def abort_request(body: AbortRequest) -> dict[str, Any]:
        if body.abort_all:
            await batcher.abort(None)
        else:
            rids = [body.rid] if isinstance(body.rid, str) else body.rid
            if not any(rids):
                raise BadRequest("rid: give a request id (or abort_all: true)", "rid")
            await batcher.abort(rids)
        return {"success": True}

    @app.post("/pause_generation", dependencies=control)
    async def pause_generation() -> dict[str, Any]:
        await engine.pause()
        return {"success": True, "message": "paused: in-flight requests wait at their next step"}

    @app.post("/continue_generation", dependencies=control)
    async def continue_generation() -> dict[str, Any]:
        await engine.resume()
        return {"success": True}

    @app.post("/flush_cache", dependencies=control)
    async def flush_cache() -> dict[str, Any]:
        # The embedded engine keeps no KV cache between requests: nothing to flush.
        return {"success": True, "message": "no cache to flush"}

    @app.post("/update_weights_from_disk", dependencies=control)
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> JSONResponse:
        try:
            version = await update_weights_from_path(engine, body.model_path, body.weight_version, weight_update_root)
        except (WeightPathError, WeightSyncError, KeyError, ValueError) as error:
            message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
            param = getattr(error, "param", "model_path")
            return JSONResponse({"success": False, "message": f"{param}: {message}",
                                 **_error_body(f"{param}: {message}", 400, param)}, status_code=400)
        return JSONResponse({"success": True, "message": f"serving weight version {version}",
                             "weight_version": version})

    weight_groups: dict[str, BroadcastReceiver] = {}

    @app.post("/init_weights_update_group", dependencies=control)
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest) -> JSONResponse:
        if body.rank_offset >= body.world_size:
            raise BadRequest(f"rank_offset {body.rank_offset} is outside world_size {body.world_size}", "rank_offset")
        try:  # the rendezvous blocks until every rank joined: off the loop, so the server keeps serving
            group = await asyncio.to_thread(WeightSyncGroup.init, body.master_address, body.master_port,
                                            body.rank_offset, body.world_size, body.backend, body.timeout_s)
        except (RuntimeError, ValueError, OSError) as error:  # unreachable, unresolvable, refused, timed out
            return JSONResponse({"success": False, **_error_body(f"init_weights_update_group: {error}", 400,
                                                                 "master_address")}, status_code=400)
        if body.group_name in weight_groups:
            weight_groups[body.group_name].group.close()
        weight_groups[body.group_name] = BroadcastReceiver(group, engine)
        return JSONResponse({"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"})

    @app.post("/update_weights_from_distributed", dependencies=control)
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest) -> JSONResponse:
        receiver = weight_groups.get(body.group_name)
        if receiver is None:
            raise BadRequest(f"no weight-sync group {body.group_name!r}: call /init_weights_update_group first",
                             "group_name")
        try:
            metrics = await receiver.receive(body.weight_version)
        except WeightSyncError as error:
            return JSONResponse({"success": False, **_error_body(str(error), 400, "weight_version")},
                                status_code=400)
        return JSONResponse({"success": True, "weight_version": metrics.version, "seconds": metrics.seconds,
                             "message": f"serving weight version {metrics.version}"})

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {"model_path": model_path, "tokenizer_path": model_path, "served_model_name": model_name,
                "is_generation": True, "weight_version": engine.weight_version}

    # ------------------------------------------------------------------------- OpenAI

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "relax",
                                            "root": model_path}]}

    @app.post("/v1/completions", responses=STREAM_RESPONSE)
    async def completions(body: CompletionRequest) -> Any:
        prompt = body.prompt
        if isinstance(prompt, str):
            prompts = [encode(prompt)]
        elif prompt and all(isinstance(item, int) for item in prompt):
            prompts = [list(prompt)]  # type: ignore[arg-type]
        else:
            prompts = [encode(item) if isinstance(item, str) else list(item) for item in prompt]  # type: ignore[union-attr]
        if not prompts or any(not p for p in prompts):
            raise BadRequest("prompt: empty prompt", "prompt")
        params = body.to_engine(body.max_tokens or 16)
        limits.check(prompts, params.max_new_tokens, "prompt", "max_tokens")
        return await _openai_response(body, prompts, params, chat=False)

    @app.post("/v1/chat/completions", responses=STREAM_RESPONSE)
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if not getattr(tokenizer, "chat_template", None):
            raise BadRequest("messages: the served tokenizer has no chat template; use /v1/completions", "messages")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        params = body.to_engine(body.max_completion_tokens or body.max_tokens or 128)
        limits.check([prompt], params.max_new_tokens, "messages",
                     "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
        return await _openai_response(body, [prompt], params, chat=True)

    async def _openai_response(body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                               params: SamplingParams, chat: bool) -> Any:
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        requests = [GenerationRequest(f"{response_id}-{p}-{i}", prompt, params)
                    for p, prompt in enumerate(prompts) for i in range(body.n)]
        want_logprobs = bool(body.logprobs) if chat else body.logprobs is not None
        if body.stream:
            return StreamingResponse(
                _stream(body, requests, params, chat, response_id, created, want_logprobs),
                media_type="text/event-stream")
        outputs = await run(requests)
        choices = [_choice(index, output, params, chat, want_logprobs) for index, output in enumerate(outputs)]
        return {"id": response_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": body.model or model_name, "choices": choices, "usage": _usage(prompts, outputs)}

    def _choice(index: int, output: GenerationOutput, params: SamplingParams, chat: bool, logprobs: bool) -> dict:
        text = trimmed_text(output, params.stop)
        choice: dict[str, Any] = {"index": index, "finish_reason": output.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if logprobs:
            tokens = [tokenizer.decode([token]) for token in output.output_ids]
            if chat:
                choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                                   "top_logprobs": []}
                                                  for t, lp in zip(tokens, json_log_probs(output))]}
            else:
                offsets, position = [], 0
                for token in tokens:
                    offsets.append(position)
                    position += len(token)
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": json_log_probs(output),
                                      "top_logprobs": None, "text_offset": offsets}
        return choice

    async def _stream(body, requests, params, chat, response_id, created, logprobs) -> AsyncIterator[str]:
        model = body.model or model_name
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            payload = {"id": response_id, "object": kind, "created": created, "model": model, "choices": choices}
            if usage is not None:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        if chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                         for i in range(len(requests))])
        # Token by token, unless stop strings (trimmed only once the response is known) or log-probs are asked for.
        incremental = not params.stop and not logprobs
        streamed = [[] for _ in requests]  # token ids sent so far, per choice
        sent_text = ["" for _ in requests]
        queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        if incremental:
            for index, request in enumerate(requests):
                request.on_token = lambda token, _lp, index=index: queue.put_nowait((index, token))

        def text_deltas() -> list[dict]:
            deltas = []
            while not queue.empty():
                index, token = queue.get_nowait()
                streamed[index].append(token)
            for index, tokens in enumerate(streamed):
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                if len(text) > len(sent_text[index]) and not text.endswith("\ufffd"):  # whole characters only
                    piece, sent_text[index] = text[len(sent_text[index]):], text
                    deltas.append({"index": index, "delta": {"content": piece}, "finish_reason": None} if chat
                                  else {"index": index, "text": piece, "logprobs": None, "finish_reason": None})
            return deltas

        generation = asyncio.ensure_future(batcher.generate(requests))
        while incremental and not generation.done():
            await asyncio.wait([generation], timeout=0.02)
            deltas = text_deltas()
            if deltas:
                yield chunk(deltas)
        try:
            outputs = await generation
        except Exception as error:  # noqa: BLE001 - reported in the stream, which has already started
            yield f"data: {json.dumps(_error_body(f'generation failed: {error}', 500))}\n\n"
            yield "data: [DONE]\n\n"
            return
        for index, output in enumerate(outputs):
            full = _choice(index, output, params, chat, logprobs)
            final = full["message"]["content"] if chat else full["text"]
            rest = final[len(sent_text[index]):] if final.startswith(sent_text[index]) else ""
            if rest or not incremental:
                if chat:
                    delta = {"index": index, "delta": {"content": rest}, "logprobs": full["logprobs"],
                             "finish_reason": None}
                else:
                    delta = {"index": index, "text": rest, "logprobs": full["logprobs"], "finish_reason": None}
                yield chunk([delta])
            end = {"index": index, "finish_reason": output.finish_reason, "logprobs": None}
            end.update({"delta": {}} if chat else {"text": ""})
            yield chunk([end])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], usage=_usage([r.input_ids for r in requests[::body.n]], outputs))
        yield "data: [DONE]\n\n"

    return app


def json_log_probs(output: GenerationOutput) -> list[float | None]:
    """Log-probs as JSON allows them: a non-finite one (only broken weights give one) becomes null, not the
    `NaN` literal that no JSON parser accepts."""
    return [lp if math.isfinite(lp) else None for lp in output.output_log_probs]


def _usage(prompts: list[list[int]], outputs: list[GenerationOutput]) -> dict[str, int]:
    # Every prompt of the request counts, repeated ones too; n samples of one prompt count it once, as OpenAI does.
    prompt_tokens = sum(len(ids) for ids in prompts)
    completion_tokens = sum(len(output.output_ids) for output in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sglang_result(output: GenerationOutput, request: GenerationRequest, params: SGLangSamplingParams,
                   return_logprob: bool, latency_s: float, trimmed_text) -> dict[str, Any]:
    finish: dict[str, Any] = {"type": output.finish_reason}
    stop_ids = set(request.sampling_params.stop_token_ids)
    if output.finish_reason == "length":
        finish["length"] = len(output.output_ids)
    elif output.finish_reason == "stop":
        last = output.output_ids[-1] if output.output_ids else None
        matched = next((s for s in request.sampling_params.stop if s in output.text), None)
        finish["matched"] = matched if matched is not None and last not in stop_ids else last
    else:
        finish["message"] = "aborted"
    stop = [] if params.no_stop_trim else request.sampling_params.stop
    meta: dict[str, Any] = {
        "id": request.request_id,
        "finish_reason": finish,
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": len(output.output_ids),
        "cached_tokens": 0,
        "weight_version": output.weight_version,
        "e2e_latency": latency_s,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, token, None]
                                         for lp, token in zip(json_log_probs(output), output.output_ids)]
        if output.output_weight_versions is not None:
            meta["output_token_weight_versions"] = output.output_weight_versions
    if output.routed_experts is not None:
        meta["routed_experts"] = encode_routes(output.routed_experts)
    return {"text": trimmed_text(output, stop), "output_ids": output.output_ids, "meta_info": meta}
