"""The FastAPI app of `relax serve`: an `InferenceEngine` behind SGLang's native HTTP protocol and
the OpenAI protocol.

Generation requests from concurrent HTTP calls are merged into few engine calls by a
`RequestBatcher`. Control endpoints (abort, pause, continue, flush, weight updates) require
``Authorization: Bearer <api_key>`` when an API key is set; the key is never logged or echoed.

What one client may take is bounded (docs/serving.md lists every bound and its flag): the request's body, time and
connection (`relax.utils.http_server.HTTPLimits`), its sequences and tokens and the server's sequences in flight
(`relax.serving.limits`). Text is tokenized off the event loop, after a cheap bound on its length, so no request
holds the loop that answers ``/health``. A request whose client goes away is aborted in the engine (plain and
streamed answers alike), and so is one a graceful stop gives up on: nobody decodes tokens nobody waits for.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from relax.backends.inference.base import GenerationOutput, GenerationRequest, InferenceEngine, SamplingParams
from relax.backends.inference.batcher import RequestBatcher
from relax.distributed.weight_broadcast import BroadcastReceiver, WeightSyncGroup
from relax.distributed.weight_sync import WeightSyncError
from relax.serving.auth import bearer_token_dependency
from relax.serving.limits import Admission, BadRequest, GenerationLimits, ModelLimits
from relax.serving.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    describe_validation_errors,
)
from relax.serving.responses import json_log_probs, sglang_result, text_tokens, token_pieces, usage
from relax.serving.weights import WeightPathError, update_weights_from_path
from relax.utils.http_server import wait_unless_client_gone

HEALTH_GENERATE_TIMEOUT_S = 20.0
CLIENT_GONE = 499  # nginx's "client closed request": only the access log ever sees it
# The OpenAI endpoints answer server-sent events when the body asks for "stream": true (the schema is an event's).
STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk as JSON; the last event is [DONE]"}}}}}}}


# OpenAI's error types by status; a 4xx is never a server error.
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error"}


def _error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    # OpenAI's error shape; SGLang clients read "error.message" or the status alone.
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def create_app(
    engine: InferenceEngine,
    tokenizer: Any,
    model_name: str = "default",
    model_path: str | None = None,
    api_key: str | None = None,
    batch_window_s: float = 0.005,
    weight_update_root: str | None = None,
    generation_limits: GenerationLimits | None = None,
) -> FastAPI:
    """Build the app; the engine must run on the event loop that serves the app (uvicorn's).
    ``weight_update_root``: /update_weights_from_disk refuses paths outside it (`relax.serving.weights`);
    ``generation_limits``: what one request may ask and the server hold (`relax.serving.limits`)."""
    batcher = RequestBatcher(engine, window_s=batch_window_s)
    limits = ModelLimits.of(engine, tokenizer)
    admission = Admission(generation_limits or GenerationLimits())

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

    async def encode(text: str, field: str) -> list[int]:
        """Token ids of ``text``, tokenized in a worker thread (a long text would hold the event loop)."""
        limits.check_text(text, field)
        return list((await asyncio.to_thread(tokenizer, text, add_special_tokens=True))["input_ids"])

    async def run(http_request: Request, requests: list[GenerationRequest]) -> list[GenerationOutput] | None:
        """The outputs of ``requests``, or None when the client went away first: then they are aborted (cancelling
        the batcher's call aborts its requests, `RequestBatcher.generate`)."""
        generation = asyncio.ensure_future(batcher.generate(requests))
        try:
            await wait_unless_client_gone(generation, http_request.receive)
        finally:
            abandoned = not generation.done()  # the client left, or a graceful stop cancelled this handler
            if abandoned:
                generation.cancel()
        if abandoned:
            return None
        try:
            return generation.result()
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
    async def generate(body: GenerateRequest, http_request: Request) -> Any:
        if body.text is not None:
            texts = body.text if isinstance(body.text, list) else [body.text]
            admission.check([1] * len(texts), 1, 0, "text")
            prompts = [await encode(text, "text") for text in texts]
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
        prompt_field = "text" if body.text is not None else "input_ids"
        limits.check(prompts, max(p.max_new_tokens for p in params), prompt_field, "sampling_params.max_new_tokens")
        admission.check([len(prompt) for prompt in prompts], 1, max(p.max_new_tokens for p in params), prompt_field)
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
        with admission.admit(len(requests)):
            outputs = await run(http_request, requests)
        if outputs is None:
            return Response(status_code=CLIENT_GONE)
        latency = time.perf_counter() - started
        results = [sglang_result(out, req, p, body.return_logprob, latency, trimmed_text)
                   for out, req, p in zip(outputs, requests, params)]
        return results if body.is_batch else results[0]

    @app.get("/health")
    async def health() -> dict[str, Any]:
        # The pid lets an operator (and the chaos tests) find the process behind an engine URL.
        return {**await engine.health(), **batcher.stats(), "inflight_sequences": admission.inflight_sequences,
                "pid": os.getpid()}

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
    async def completions(body: CompletionRequest, http_request: Request) -> Any:
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and all(isinstance(item, int) for item in prompt):
            prompt = [list(prompt)]  # type: ignore[arg-type]
        admission.check([1] * len(prompt), body.n, 0, "prompt")
        prompts = [await encode(item, "prompt") if isinstance(item, str) else list(item) for item in prompt]  # type: ignore[union-attr]
        if not prompts or any(not p for p in prompts):
            raise BadRequest("prompt: empty prompt", "prompt")
        params = body.to_engine(body.max_tokens or 16)
        limits.check(prompts, params.max_new_tokens, "prompt", "max_tokens")
        admission.check([len(p) for p in prompts], body.n, params.max_new_tokens, "prompt")
        return await _openai_response(http_request, body, prompts, params, chat=False)

    @app.post("/v1/chat/completions", responses=STREAM_RESPONSE)
    async def chat_completions(body: ChatCompletionRequest, http_request: Request) -> Any:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if not getattr(tokenizer, "chat_template", None):
            raise BadRequest("messages: the served tokenizer has no chat template; use /v1/completions", "messages")
        admission.check([1], body.n, 0, "messages")
        limits.check_text("".join(message["content"] for message in messages), "messages")
        text = await asyncio.to_thread(tokenizer.apply_chat_template, messages, add_generation_prompt=True,
                                       tokenize=False)
        prompt = list((await asyncio.to_thread(tokenizer, text, add_special_tokens=False))["input_ids"])
        params = body.to_engine(body.max_completion_tokens or body.max_tokens or 128)
        length_field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        limits.check([prompt], params.max_new_tokens, "messages", length_field)
        admission.check([len(prompt)], body.n, params.max_new_tokens, "messages")
        return await _openai_response(http_request, body, [prompt], params, chat=True)

    async def _openai_response(http_request: Request, body: CompletionRequest | ChatCompletionRequest,
                               prompts: list[list[int]], params: SamplingParams, chat: bool) -> Any:
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        requests = [GenerationRequest(f"{response_id}-{p}-{i}", prompt, params)
                    for p, prompt in enumerate(prompts) for i in range(body.n)]
        want_logprobs = bool(body.logprobs) if chat else body.logprobs is not None
        if body.stream:
            admission.check_room(len(requests))  # a full server answers 429 before the stream starts
            return StreamingResponse(
                _stream(body, requests, params, chat, response_id, created, want_logprobs),
                media_type="text/event-stream")
        with admission.admit(len(requests)):
            outputs = await run(http_request, requests)
        if outputs is None:
            return Response(status_code=CLIENT_GONE)
        choices = [_choice(index, output, params, chat, want_logprobs) for index, output in enumerate(outputs)]
        return {"id": response_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": body.model or model_name, "choices": choices, "usage": usage(prompts, outputs)}

    def _choice(index: int, output: GenerationOutput, params: SamplingParams, chat: bool, logprobs: bool) -> dict:
        text = trimmed_text(output, params.stop)
        choice: dict[str, Any] = {"index": index, "finish_reason": output.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if logprobs:
            tokens, offsets = text_tokens(token_pieces(tokenizer, output.output_ids), text)
            log_probs = json_log_probs(output)[:len(tokens)]
            if chat:
                choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                                   "top_logprobs": []} for t, lp in zip(tokens, log_probs)]}
            else:
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": log_probs, "top_logprobs": None,
                                      "text_offset": offsets}
        return choice

    async def _stream(body, requests, params, chat, response_id, created, logprobs) -> AsyncIterator[str]:
        """The answer as server-sent events; the stream counts its sequences in flight while it runs, and a client
        that goes away (the response is cancelled) aborts its requests."""
        generation: list[asyncio.Future] = []
        with admission.hold(len(requests)):
            try:
                async for event in _events(body, requests, params, chat, response_id, created, logprobs, generation):
                    yield event
            finally:
                if generation:  # the batcher aborts the requests of a call cancelled before it ended
                    generation[0].cancel()

    async def _events(body, requests, params, chat, response_id, created, logprobs,
                      generation_holder: list[asyncio.Future]) -> AsyncIterator[str]:
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
        generation_holder.append(generation)
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
            yield chunk([], usage=usage([r.input_ids for r in requests[::body.n]], outputs))
        yield "data: [DONE]\n\n"

    return app
