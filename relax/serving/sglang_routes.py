"""SGLang's native HTTP protocol over a `ServedModel`: /generate, the health checks, the control endpoints (abort,
pause, continue, flush) and the weight updates (from disk, over a distributed group), as SGLang's router and
Relax's own rollout call them. The control endpoints take the ``control`` dependencies (the bearer token)."""

from __future__ import annotations

import asyncio
import math
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.distributed.weight_broadcast import BroadcastReceiver, WeightSyncGroup
from relax.distributed.weight_sync import WeightSyncError
from relax.serving.limits import BadRequest
from relax.serving.protocol import (
    AbortRequest,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
)
from relax.serving.responses import sglang_result
from relax.serving.served_model import CLIENT_GONE, ServedModel, error_body, trimmed_text
from relax.serving.weights import WeightPathError, update_weights_from_path

HEALTH_GENERATE_TIMEOUT_S = 20.0


def sglang_router(served: ServedModel, control: Sequence[Depends], weight_update_root: str | None) -> APIRouter:
    """The native routes. ``weight_update_root``: /update_weights_from_disk refuses paths outside it
    (`relax.serving.weights`)."""
    router = APIRouter()
    engine, batcher, admission, limits = served.engine, served.batcher, served.admission, served.limits

    @router.post("/generate")
    async def generate(body: GenerateRequest, http_request: Request) -> Any:
        if body.text is not None:
            texts = body.text if isinstance(body.text, list) else [body.text]
            admission.check([1] * len(texts), 1, 0, "text")
            prompts = [await served.encode(text, "text") for text in texts]
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
        requests = [GenerationRequest(rid, list(prompt), p.to_engine(),
                                      return_routed_experts=body.return_routed_experts)
                    for rid, prompt, p in zip(rids, prompts, params)]
        started = time.perf_counter()
        with admission.admit(len(requests)):
            outputs = await served.generate(http_request, requests)
        if outputs is None:
            return Response(status_code=CLIENT_GONE)
        latency = time.perf_counter() - started
        results = [sglang_result(out, req, p, body.return_logprob, latency, trimmed_text)
                   for out, req, p in zip(outputs, requests, params)]
        return results if body.is_batch else results[0]

    @router.get("/health")
    async def health() -> dict[str, Any]:
        # The pid lets an operator (and the chaos tests) find the process behind an engine URL.
        return {**await engine.health(), **batcher.stats(), "inflight_sequences": admission.inflight_sequences,
                "pid": os.getpid()}

    @router.get("/health_generate")
    async def health_generate() -> JSONResponse:
        state = await engine.health()
        if state.get("paused"):
            return JSONResponse({"status": "paused", "weight_version": engine.weight_version})
        eos = served.tokenizer.eos_token_id
        request = GenerationRequest(f"health-{uuid.uuid4().hex}", [eos if eos is not None else 0],
                                    SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
        try:
            [output] = await asyncio.wait_for(batcher.generate([request]), HEALTH_GENERATE_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - any failure means unhealthy
            await batcher.abort([request.request_id])
            return JSONResponse(error_body(f"generation failed: {type(error).__name__}: {error}", 503),
                                status_code=503)
        if not all(math.isfinite(lp) for lp in output.output_log_probs):  # NaN weights generate garbage
            return JSONResponse(error_body("generation failed: the served weights give non-finite log-probs", 503),
                                status_code=503)
        return JSONResponse({"status": "ok", "weight_version": engine.weight_version})

    @router.post("/abort_request", dependencies=control)
    async def abort_request(body: AbortRequest) -> dict[str, Any]:
        if body.abort_all:
            await batcher.abort(None)
        else:
            rids = [body.rid] if isinstance(body.rid, str) else body.rid
            if not any(rids):
                raise BadRequest("rid: give a request id (or abort_all: true)", "rid")
            await batcher.abort(rids)
        return {"success": True}

    @router.post("/pause_generation", dependencies=control)
    async def pause_generation() -> dict[str, Any]:
        await engine.pause()
        return {"success": True, "message": "paused: in-flight requests wait at their next step"}

    @router.post("/continue_generation", dependencies=control)
    async def continue_generation() -> dict[str, Any]:
        await engine.resume()
        return {"success": True}

    @router.post("/flush_cache", dependencies=control)
    async def flush_cache() -> dict[str, Any]:
        # The embedded engine keeps no KV cache between requests: nothing to flush.
        return {"success": True, "message": "no cache to flush"}

    @router.post("/update_weights_from_disk", dependencies=control)
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> JSONResponse:
        try:
            version = await update_weights_from_path(engine, body.model_path, body.weight_version, weight_update_root)
        except (WeightPathError, WeightSyncError, KeyError, ValueError) as error:
            message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
            param = getattr(error, "param", "model_path")
            return JSONResponse({"success": False, "message": f"{param}: {message}",
                                 **error_body(f"{param}: {message}", 400, param)}, status_code=400)
        return JSONResponse({"success": True, "message": f"serving weight version {version}",
                             "weight_version": version})

    weight_groups: dict[str, BroadcastReceiver] = {}

    @router.post("/init_weights_update_group", dependencies=control)
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest) -> JSONResponse:
        if body.rank_offset >= body.world_size:
            raise BadRequest(f"rank_offset {body.rank_offset} is outside world_size {body.world_size}", "rank_offset")
        try:  # the rendezvous blocks until every rank joined: off the loop, so the server keeps serving
            group = await asyncio.to_thread(WeightSyncGroup.init, body.master_address, body.master_port,
                                            body.rank_offset, body.world_size, body.backend, body.timeout_s)
        except (RuntimeError, ValueError, OSError) as error:  # unreachable, unresolvable, refused, timed out
            return JSONResponse({"success": False, **error_body(f"init_weights_update_group: {error}", 400,
                                                                "master_address")}, status_code=400)
        if body.group_name in weight_groups:
            weight_groups[body.group_name].group.close()
        weight_groups[body.group_name] = BroadcastReceiver(group, engine)
        return JSONResponse({"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"})

    @router.post("/update_weights_from_distributed", dependencies=control)
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest) -> JSONResponse:
        receiver = weight_groups.get(body.group_name)
        if receiver is None:
            raise BadRequest(f"no weight-sync group {body.group_name!r}: call /init_weights_update_group first",
                             "group_name")
        try:
            metrics = await receiver.receive(body.weight_version)
        except WeightSyncError as error:
            return JSONResponse({"success": False, **error_body(str(error), 400, "weight_version")},
                                status_code=400)
        return JSONResponse({"success": True, "weight_version": metrics.version, "seconds": metrics.seconds,
                             "message": f"serving weight version {metrics.version}"})

    @router.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {"model_path": served.model_path, "tokenizer_path": served.model_path,
                "served_model_name": served.model_name, "is_generation": True, "weight_version": engine.weight_version}

    return router
