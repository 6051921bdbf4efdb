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

This module assembles the app: the error shape of every 4xx, the OpenAPI schema with the bounds, and the two
protocols' routes (`relax.serving.sglang_routes`, `relax.serving.openai_routes`) over one `ServedModel`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from relax.backends.inference.base import InferenceEngine
from relax.backends.inference.batcher import RequestBatcher
from relax.serving.auth import bearer_token_dependency
from relax.serving.limits import Admission, GenerationLimits, ModelLimits
from relax.serving.openai_routes import openai_router
from relax.serving.protocol import ErrorResponse, describe_validation_errors
from relax.serving.served_model import ServedModel, error_body
from relax.serving.sglang_routes import sglang_router


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
    served = ServedModel(engine, batcher, tokenizer, ModelLimits.of(engine, tokenizer),
                         Admission(generation_limits or GenerationLimits()), model_name, model_path)

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
            served.limits.publish(FastAPI.openapi(app))  # FastAPI.openapi builds and caches app.openapi_schema
        return app.openapi_schema

    app.openapi = openapi_with_limits

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(error.errors())
        return JSONResponse(error_body(message, 400, param), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(error.detail), error.status_code, getattr(error, "param", None)),
                            status_code=error.status_code, headers=getattr(error, "headers", None))

    app.include_router(sglang_router(served, [Depends(bearer_token_dependency(api_key))], weight_update_root))
    app.include_router(openai_router(served))
    return app
