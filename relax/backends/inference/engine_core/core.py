"""The step loop behind `EmbeddedEngine.generate`, for every model: continuous batching.

Every `generate` call puts its requests into the scheduler's waiting queue and awaits them; one loop task (on
the event loop of the calls) runs steps while any request waits or runs: at each step boundary it lets other
coroutines run, holds while the engine is paused, finishes aborted requests, then runs the step the scheduler
picks (a prefill of newly admitted requests or a decode of all running ones) and hands each request its token.
So concurrent callers (the router, `relax serve`, the turns of agentic episodes, `RequestBatcher`) share one
running batch, and a request leaves it the step it finishes.

Sampling. Every request samples from noise keyed by its own seed and the position of the token
(`CounterNoise`), so a seeded request gets the same tokens whatever shares its steps. A request without a seed
gets a random one. Requests of one call that carry the same seed get distinct streams (the seed mixed with
their order among those requests), so the samples of a GRPO group sharing a step seed differ, and the same call
repeated gives the same samples.

Runners. The loop is handed a runner and its scheduler: `paged_runner.PagedRunner` with `scheduler.Scheduler` (the
core's own decoder over a paged KV pool, CUDA graphs) for the families it runs, `cache_runner.CacheRunner` with
`scheduler.CohortScheduler` (the model's own forward and cache) for every other one. The loop is the same.

Media. On the paged runner, a multimodal request's prompt is encoded when it arrives (`media.MediaEncoder`: the towers, the merge
into the embeddings, the 3D rope), once per distinct prompt of a call, and then runs as any other sequence.

Cost per step: one host synchronization (the sampled tokens and their log-probs, which the stop checks need),
which on CUDA overlaps the next step: see `_run`.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import time
from collections import defaultdict
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf

from relax.backends.inference.base import GenerationOutput, GenerationRequest, PauseHolds, occurrence_seed
from relax.backends.inference.engine_core.block_manager import BlockManager
from relax.backends.inference.engine_core.media import MediaEncoder, MediaPrompt
from relax.backends.inference.engine_core.scheduler import CohortScheduler, Scheduler
from relax.backends.inference.engine_core.sequence import Sequence, SequenceStatus
from relax.backends.inference.engine_core.step_runner import StepOutput, StepRunner
from relax.backends.inference.stopping import finish_on_stop_strings, stop_token_ids, stop_window_tokens

PAUSE_POLL_S = 0.001


class EngineCore:
    def __init__(self, runner: StepRunner, blocks: BlockManager | None, scheduler: Scheduler | CohortScheduler,
                 tokenizer, eos_token_ids: frozenset[int], pauses: PauseHolds, weight_version: Callable[[], int],
                 media: MediaEncoder | None = None, max_positions: int | None = None) -> None:
        self.runner = runner
        # The model's last position: a sequence that reaches it ends with finish reason "length" (the paged
        # decoder's rotary tables end there; the engine refuses prompts that do not leave room for one token).
        self.max_positions = max_positions
        self.media = media  # the paged runner's encoder of media prompts (the cache runner's forward takes them)
        self.blocks = blocks  # the paged runner's KV pool blocks (None on the cache runner)
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.pauses = pauses
        self.weight_version = weight_version
        self.steps = 0  # engine steps run (prefill and decode), a liveness and batching signal
        self.decode_steps = 0
        # Host time per phase of the loop (schedule, launch of a decode, processing of the previous decode, whole
        # prefill steps): with the device busy, "process" includes waiting for it.
        self.host_seconds: defaultdict[str, float] = defaultdict(float)
        self._arrivals = itertools.count()
        self._aborted: set[str] = set()
        self._loop_task: asyncio.Task | None = None
        self._random = random.Random()

    # ---- requests ------------------------------------------------------------------------
    async def generate(self, requests: SequenceOf[GenerationRequest],
                       on_output: Callable[[int, GenerationOutput], None] | None = None) -> list[GenerationOutput]:
        """Outputs in request order; ``on_output(position, output)`` as each request finishes."""
        if self.runner.released:
            raise RuntimeError("the engine's KV pool is released (release_memory_occupation); resume it first")
        loop = asyncio.get_running_loop()
        occurrences: dict[int, int] = {}
        encoded: dict[tuple, MediaPrompt] = {}  # a GRPO group's samples share their prompt's encoding
        sequences = []
        for request in requests:
            params = request.sampling_params
            if params.seed is None:
                seed = self._random.getrandbits(63)
            else:
                occurrence = occurrences.get(params.seed, 0)
                occurrences[params.seed] = occurrence + 1
                seed = occurrence_seed(params.seed, occurrence)
            sequence = self._new_sequence(request, seed, loop)
            sequence.media = self._encode_media(request, encoded)
            sequences.append(sequence)
        if on_output is not None:
            for position, sequence in enumerate(sequences):
                sequence.future.add_done_callback(functools.partial(self._report, on_output, position, sequence))
        # A call is refused whole before any of it is queued: queued requests would decode for nobody.
        if (problem := next(filter(None, map(self.scheduler.refusal, sequences)), None)) is not None:
            raise ValueError(problem)
        for sequence in sequences:
            self.scheduler.add(sequence)
        self._ensure_loop(loop)
        try:
            await asyncio.gather(*(s.future for s in sequences))
        except asyncio.CancelledError:
            self.abort([s.request_id for s in sequences if s.status is not SequenceStatus.FINISHED])
            raise
        return [self._output(s) for s in sequences]

    def _report(self, on_output, position: int, sequence: Sequence, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            on_output(position, self._output(sequence))

    def abort(self, request_ids: SequenceOf[str]) -> None:
        """Finish these requests at the next step boundary with ``finish_reason == "abort"``."""
        live = {s.request_id for s in itertools.chain(self.scheduler.waiting, self.scheduler.running)}
        self._aborted.update(rid for rid in request_ids if rid in live)

    @property
    def in_flight(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    @property
    def kind(self) -> str:
        """``paged`` (the core's decoder over a paged KV pool) or ``model_cache`` (the model's own forward)."""
        return "paged" if self.blocks is not None else "model_cache"

    def on_weights_updated(self) -> None:
        if self.blocks is not None:
            self.blocks.reset_prefix_cache()  # K/V cached under the old weights must not serve new prompts
            self.scheduler.release_all_sessions()  # (nor a session's next turn)

    def close_session(self, session_id: str) -> int:
        """Let go of an agent session's K/V (`Scheduler.release_session`); how many blocks it held."""
        return self.scheduler.release_session(session_id) if self.blocks is not None else 0

    def release_idle_sessions(self) -> list[str]:
        return self.scheduler.release_idle_sessions() if self.blocks is not None else []

    def release_memory(self) -> None:
        """Free the KV pool and the CUDA graphs; only between generations."""
        if self.in_flight:
            raise RuntimeError(f"cannot release the KV pool with {self.in_flight} requests in flight")
        self.on_weights_updated()
        self.runner.release()

    def resume_memory(self) -> None:
        self.runner.restore()

    def shutdown(self) -> None:
        """Stop the loop, fail what is still queued, and free the KV pool and CUDA graphs: this core is being
        replaced (an in-place recovery) and is never used again."""
        if self._loop_task is not None and not self._loop_task.done():
            self._loop_task.cancel()
        self._fail_all(RuntimeError("the engine core was shut down"))
        self.runner.release()

    # ---- the loop ------------------------------------------------------------------------
    def _ensure_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        task = self._loop_task
        if task is not None and not task.done() and task.get_loop() is loop:
            return
        self._loop_task = loop.create_task(self._run())

    async def _run(self) -> None:
        """Steps until no request waits or runs. Steps are pipelined: step t+1 is launched before the host reads
        step t's tokens (the device is kept busy while the host appends tokens and checks stops), so a request
        that finished at step t has one more token computed, which is dropped. On the paged runner a prefill
        joins the pipeline too: it is launched behind the decode step in flight, and the next step (another
        prefill, or the decode that takes its sequences' first tokens from its output on the device) behind it, so
        the device does not wait while the host builds a prefill's inputs (about 3 ms for 8,192 prompt tokens on
        the 2-core dev CPU).
        The pipeline is drained (step t read) before a pause or an abort is handled, and on the cache runner
        before a prefill."""
        in_flight: StepOutput | None = None
        pipelined_prefill = self.runner.pipelines_prefill
        try:
            while self.scheduler.has_work or in_flight is not None:
                await asyncio.sleep(0)
                if (self.pauses or self._aborted or not self.scheduler.running
                        or (self.scheduler.waiting and not pipelined_prefill)):
                    in_flight = self._drain(in_flight)
                while self.pauses and not self._aborted:
                    await asyncio.sleep(PAUSE_POLL_S)
                self._finish_aborted()
                if not self.scheduler.has_work:
                    continue
                started = time.perf_counter()
                step = self.scheduler.schedule()
                version = self.weight_version()
                scheduled = time.perf_counter()
                self.host_seconds["schedule"] += scheduled - started
                if step.prefill:
                    if not pipelined_prefill or any(sequence.pending for sequence in step.prefill):
                        in_flight = self._drain(in_flight)  # a prefill reads every token of its sequences on the host
                    launched = self.runner.prefill(step.prefill, version)
                    for sequence in step.prefill:
                        sequence.pending += 1
                    if in_flight is not None:
                        self._process(in_flight)  # the device runs the prefill meanwhile
                    in_flight = launched if pipelined_prefill else self._drain(launched)
                    self.steps += 1
                    self.host_seconds["prefill"] += time.perf_counter() - scheduled
                elif step.decode:
                    self.runner.copy_blocks(step.copies)
                    launched = self.runner.decode(step.decode, in_flight, version)
                    for sequence in step.decode:
                        sequence.pending += 1
                    self.steps += 1
                    self.decode_steps += 1
                    launched_at = time.perf_counter()
                    self.host_seconds["launch"] += launched_at - scheduled
                    if in_flight is not None:
                        self._process(in_flight)  # the device runs `launched` meanwhile
                    self.host_seconds["process"] += time.perf_counter() - launched_at
                    in_flight = launched
                else:  # every running sequence has its last token on the way
                    in_flight = self._drain(in_flight)
        except BaseException as error:  # noqa: BLE001 - a failed step fails every request it holds
            self._fail_all(error)
            if not isinstance(error, Exception):
                raise

    def _drain(self, in_flight: StepOutput | None) -> None:
        if in_flight is not None:
            self._process(in_flight)
        return None

    def _process(self, output: StepOutput) -> None:
        """Hand each sequence of a finished step its token; finish those that stopped. The loop runs once per
        sequence and step, on the host's critical path: it reads each fact once and calls nothing it can avoid."""
        tokens, log_probs = output.result()
        version = output.version
        stepped = []
        finished = SequenceStatus.FINISHED
        running = SequenceStatus.RUNNING
        for sequence, token, log_prob in zip(output.sequences, tokens, log_probs):
            if sequence.pending:
                sequence.pending -= 1
            status = sequence.status
            if status is finished or sequence.finish_reason is not None:
                continue  # finished at the previous step: this token was computed past its end
            token_ids = sequence.token_ids
            if status is running:  # a preempted one has nothing in the pool
                sequence.num_cached = len(token_ids)  # every token but the new one has its K/V in the pool
            token_ids.append(token)
            sequence.output_log_probs.append(log_prob)
            sequence.output_weight_versions.append(version)
            on_token = sequence.request.on_token
            if on_token is not None:
                on_token(token, log_prob)
            if token in sequence.stop_token_ids:
                sequence.finish_reason = "stop"
            elif len(token_ids) >= sequence.length_limit:
                sequence.finish_reason = "length"
            stepped.append(sequence)
        finish_on_stop_strings(stepped, self.tokenizer)
        self._complete([s for s in stepped if s.finish_reason is not None])

    def _finish_aborted(self) -> None:
        if not self._aborted:
            return
        aborted = [s for s in itertools.chain(self.scheduler.waiting, self.scheduler.running)
                   if s.request_id in self._aborted]
        self._aborted.clear()
        for sequence in aborted:
            sequence.finish_reason = "abort"
        self._complete(aborted)

    def _complete(self, sequences: list[Sequence]) -> None:
        if not sequences:
            return
        self.scheduler.finish(sequences)
        for sequence in sequences:
            if sequence.future is not None and not sequence.future.done():
                sequence.future.set_result(None)

    def _fail_all(self, error: BaseException) -> None:
        live = list(itertools.chain(self.scheduler.waiting, self.scheduler.running))
        self.scheduler.finish(live)
        for sequence in live:
            if sequence.future is not None and not sequence.future.done():
                sequence.future.set_exception(error if isinstance(error, Exception) else RuntimeError(str(error)))

    # ---- helpers -------------------------------------------------------------------------
    def _encode_media(self, request: GenerationRequest, encoded: dict[tuple, MediaPrompt]) -> MediaPrompt | None:
        inputs = request.multimodal_inputs
        if not inputs:
            return None
        if self.media is None:  # the cache runner's forward takes the processor tensors itself (the engine refuses
            return None  # media for a model that takes none)
        key = (id(inputs), tuple(request.input_ids))
        if key not in encoded:
            encoded[key] = self.media.encode(list(request.input_ids), inputs)
        return encoded[key]

    def _new_sequence(self, request: GenerationRequest, seed: int, loop: asyncio.AbstractEventLoop) -> Sequence:
        params = request.sampling_params
        sequence = Sequence(request=request, seed=seed, stop_token_ids=stop_token_ids(params, self.eos_token_ids),
                            stop_window_tokens=stop_window_tokens(params), arrival=next(self._arrivals),
                            future=loop.create_future())
        # The model's last position, and the pool's size, end it with "length" too.
        for limit in (self.max_positions, self.scheduler.max_sequence_tokens):
            if limit is not None:
                sequence.length_limit = min(sequence.length_limit, limit)
        return sequence

    def _output(self, sequence: Sequence) -> GenerationOutput:
        """A finished sequence's output, built on first use: reported as it finishes and returned by its call, one
        object, its text decoded once (256 texts of 512 tokens take 80 ms on the 2-core dev CPU, against a 3.2 s
        rollout of them on the H200)."""
        if sequence.output is None:
            sequence.output = self._build_output(sequence)
        return sequence.output

    def _build_output(self, sequence: Sequence) -> GenerationOutput:
        versions = sequence.output_weight_versions
        return GenerationOutput(
            request_id=sequence.request_id, output_ids=sequence.output_ids,
            output_log_probs=sequence.output_log_probs, finish_reason=sequence.finish_reason or "abort",
            weight_version=versions[-1] if versions else self.weight_version(),
            text=self.tokenizer.decode(sequence.output_ids, skip_special_tokens=True),
            output_weight_versions=versions, routed_experts=sequence.routed_experts_output(),
        )
