"""The elastic-scaling REST API of the Rollout service (upstream's endpoints and bodies, relax-upstream.md §5):
``POST /scale_out``, ``GET /scale_out``, ``GET /scale_out/{id}``, ``POST /scale_out/{id}/cancel``,
``POST /scale_in``, ``GET /scale_in``, ``GET /scale_in/{id}``, ``GET /engines``.

Rules live in `relax.rollout.scaling.ScaleManager`; this module maps them to HTTP: a conflict is 409, a rejected
request 400, an unknown id 404. Every endpoint that changes the engine set takes a bearer token when one is set.
Errors are FastAPI's ``{"detail": ...}``; a bad body or query is 400 with the field path in ``param`` too.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from relax.rollout.scaling import (
    ScaleConflictError,
    ScaleInRequest,
    ScaleManager,
    ScaleOperation,
    ScaleOutRequest,
    ScaleRejectedError,
    ScaleStatus,
)
from relax.serving.auth import bearer_token_dependency
from relax.serving.protocol import describe_validation_errors


class _BadRequest(HTTPException):
    def __init__(self, detail: str, param: str | None) -> None:
        super().__init__(400, detail)
        self.param = param


class ScalingError(BaseModel):
    """Every 4xx answer of the scaling API."""

    detail: str
    param: str | None = Field(None, description="a bad body or query: the path of the offending field")


def scaling_routes(manager: ScaleManager, api_key: str | None = None) -> APIRouter:
    authorized = bearer_token_dependency(api_key)

    def started(op: ScaleOperation) -> ScaleOperation:
        if op.status == ScaleStatus.REJECTED:
            raise HTTPException(400, op.error_message or "rejected")
        return op

    def run(action):
        try:
            return started(action())
        except ScaleConflictError as err:
            raise HTTPException(409, str(err)) from None
        except ScaleRejectedError as err:
            raise _BadRequest(str(err), err.param) from None

    def find(request_id: str, kind: str) -> ScaleOperation:
        op = manager.operations.get(request_id)
        if op is None or op.kind != kind:
            raise HTTPException(404, f"no {kind} operation {request_id!r}")
        return op

    routes = APIRouter()

    @routes.post("/scale_out", dependencies=[Depends(authorized)])
    async def scale_out(request: ScaleOutRequest) -> ScaleOperation:
        return run(lambda: manager.scale_out(request))

    def listing(kind: str, status: ScaleStatus | None) -> dict:
        ops = manager.list(kind, status)
        return {"requests": ops, "total_count": len(ops), "status_filter": status}

    @routes.get("/scale_out")
    async def list_scale_out(status: ScaleStatus | None = None) -> dict:
        return listing("scale_out", status)

    @routes.get("/scale_out/{request_id}")
    async def scale_out_status(request_id: str) -> ScaleOperation:
        return find(request_id, "scale_out")

    @routes.post("/scale_out/{request_id}/cancel", dependencies=[Depends(authorized)])
    async def cancel(request_id: str) -> dict:
        find(request_id, "scale_out")
        try:
            op = manager.cancel(request_id)
        except ScaleRejectedError as err:
            raise HTTPException(400, str(err)) from None
        return {"request_id": request_id, "status": op.status, "message": op.message}

    @routes.post("/scale_in", dependencies=[Depends(authorized)])
    async def scale_in(request: ScaleInRequest) -> ScaleOperation:
        return run(lambda: manager.scale_in(request))

    @routes.get("/scale_in")
    async def list_scale_in(status: ScaleStatus | None = None) -> dict:
        return listing("scale_in", status)

    @routes.get("/scale_in/{request_id}")
    async def scale_in_status(request_id: str) -> ScaleOperation:
        return find(request_id, "scale_in")

    @routes.get("/engines")
    async def engines() -> dict:
        await manager.refresh_replicas()  # a Serve deployment's replicas as Serve sees them now
        table = manager.engine_table()
        return {"models": {"default": {"engines": table}}, "total_engines": len(table)}

    return routes


def create_scaling_app(manager: ScaleManager, api_key: str | None = None) -> FastAPI:
    # Declaring "4XX" also keeps FastAPI from publishing a 422 that this app never sends.
    app = FastAPI(title="Relax rollout scaling", responses={"4XX": {"model": ScalingError,
                                                                   "description": "400, 401, 404 or 409"}})
    app.include_router(scaling_routes(manager, api_key))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(error.errors())
        return JSONResponse({"detail": message, "param": param}, status_code=400)

    @app.exception_handler(_BadRequest)
    async def _bad_request(_: Request, error: _BadRequest) -> JSONResponse:
        return JSONResponse({"detail": error.detail, "param": error.param}, status_code=400)

    return app
