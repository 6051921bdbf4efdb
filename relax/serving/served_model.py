"""What both protocols of `relax serve` answer from: the engine with its batcher, tokenizer and bounds
(`ServedModel`), and the pieces every route shares (the error shape, a generation that ends when its client leaves,
the stop-string trim)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from relax.backends.inference.base import GenerationOutput, GenerationRequest, InferenceEngine
from relax.backends.inference.batcher import RequestBatcher
from relax.serving.limits import Admission, BadRequest, ModelLimits
from relax.utils.http_server import wait_unless_client_gone

CLIENT_GONE = 499  # nginx's "client closed request": only the access log ever sees it

# OpenAI's error types by status; a 4xx is never a server error.
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error"}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape; SGLang clients read "error.message" or the status alone."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def trimmed_text(output: GenerationOutput, stop: list[str]) -> str:
    """The output text cut before the first matched stop string (OpenAI and SGLang default)."""
    text = output.text
    if output.finish_reason == "stop" and stop:
        cuts = [text.find(s) for s in stop if s and s in text]
        if cuts:
            text = text[: min(cuts)]
    return text


@dataclass
class ServedModel:
    """The engine one `relax serve` process answers for, and what bounds the requests it takes."""

    engine: InferenceEngine
    batcher: RequestBatcher
    tokenizer: Any
    limits: ModelLimits  # what the model can take (context, vocabulary)
    admission: Admission  # what one request may ask and the server hold in flight
    model_name: str  # the name /v1/models lists and answers carry
    model_path: str | None  # where the weights were loaded from (/get_model_info)

    async def encode(self, text: str, field: str) -> list[int]:
        """Token ids of ``text``, tokenized in a worker thread (a long text would hold the event loop)."""
        self.limits.check_text(text, field)
        return list((await asyncio.to_thread(self.tokenizer, text, add_special_tokens=True))["input_ids"])

    async def generate(self, http_request: Request,
                       requests: list[GenerationRequest]) -> list[GenerationOutput] | None:
        """The outputs of ``requests``, or None when the client went away first: then they are aborted (cancelling
        the batcher's call aborts its requests, `RequestBatcher.generate`)."""
        generation = asyncio.ensure_future(self.batcher.generate(requests))
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
