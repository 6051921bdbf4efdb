"""The in-process inference engine: a Hugging Face causal LM held in this process, served by the engine core.

Every request runs on the engine core (`relax.backends.inference.engine_core.core.EngineCore`): one step loop with
continuous batching, per-request sampling streams, stop checks, aborts, pauses and per-token weight versions. The
core is handed one of two runners (`CoreSettings.mode`, ``--engine-core``): the *paged* runner, the core's own
decoder over a paged KV pool with CUDA graphs on CUDA, for the families it runs (Llama, Qwen2, Qwen3 and the
Qwen-VL / Qwen2.5-Omni ones; `engine_core.decoder.unsupported_reason`), and the *model-cache* runner, the model's own
Hugging Face forward and cache, for every other family (mixture-of-experts with routing-replay capture, linear
attention, MLA, sliding windows, Qwen3-VL's deepstack features). This class is the engine's face: requests' checks,
weights, memory, pauses, recovery, scoring.

Concurrency model. Everything runs on the caller's event-loop thread: the core runs one step, then yields to the
loop, so `abort`, `pause` and `update_weights` (coroutines on the same loop) always act between two steps and a
weight update never lands inside one. Keeping the model code on one thread matters on CPU: a second thread gets its
own OpenMP team, which competes with the training thread's spinning team and measured 1.7x slower per step here.
Requests wait at step boundaries while the engine is paused and are released by an abort, so ``pause();
abort(ids)`` returns the aborted outputs without a `resume`. Concurrent `generate` calls share one running batch.
Callers on other threads use ``asyncio.run_coroutine_threadsafe`` with the engine's loop.

Weight versions. Each token records the version that produced it, in `GenerationOutput.output_weight_versions`;
``weight_version`` is the version of the last step the request took part in. The per-token list holds more than one
version only when `update_weights` ran while the request was in flight.

Reproducibility. Every request samples from noise keyed by its own seed and the index of the token (see
`engine_core.core`), so the same requests with the same seeds give the same samples whatever else shares their
steps, on either runner (up to the forwards' numerics).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from relax.backends.inference.base import (
    PAUSE_OPERATOR,
    GenerationOutput,
    GenerationRequest,
    InferenceEngine,
    OutputCallback,
    OutputReporter,
    PauseHolds,
    ScoreOutput,
    ScoreRequest,
)
from relax.backends.inference.engine_core.block_manager import BlockManager
from relax.backends.inference.engine_core.cache_runner import CacheRunner
from relax.backends.inference.engine_core.core import EngineCore
from relax.backends.inference.engine_core.decoder import TextDecoder, unsupported_reason
from relax.backends.inference.engine_core.fp8 import Fp8Linears
from relax.backends.inference.engine_core.kv_cache import check_kv_cache_dtype, kv_bytes_per_token, pool_problem
from relax.backends.inference.engine_core.media import MediaEncoder
from relax.backends.inference.engine_core.paged_runner import PagedRunner
from relax.backends.inference.engine_core.scheduler import CohortScheduler, Scheduler, pool_refusal
from relax.backends.inference.engine_core.step_runner import triton_available
from relax.backends.models.family import MediaTokens, load_model
from relax.backends.models.routing_replay import RoutingRecorder, moe_routers

logger = logging.getLogger(__name__)

# How often a paused batch checks for resume or abort. An asyncio.Event would bind the engine to one
# event loop; polling keeps it usable from successive `asyncio.run` calls.
PAUSE_POLL_S = 0.001


@dataclass(frozen=True)
class CoreSettings:
    """How the engine core (`relax.backends.inference.engine_core`) is sized.

    ``mode`` picks the core's runner: ``auto`` the paged one for the models it runs (on every device) and the
    model-cache one otherwise; ``on`` the paged one, refusing a model it cannot run (saying why); ``off`` the
    model-cache one for every model (the model's own forward: a reference for the paged one). ``mem_fraction_static``: on CUDA the KV
    pool takes this share of the device memory free when the engine starts (after the weights, a colocated
    trainer's and other engines'); ``max_total_tokens`` sets the pool's size in tokens instead (default on CPU:
    65,536 tokens, at most 256 MiB). ``max_prefill_tokens``: the prompt tokens one prefill step computes at
    most. ``page_size``: token slots per KV block. ``cuda_graphs``: decode in CUDA graphs up to
    ``max_graph_batch`` sequences. ``fp8``: the decoder's projections in FP8 (`engine_core.fp8`; paged runner only).
    ``kv_cache_dtype``: ``auto`` (the model's dtype) or ``fp8_e4m3`` (`engine_core.kv_cache`; paged runner only).
    ``session_idle_s``: an agent session's pinned K/V is let go after this long without a turn (`engine_core.
    scheduler`).
    """

    mode: str = "auto"
    mem_fraction_static: float = 0.4
    max_total_tokens: int | None = None
    max_prefill_tokens: int = 8192
    page_size: int = 16
    cuda_graphs: bool = True
    max_graph_batch: int = 256
    fp8: bool = False
    session_idle_s: float = 300.0
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "on", "off"):
            raise ValueError(f"engine core mode must be auto, on or off, got {self.mode!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"--max-total-tokens {self.max_total_tokens} holds no page of --page-size "
                             f"{self.page_size} (a KV pool needs a block at least)")


_ENGINE_NUMBERS = itertools.count()
CPU_KV_TOKENS = 65536
CPU_KV_BYTES = 256 * 1024 * 1024


MEMORY_TAGS = ("weights", "kv_cache")


def _memory_tags(tags: Sequence[str] | None) -> set[str]:
    """SGLang's memory tags; None means all of them."""
    chosen = set(MEMORY_TAGS if tags is None else tags)
    unknown = chosen - set(MEMORY_TAGS)
    if unknown:
        raise ValueError(f"unknown memory tags {sorted(unknown)}; known: {', '.join(MEMORY_TAGS)}")
    return chosen


class EmbeddedEngine(InferenceEngine):
    """`InferenceEngine` over a Hugging Face causal LM held in this process.

    ``model`` is put in eval mode with gradients off; it stays on its device and dtype.
    ``max_batch_size`` caps the sequences the core runs at once (more wait their turn). ``core`` (`CoreSettings`)
    picks and sizes the core's runner (module docstring).

    ``max_recoveries`` (``--use-fault-tolerance`` sets it to ``--rollout-engine-max-relaunches``): a generation
    that fails with an out-of-memory error (`is_recoverable`) is recovered in place that many times over the
    engine's life: the core is rebuilt (a fresh KV pool, sized to the memory free now, and scheduler) and every
    request of the failed calls is decoded again from its prompt, with its own seed, so it samples what it would
    have. Other errors, and one past the limit, end the call (`EngineRecoveryError` names the cause).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_batch_size: int | None = None,
        core: CoreSettings | None = None,
        max_recoveries: int = 0,
    ) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        self._eos_token_ids = _eos_token_ids(model, tokenizer)
        # A model never writes media placeholders or the boundaries around media itself (an untrained one may
        # try, which would break the next multimodal forward and the trainer's 3D rope): their logits are masked.
        self._media_tokens = MediaTokens.of(model.config)
        self._suppressed_ids = torch.tensor(self._media_tokens.never_generated, dtype=torch.long, device=self.device)
        self._pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # Tied weights appear under every name (`lm_head.weight` and `model.embed_tokens.weight`
        # are one tensor), so an update through either name reaches both uses.
        self._weights_by_name: dict[str, torch.Tensor] = {
            **dict(model.named_buffers(remove_duplicate=False)),
            **dict(model.named_parameters(remove_duplicate=False)),
        }
        self._weight_version = 0
        self._number = next(_ENGINE_NUMBERS)
        self._pauses = PauseHolds()
        self.core_unavailable_reason: str | None = None  # why the paged runner does not serve this model
        self.max_recoveries = max_recoveries
        self.recoveries = 0  # in-place recoveries so far (`health`)
        self._core_settings = core or CoreSettings()
        self._session_sweep: asyncio.TimerHandle | None = None
        self._released_weights: dict[torch.nn.Parameter, torch.Size] | None = None  # shapes while released
        self._unloaded_weights: set[torch.nn.Parameter] = set()  # resumed as zeros, not loaded since
        self._routing = RoutingRecorder(model) if moe_routers(model) else None  # return_routed_experts
        self.core = self._build_core(self._core_settings)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_batch_size: int | None = None,
        core: CoreSettings | None = None,
        max_recoveries: int = 0,
    ) -> EmbeddedEngine:
        """Load a model folder (or hub id) with its tokenizer onto ``device`` in ``dtype``."""
        model = load_model(path, dtype).to(device)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(model, tokenizer, max_batch_size=max_batch_size, core=core, max_recoveries=max_recoveries)

    def _build_core(self, settings: CoreSettings) -> EngineCore:
        """The engine core for this model, on the paged runner or the model-cache one (`CoreSettings.mode`)."""
        reason = "--engine-core off" if settings.mode == "off" else unsupported_reason(self.model)
        if reason is not None and settings.mode == "on":
            raise ValueError(f"--engine-core on: the paged engine core cannot run {type(self.model).__name__}: "
                             f"{reason} (--engine-core auto serves it on the model-cache runner)")
        self.core_unavailable_reason = reason
        self.fp8: Fp8Linears | None = None
        running = self.max_batch_size or 1024
        if reason is not None and settings.fp8:
            raise ValueError(f"--rollout-fp8 runs on the paged engine core, which cannot run "
                             f"{type(self.model).__name__}: {reason}")
        if reason is not None and settings.kv_cache_dtype != "auto":
            raise ValueError(f"--kv-cache-dtype {settings.kv_cache_dtype} is the paged engine core's pool, and the "
                             f"core cannot run {type(self.model).__name__}: {reason}")
        if (settings.kv_cache_dtype != "auto" and self.device.type == "cuda"
                and torch.cuda.get_device_capability(self.device) < (8, 9)):
            raise ValueError(f"--kv-cache-dtype {settings.kv_cache_dtype}: FP8 needs a GPU of compute capability 8.9 "
                             f"or newer (Ada, Hopper), this one is {torch.cuda.get_device_name(self.device)}")
        if reason is not None:
            runner = CacheRunner(self.model, self._pad_token_id, self._suppressed_ids, self._routing, running)
            return EngineCore(runner, None, CohortScheduler(running), self.tokenizer, self._eos_token_ids,
                              self._pauses, lambda: self._weight_version, max_positions=self.max_positions)
        max_positions = self.max_positions
        decoder = TextDecoder(self.model, max_positions, fused=triton_available(self.device),
                              suppressed_ids=self._suppressed_ids)
        # before the runner captures its CUDA graphs, which then read the FP8 buffers that syncs refill in place
        self.fp8 = Fp8Linears(decoder.layers) if settings.fp8 else None
        fp8_products = self.fp8.layer_products() if self.fp8 is not None and decoder.fused else None
        if fp8_products is not None:  # the fused forward's FP8 products: scales applied by the kernels after them
            decoder.use_products(fp8_products)
        media = MediaEncoder(self.model, decoder.text_model) if self._media_tokens.ids else None
        dtype = next(self.model.parameters()).dtype
        token_bytes = kv_bytes_per_token(decoder.num_layers, decoder.num_kv_heads, decoder.head_dim, dtype,
                                         settings.kv_cache_dtype)
        tokens = settings.max_total_tokens or self._default_pool_tokens(token_bytes, settings)
        if settings.max_total_tokens and (problem := pool_problem(tokens, token_bytes, self.device)):
            raise ValueError(f"--max-total-tokens {tokens}: {problem}")
        page = settings.page_size
        num_blocks = tokens // page + 1  # + the reserved block
        # A running sequence holds a block at least: no more of them run than the pool has blocks, whatever
        # --rollout-max-batch-size allows (the runner's rows and the block tables are sized by it).
        running = min(running, num_blocks - 1)
        blocks_per_sequence = -(-max_positions // page)
        runner = PagedRunner(decoder, num_blocks, page, self.device, dtype, blocks_per_sequence,
                             cuda_graphs=settings.cuda_graphs, max_graph_batch=settings.max_graph_batch,
                             max_batch=running, kv_cache_dtype=settings.kv_cache_dtype)
        blocks = BlockManager(num_blocks, page)
        scheduler = Scheduler(blocks, max_running=running, max_prefill_tokens=settings.max_prefill_tokens,
                              reserve_tokens=page, session_idle_s=settings.session_idle_s)
        return EngineCore(runner, blocks, scheduler, self.tokenizer, self._eos_token_ids, self._pauses,
                          lambda: self._weight_version, media=media, max_positions=self.max_positions)

    def _default_pool_tokens(self, token_bytes: int, settings: CoreSettings) -> int:
        if self.device.type != "cuda":
            return max(1024, min(CPU_KV_TOKENS, CPU_KV_BYTES // token_bytes))
        gc.collect()  # an engine of an earlier run still in a reference cycle would hold its pool
        torch.cuda.empty_cache()  # memory the caching allocator holds for no tensor is free for the pool
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = int(free * settings.mem_fraction_static)
        if budget < 64 * token_bytes * settings.page_size:
            raise ValueError(f"mem_fraction_static {settings.mem_fraction_static}: {free / 2**30:.1f} GiB free on "
                             f"{self.device} leave no room for a KV pool")
        return budget // token_bytes

    def __repr__(self) -> str:
        # What logs, the router's engine names and `relax health` show: readable, and distinct per engine.
        return f"EmbeddedEngine({type(self.model).__name__} on {self.device}, #{self._number})"

    @property
    def weight_version(self) -> int:
        return self._weight_version

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """Decode every request; outputs in request order. The requests join the core's running batch."""
        try:
            return await self.generate_streaming(requests, None)
        finally:
            if any(request.session_id is not None for request in requests):
                self._sweep_sessions_later()

    async def close_session(self, session_id: str) -> None:
        """Let go of an agent session's K/V kept between its turns (``GenerationRequest.session_id``)."""
        self.core.close_session(session_id)

    @property
    def pinned_sessions(self) -> int:
        return len(getattr(self.core.scheduler, "pinned", ()))

    def _sweep_sessions_later(self) -> None:
        """Let go of idle sessions' K/V once they have been idle long enough, even if no request comes meanwhile
        (the scheduler also does at every step)."""
        if self._session_sweep is not None or not self.pinned_sessions:
            return
        loop = asyncio.get_running_loop()

        def sweep() -> None:
            self._session_sweep = None
            if loop.is_closed():
                return
            self.core.release_idle_sessions()
            if self.pinned_sessions:
                self._session_sweep = loop.call_later(self._core_settings.session_idle_s / 2, sweep)

        self._session_sweep = loop.call_later(self._core_settings.session_idle_s / 2, sweep)

    async def generate_streaming(self, requests: Sequence[GenerationRequest],
                                 on_output: OutputCallback | None) -> list[GenerationOutput]:
        """`generate`, reporting each request as it finishes. A recovery decodes the call again; what was reported
        before it stays reported."""
        requests = list(requests)
        self.check_requests(requests)
        if not requests:
            return []
        self._check_weights()
        reporter = OutputReporter(len(requests), on_output)
        while True:
            recoveries = self.recoveries
            try:
                return reporter.finish(await self._generate_once(requests, reporter))
            except Exception as error:
                if not is_recoverable(error):
                    raise
                if self.recoveries == recoveries:  # the first of the calls this failure failed recovers for all
                    self._recover(error)

    @property
    def max_positions(self) -> int | None:
        """The model's ``max_position_embeddings`` (None if its config has none)."""
        value = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        return int(value) if value else None

    def check_requests(self, requests: Sequence[GenerationRequest]) -> None:
        for request in requests:
            _validate_request(request)
            if self.max_positions is not None and len(request.input_ids) >= self.max_positions:
                raise ValueError(f"request {request.request_id!r}: {len(request.input_ids)} prompt tokens leave no "
                                 f"room for an answer within the model's {self.max_positions} positions "
                                 "(max_position_embeddings)")
            pool = self.core.scheduler.max_sequence_tokens if self.core is not None else None
            if (problem := pool_refusal(request.request_id, len(request.input_ids), pool)) is not None:
                raise ValueError(problem)
            if request.multimodal_inputs and not self._media_tokens.ids:
                raise ValueError(f"request {request.request_id!r} has media, and {type(self.model).__name__} "
                                 "takes none")
            if request.return_routed_experts:
                self._check_routing(request)

    def _check_routing(self, request: GenerationRequest) -> None:
        if self._routing is None:
            raise ValueError(f"request {request.request_id!r} asks for routed experts, but "
                             f"{type(self.model).__name__} has no mixture-of-experts layers")
        if not self.core.runner.records_routing:
            raise ValueError(f"request {request.request_id!r} asks for routed experts, which the paged engine core "
                             "does not record (--engine-core off serves them)")

    def _recover(self, error: BaseException) -> None:
        if self.recoveries >= self.max_recoveries:
            limit = (f"the limit, {self.max_recoveries} in-place recoveries, is reached" if self.max_recoveries
                     else "in-place recovery is off (--use-fault-tolerance turns it on)")
            raise EngineRecoveryError(f"the embedded engine failed ({type(error).__name__}: {error}) and "
                                      f"{limit}") from error
        self.recoveries += 1
        logger.warning("embedded engine: %s: %s; rebuilding its core and decoding the failed calls' requests again "
                       "(recovery %d/%d)", type(error).__name__, str(error)[:300], self.recoveries, self.max_recoveries)
        self.core.shutdown()
        self.core = None  # its KV pool and graphs are freed before the new core sizes its own
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.core = self._build_core(self._core_settings)

    async def _generate_once(self, requests: list[GenerationRequest],
                             report: OutputReporter) -> list[GenerationOutput]:
        return await self.core.generate(requests, on_output=report)

    async def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreOutput]:
        """One forward per batch of at most ``max_batch_size`` right-padded sequences; log-probs
        of each response token (and the ``top_k`` most likely tokens) after temperature scaling."""
        requests = list(requests)
        self._check_weights()
        batch_size = self.max_batch_size or max(len(requests), 1)
        outputs: list[ScoreOutput] = []
        for start in range(0, len(requests), batch_size):
            outputs.extend(self._score_batch(requests[start : start + batch_size]))
            await asyncio.sleep(0)  # let decode steps of concurrent generations run between batches
        return outputs

    @torch.no_grad()
    def _score_batch(self, requests: list[ScoreRequest]) -> list[ScoreOutput]:
        for request in requests:
            if not 0 < request.response_length < len(request.input_ids):
                raise ValueError(f"score: response_length {request.response_length} does not fit "
                                 f"{len(request.input_ids)} tokens with a non-empty prompt")
        longest = max(len(r.input_ids) for r in requests)
        input_ids = torch.full((len(requests), longest), self._pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, request in enumerate(requests):
            input_ids[row, : len(request.input_ids)] = torch.tensor(request.input_ids)
            attention_mask[row, : len(request.input_ids)] = 1
        logits = self.model(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                            use_cache=False).logits.float()
        outputs = []
        for row, request in enumerate(requests):
            total, response = len(request.input_ids), request.response_length
            row_logits = logits[row, total - response - 1 : total - 1] / max(request.temperature, 1e-6)
            log_probs = row_logits.log_softmax(dim=-1)
            targets = input_ids[row, total - response : total].to(self.device)
            output = ScoreOutput(log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist())
            if request.top_k:
                top_log_probs, top_ids = log_probs.topk(request.top_k, dim=-1)
                output.top_ids, output.top_log_probs = top_ids.tolist(), top_log_probs.tolist()
            outputs.append(output)
        return outputs

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Finish the named requests at their next step boundary with ``finish_reason == "abort"``,
        keeping the tokens generated so far. Ids that are not in flight are ignored."""
        self.core.abort(request_ids)

    async def pause(self, owner: str = PAUSE_OPERATOR) -> None:
        """Hold new and in-flight batches at their next step boundary. No step is running when
        this returns: steps run on this loop, between awaits."""
        self._pauses.hold(owner)

    async def resume(self, owner: str = PAUSE_OPERATOR) -> None:
        self._pauses.release(owner)

    @property
    def kv_pool_bytes(self) -> int:
        """Bytes of the core's KV pool (0 for the model-cache runner, whose cache grows with its requests)."""
        return int(getattr(self.core.runner, "kv_bytes", 0) or 0) if self.core is not None else 0

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Free the core's KV pool and CUDA graphs (tag ``kv_cache``) and the storage of every parameter (tag
        ``weights``; the graphs point into the weights, so they go too). Buffers such as rotary tables stay:
        they are small and no weight update carries them. Only between generations."""
        tags = _memory_tags(tags)
        if self.core.in_flight:
            raise RuntimeError(f"cannot release the engine's memory with {self.core.in_flight} requests in flight")
        self.core.release_memory()
        if "weights" in tags and self._released_weights is None:
            self._released_weights = {}
            for parameter in dict(self.model.named_parameters()).values():  # a tied weight once
                self._released_weights[parameter] = parameter.shape
                parameter.data = parameter.data.new_empty(0)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Allocate what `release_memory_occupation` freed. Weights come back as zeros, and generation refuses to
        run until `update_weights` has loaded every one of them; the KV pool (and the CUDA graphs, captured on the
        weight tensors that later updates copy into) needs the weights' storage back first."""
        tags = _memory_tags(tags)
        if "weights" in tags and self._released_weights is not None:
            for parameter, shape in self._released_weights.items():
                parameter.data = parameter.data.new_zeros(shape)
            self._unloaded_weights = set(self._released_weights)
            self._released_weights = None
        if "kv_cache" in tags:
            if self._released_weights is not None:
                raise RuntimeError("resume the engine's weights before its KV cache (the CUDA graphs capture them)")
            self.core.resume_memory()

    def _check_weights(self) -> None:
        if self._released_weights is not None:
            raise RuntimeError("the engine's weights are released (release_memory_occupation); resume and load "
                               "them first")
        if self._unloaded_weights:
            raise RuntimeError(f"{len(self._unloaded_weights)} of the engine's weights were released and not loaded "
                               "again: call update_weights after resume_memory_occupation")

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy each tensor (any dtype or device; cast to the target's) into the model parameter
        or buffer of that Hugging Face name, between decode steps, then serve ``version``.

        Raises KeyError for a name the model lacks and ValueError for a shape mismatch; tensors
        before the bad one are already copied and the version is left unchanged.
        """
        if self._released_weights is not None:
            raise RuntimeError("update_weights: the engine's weights are released; call resume_memory_occupation "
                               "first")
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = self._weights_by_name.get(name)
                if target is None:
                    raise KeyError(
                        f"update_weights: the model has no parameter or buffer named {name!r} "
                        f"(model class {type(self.model).__name__})"
                    )
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"update_weights: tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                self._unloaded_weights.discard(target)
            if self.fp8 is not None:
                self.fp8.requantize()
        self._weight_version = version
        self.core.on_weights_updated()

    async def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "weight_version": self._weight_version,
            "device": str(self.device),
            "paused": bool(self._pauses),
            "in_flight_requests": self.core.in_flight,
            # Grows by one per engine step (prefill included): a liveness signal.
            "decode_steps": self.core.steps,
            "engine_core": self.core.kind,
            "recoveries": self.recoveries,
        }


class EngineRecoveryError(RuntimeError):
    """The embedded engine failed and could not recover in place (see ``EmbeddedEngine.max_recoveries``)."""


def is_recoverable(error: BaseException) -> bool:
    """An allocation failure (CUDA's OutOfMemoryError, or the CPU allocator's "can't allocate memory"): the
    memory state it leaves is rebuilt by a recovery, and the same requests may well fit once the pool is sized to
    what is free. Other errors (a sticky CUDA error, a bug) would recur or corrupt: they end the call."""
    return isinstance(error, torch.OutOfMemoryError) or (
        type(error) is RuntimeError and "can't allocate memory" in str(error))


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """EOS ids from the tokenizer and from the model's generation config (an int or a list)."""
    eos_ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    generation_config = getattr(model, "generation_config", None)
    config_eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(config_eos, int):
        eos_ids.add(config_eos)
    elif config_eos is not None:
        eos_ids.update(config_eos)
    return frozenset(eos_ids)


def _validate_request(request: GenerationRequest) -> None:
    """Reject what the engine cannot serve before any work starts, naming the request and field."""
    where = f"request {request.request_id!r}"
    if request.multimodal_inputs and not all(isinstance(v, torch.Tensor) for v in request.multimodal_inputs.values()):
        raise TypeError(f"{where}: multimodal_inputs must be processor tensors (relax.rollout.generation.multimodal)")
    if not request.input_ids:
        raise ValueError(f"{where}: input_ids is empty; the engine needs at least one prompt token")
    params = request.sampling_params
    if params.max_new_tokens < 1:
        raise ValueError(f"{where}: sampling_params.max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if params.temperature < 0:
        raise ValueError(f"{where}: sampling_params.temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"{where}: sampling_params.top_p must be in (0, 1], got {params.top_p}")
