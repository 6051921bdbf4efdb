"""The OpenAI protocol over a `ServedModel`: /v1/models, /v1/completions and /v1/chat/completions, answered whole
or as server-sent events (``"stream": true``). A stream counts its sequences in flight while it runs, and a client
that goes away aborts its requests."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from relax.backends.inference.base import GenerationOutput, GenerationRequest, SamplingParams
from relax.data.chat_template import ChatTemplateError, apply_template
from relax.serving.limits import BadRequest
from relax.serving.protocol import ChatCompletionRequest, CompletionRequest
from relax.serving.responses import json_log_probs, text_tokens, token_pieces, usage
from relax.serving.served_model import CLIENT_GONE, ServedModel, error_body, trimmed_text

# The completion endpoints answer server-sent events when the body asks for "stream": true (the schema is an event's).
STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk as JSON; the last event is [DONE]"}}}}}}}


def openai_router(served: ServedModel) -> APIRouter:
    router = APIRouter()
    admission, limits, tokenizer = served.admission, served.limits, served.tokenizer

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.model_name, "object": "model", "created": 0,
                                            "owned_by": "relax", "root": served.model_path}]}

    @router.post("/v1/completions", responses=STREAM_RESPONSE)
    async def completions(body: CompletionRequest, http_request: Request) -> Any:
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and all(isinstance(item, int) for item in prompt):
            prompt = [list(prompt)]  # type: ignore[arg-type]
        admission.check([1] * len(prompt), body.n, 0, "prompt")
        prompts = [await served.encode(item, "prompt") if isinstance(item, str)
                   else list(item) for item in prompt]  # type: ignore[union-attr]
        if not prompts or any(not p for p in prompts):
            raise BadRequest("prompt: empty prompt", "prompt")
        params = body.to_engine(body.max_tokens or 16)
        limits.check(prompts, params.max_new_tokens, "prompt", "max_tokens")
        admission.check([len(p) for p in prompts], body.n, params.max_new_tokens, "prompt")
        return await _answer(served, http_request, body, prompts, params, chat=False)

    @router.post("/v1/chat/completions", responses=STREAM_RESPONSE)
    async def chat_completions(body: ChatCompletionRequest, http_request: Request) -> Any:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if not getattr(tokenizer, "chat_template", None):
            raise BadRequest("messages: the served tokenizer has no chat template; use /v1/completions", "messages")
        admission.check([1], body.n, 0, "messages")
        limits.check_text("".join(message["content"] for message in messages), "messages")
        try:
            text = await asyncio.to_thread(apply_template, tokenizer, messages, add_generation_prompt=True,
                                           **(body.chat_template_kwargs or {}))
        except ChatTemplateError as error:  # e.g. Qwen3's template refuses messages without a user message
            raise BadRequest(f"messages: {error}", "messages") from None
        prompt = list((await asyncio.to_thread(tokenizer, text, add_special_tokens=False))["input_ids"])
        params = body.to_engine(body.max_completion_tokens or body.max_tokens or 128)
        length_field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        limits.check([prompt], params.max_new_tokens, "messages", length_field)
        admission.check([len(prompt)], body.n, params.max_new_tokens, "messages")
        return await _answer(served, http_request, body, [prompt], params, chat=True)

    return router


async def _answer(served: ServedModel, http_request: Request, body: CompletionRequest | ChatCompletionRequest,
                  prompts: list[list[int]], params: SamplingParams, chat: bool) -> Any:
    """``body.n`` completions of each prompt, whole or streamed."""
    response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    requests = [GenerationRequest(f"{response_id}-{p}-{i}", prompt, params)
                for p, prompt in enumerate(prompts) for i in range(body.n)]
    want_logprobs = bool(body.logprobs) if chat else body.logprobs is not None
    if body.stream:
        served.admission.check_room(len(requests))  # a full server answers 429 before the stream starts
        stream = _ChoiceStream(served, body, requests, params, chat, response_id, created, want_logprobs)
        return StreamingResponse(stream.events(), media_type="text/event-stream")
    with served.admission.admit(len(requests)):
        outputs = await served.generate(http_request, requests)
    if outputs is None:
        return Response(status_code=CLIENT_GONE)
    choices = [_choice(served.tokenizer, index, output, params, chat, want_logprobs)
               for index, output in enumerate(outputs)]
    return {"id": response_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": body.model or served.model_name, "choices": choices, "usage": usage(prompts, outputs)}


def _choice(tokenizer: Any, index: int, output: GenerationOutput, params: SamplingParams, chat: bool,
            logprobs: bool) -> dict:
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


class _ChoiceStream:
    """One streamed answer: its chunks as server-sent events, token by token where the choices' text can be sent
    as it is decoded, else each choice whole at its end."""

    def __init__(self, served: ServedModel, body: CompletionRequest | ChatCompletionRequest,
                 requests: list[GenerationRequest], params: SamplingParams, chat: bool, response_id: str,
                 created: int, logprobs: bool) -> None:
        self.served, self.body, self.requests, self.params, self.chat = served, body, requests, params, chat
        self.response_id, self.created, self.logprobs = response_id, created, logprobs
        self.model = body.model or served.model_name
        # Token by token, unless stop strings (trimmed only once the response is known) or log-probs are asked for.
        self.incremental = not params.stop and not logprobs
        self.streamed: list[list[int]] = [[] for _ in requests]  # token ids sent so far, per choice
        self.sent_text = ["" for _ in requests]
        self.tokens: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        self.generation: asyncio.Future | None = None

    async def events(self) -> AsyncIterator[str]:
        """The stream counts its sequences in flight while it runs; a client that goes away (the response is
        cancelled) aborts its requests."""
        with self.served.admission.hold(len(self.requests)):
            try:
                async for event in self._events():
                    yield event
            finally:
                if self.generation is not None:  # the batcher aborts the requests of a call cancelled before it ended
                    self.generation.cancel()

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        payload = {"id": self.response_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                   "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    def _text_deltas(self) -> list[dict]:
        """The text decoded since the last chunk, per choice, in whole characters."""
        deltas = []
        while not self.tokens.empty():
            index, token = self.tokens.get_nowait()
            self.streamed[index].append(token)
        for index, tokens in enumerate(self.streamed):
            text = self.served.tokenizer.decode(tokens, skip_special_tokens=True)
            if len(text) > len(self.sent_text[index]) and not text.endswith("\ufffd"):  # whole characters only
                piece, self.sent_text[index] = text[len(self.sent_text[index]):], text
                deltas.append({"index": index, "delta": {"content": piece}, "finish_reason": None} if self.chat
                              else {"index": index, "text": piece, "logprobs": None, "finish_reason": None})
        return deltas

    async def _events(self) -> AsyncIterator[str]:
        chat, requests = self.chat, self.requests
        if chat:
            yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                               for i in range(len(requests))])
        if self.incremental:
            for index, request in enumerate(requests):
                request.on_token = lambda token, _lp, index=index: self.tokens.put_nowait((index, token))
        generation = self.generation = asyncio.ensure_future(self.served.batcher.generate(requests))
        while self.incremental and not generation.done():
            await asyncio.wait([generation], timeout=0.02)
            deltas = self._text_deltas()
            if deltas:
                yield self._chunk(deltas)
        try:
            outputs = await generation
        except Exception as error:  # noqa: BLE001 - reported in the stream, which has already started
            yield f"data: {json.dumps(error_body(f'generation failed: {error}', 500))}\n\n"
            yield "data: [DONE]\n\n"
            return
        for index, output in enumerate(outputs):
            full = _choice(self.served.tokenizer, index, output, self.params, chat, self.logprobs)
            final = full["message"]["content"] if chat else full["text"]
            sent = self.sent_text[index]
            rest = final[len(sent):] if final.startswith(sent) else ""
            if rest or not self.incremental:
                if chat:
                    delta = {"index": index, "delta": {"content": rest}, "logprobs": full["logprobs"],
                             "finish_reason": None}
                else:
                    delta = {"index": index, "text": rest, "logprobs": full["logprobs"], "finish_reason": None}
                yield self._chunk([delta])
            end = {"index": index, "finish_reason": output.finish_reason, "logprobs": None}
            end.update({"delta": {}} if chat else {"text": ""})
            yield self._chunk([end])
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            yield self._chunk([], usage=usage([r.input_ids for r in requests[::self.body.n]], outputs))
        yield "data: [DONE]\n\n"
