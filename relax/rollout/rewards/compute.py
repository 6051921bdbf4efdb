"""Score rollout samples: run the configured reward on every sample and set ``sample.reward``.

One bad sample must not stop a rollout, and a broken reward must not pass unnoticed: a reward
that raises (or returns something that is not a finite number) gives that sample 0.0, is
counted in ``reward/num_errors``, and its message is logged once with the sample index.

No reward call may hang a rollout either: each one is bounded by ``timeout_s`` (``--reward-timeout``).
Past it the sample gets 0.0, is counted in ``reward/num_timeouts`` and logged once, and the step goes on.
Rule rewards that can compute without bound (``math``: math-verify's symbolic comparison, whose own
time limit uses SIGALRM and so works only on a main thread) run in worker processes that are killed
at the timeout. Other synchronous rewards run in threads, which cannot be killed: the rollout stops
waiting for them and gives their slot to the next call. ``async def`` rewards (and reward servers) run on an event
loop of their own, in a thread: one that blocks (``time.sleep`` in an ``async def``) blocks that loop, not the
rollout's, and is bounded by the timeout like the others; a loop that stays blocked is replaced. Abandoned threads
are bounded too (`MAX_ABANDONED_THREADS`): past the bound a call fails at once, counted, with the advice to run the
reward in processes. With ``--custom-rm-workers N`` a custom function runs in N worker processes instead (capped by
``--reward-worker-memory-mb``): one that crashes, leaks or hangs costs only its worker (killed or replaced; one that
ran out of its memory is replaced too, not left failing every later call) and the sample's reward (0, counted),
never the trainer.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import multiprocessing
import numbers
import os
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from pebble import ProcessExpired

from relax.data.sample import Sample
from relax.rollout.rewards.custom import load_custom_reward
from relax.rollout.rewards.registry import get_reward_fn

DEFAULT_REWARD_TIMEOUT_S = 5.0
# Reward threads still running past their timeout (they cannot be killed). Past this many, a call fails at once
# instead of starting another thread that would pile up with them.
MAX_ABANDONED_THREADS = 16
# A --custom-rm-workers process that ran out of its --reward-worker-memory-mb ends itself with this code, so that
# pebble replaces it (its memory may stay exhausted: every later call in it would fail).
OUT_OF_MEMORY_EXIT = 75
# How long the async rewards' loop may take to answer a ping after a timeout before it is taken as blocked.
LOOP_PING_S = 1.0
# Processes of the pool of isolated rule rewards; each imports math-verify and sympy once (about a second).
MAX_REWARD_PROCESSES = 4


class RewardTimeoutError(TimeoutError):
    """A reward call ran past ``--reward-timeout``."""


class RewardWorkerDiedError(RuntimeError):
    """The worker process of a reward call died (a crash, a kill) before it answered."""


class RewardThreadsStuckError(RuntimeError):
    """Too many reward calls are still running past the timeout in threads that cannot be killed."""

logger = logging.getLogger("relax.rewards")

Reward = float | dict[str, float]


class RewardComputer:
    """Sets ``sample.reward`` from one reward source: a rule reward or a custom function.

    - ``rm_type``: a registered rule reward (see ``get_reward_fn``); a sample's
      ``metadata["rm_type"]`` overrides it, so one dataset can mix answer formats. Rule rewards
      compare with ``sample.label``; a sample without a label is an error.
    - ``custom_rm_path``: a user function ``fn(args, sample) -> float | dict`` scores every
      sample (it can read ``metadata`` itself); with ``group_rm`` it is called once per GRPO
      group as ``fn(args, samples) -> list[float | dict]``, samples grouped by ``group_index``.

    Synchronous functions run in a pool of ``max_workers`` threads so the event loop (and the
    rollout it drives) keeps running; ``async def`` functions are awaited concurrently; isolated
    rule rewards run in worker processes. Every call is bounded by ``timeout_s`` (module doc).
    ``args`` is passed unchanged to custom functions.
    """

    def __init__(
        self,
        rm_type: str | None = None,
        custom_rm_path: str | None = None,
        *,
        group_rm: bool = False,
        args: Any = None,
        max_workers: int = 16,
        timeout_s: float = DEFAULT_REWARD_TIMEOUT_S,
        custom_workers: int = 0,
        worker_memory_mb: int | None = None,
        remote: Callable[[Any, Sample], Any] | None = None,
        rewards_set_by: str | None = None,
    ) -> None:
        sources = [name for name, given in (("--rm-type", rm_type), ("--custom-rm-path", custom_rm_path),
                                            ("--rm-url / --genrm-model-path / --rm-path", remote)) if given is not None]
        # ``rewards_set_by`` names a generate function that rewards every sample itself (a multi-agent
        # environment's per-agent rewards): a configured reward would never run, so it is refused, not ignored.
        if rewards_set_by is not None and sources:
            raise ValueError(f"{rewards_set_by} sets every sample's reward itself; {' and '.join(sources)} would "
                             "never run: leave it out (a setting of a --config file is cleared with --<flag> none)")
        if not sources and rewards_set_by is None:
            raise ValueError("no reward configured: set --rm-type to a rule reward, --custom-rm-path to a function, "
                             "--rm-url to a reward server, --genrm-model-path to a judge model or --rm-path to a "
                             "trained reward model")
        self._rewards_set_by = rewards_set_by
        if len(sources) > 1:
            raise ValueError(f"{' and '.join(sources)} both given; set one (a custom function can call "
                             "get_reward_fn itself; a setting of a --config file is cleared with --<flag> none, "
                             "e.g. --rm-type none)")
        if group_rm and custom_rm_path is None:
            raise ValueError("--group-rm scores whole groups and needs a --custom-rm-path function")
        if rm_type is not None:
            get_reward_fn(rm_type)  # an unknown type fails here, before any rollout
        if not timeout_s > 0 or not math.isfinite(timeout_s):
            raise ValueError(f"--reward-timeout must be a positive number of seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self._rm_type = rm_type
        # A remote reward (a server, a judge model) is an async function of (args, sample) like a custom one.
        self._custom_fn = load_custom_reward(custom_rm_path) if custom_rm_path is not None else remote
        self._custom_fn_is_async = remote is not None or inspect.iscoroutinefunction(self._custom_fn)
        self._remote = remote
        # Whether a positive reward means "correct" (rules, judges, reward servers) or is a score (a trained reward
        # model): only verdicts make an accuracy.
        self.gives_verdicts = getattr(remote, "gives_verdicts", True)
        if custom_workers and (self._custom_fn is None or self._custom_fn_is_async):
            raise ValueError("--custom-rm-workers runs a synchronous --custom-rm-path function in worker processes; "
                             + ("there is none" if self._custom_fn is None else
                                "an async one is awaited on the event loop instead"))
        if worker_memory_mb is not None and not custom_workers:
            raise ValueError("--reward-worker-memory-mb caps the processes of --custom-rm-workers; set that too")
        self._custom_spec = custom_rm_path
        self._custom_workers = custom_workers
        self._worker_memory_mb = worker_memory_mb
        self._custom_processes = None  # the pebble.ProcessPool of --custom-rm-workers, started on first use
        self._group_rm = group_rm
        self._args = args
        self._max_workers = max_workers
        self._thread_slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._processes = None  # the pebble.ProcessPool of isolated rule rewards, started on first use
        self._abandoned: list[threading.Thread] = []  # reward threads past their timeout, possibly still running
        self._async_loop: asyncio.AbstractEventLoop | None = None  # where async rewards run (`_on_reward_loop`)
        self._async_loop_thread: threading.Thread | None = None
        self.error_counts: Counter[str] = Counter()  # "ExceptionType: message" -> failed samples, over the run
        self._errors_since_metrics = 0
        self._timeouts_since_metrics = 0

    async def score(self, samples: Sequence[Sample]) -> None:
        """Set ``reward`` on every sample; never raises for a failing reward (see the module doc)."""
        if self._group_rm:
            groups: dict[int, list[Sample]] = {}
            for sample in samples:
                groups.setdefault(sample.group_index, []).append(sample)
            await asyncio.gather(*(self._score_group(group) for group in groups.values()))
        else:
            await asyncio.gather(*(self._score_sample(sample) for sample in samples))

    def pop_metrics(self) -> dict[str, int]:
        """``reward/num_errors`` and ``reward/num_timeouts``: samples whose reward failed, and those of them
        whose reward ran past the timeout, since the previous call."""
        metrics = {"reward/num_errors": self._errors_since_metrics, "reward/num_timeouts": self._timeouts_since_metrics}
        self._errors_since_metrics = self._timeouts_since_metrics = 0
        if self._remote is not None:  # a reward server's retries, a judge's verdicts
            metrics.update(self._remote.pop_metrics())
        return metrics

    def close(self) -> None:
        """Stop the worker processes once no more scoring will be requested."""
        for pool in (self._processes, self._custom_processes):
            if pool is not None:
                pool.stop()
                pool.join(timeout=10)
        self._processes = self._custom_processes = None
        if self._async_loop is not None:
            self._async_loop.call_soon_threadsafe(self._async_loop.stop)
            self._async_loop = None

    @property
    def abandoned_threads(self) -> int:
        """Reward threads still running past their timeout."""
        self._abandoned = [thread for thread in self._abandoned if thread.is_alive()]
        return len(self._abandoned)

    def _check_thread_budget(self) -> None:
        if self.abandoned_threads >= MAX_ABANDONED_THREADS:
            raise RewardThreadsStuckError(
                f"{MAX_ABANDONED_THREADS} reward calls are still running past --reward-timeout in threads that "
                "cannot be stopped; this call is not started. Run the reward in processes that can be "
                "(--custom-rm-workers N), or make it return in time")

    async def _score_sample(self, sample: Sample) -> None:
        try:
            if self._rewards_set_by is not None:
                raise ValueError(f"{self._rewards_set_by} returned a sample without a reward")
            if self._custom_fn is not None:
                reward = await self._call_custom_fn(sample)
            else:
                reward = await self._call_rule_reward(sample)
            sample.reward = _checked_reward(reward)
        except Exception as err:  # noqa: BLE001  (a user's reward may raise anything; it is counted and logged)
            self._record_failure([sample], err)

    async def _score_group(self, group: list[Sample]) -> None:
        try:
            rewards = await self._call_custom_fn(group)
            if not isinstance(rewards, (list, tuple)):
                raise TypeError(f"a --group-rm function must return a list of rewards, got {type(rewards).__name__}")
            if len(rewards) != len(group):
                raise ValueError(f"a --group-rm function returned {len(rewards)} rewards for a group of {len(group)}")
        except Exception as err:  # noqa: BLE001
            self._record_failure(group, err)
            return
        for sample, reward in zip(group, rewards):
            try:
                sample.reward = _checked_reward(reward)
            except Exception as err:  # noqa: BLE001
                self._record_failure([sample], err)

    async def _call_rule_reward(self, sample: Sample) -> Any:
        rm_type = sample.metadata.get("rm_type") or self._rm_type
        reward = get_reward_fn(rm_type)
        if sample.label is None:
            raise ValueError(f"reward type {rm_type!r} compares the response with a label, but the sample has none")
        if reward.isolated:
            return await self._in_process(reward, sample.response, sample.label, sample.metadata)
        return await self._in_thread(reward, sample.response, sample.label, sample.metadata)

    async def _call_custom_fn(self, sample_or_group: Sample | list[Sample]) -> Any:
        if self._custom_fn_is_async:
            return await self._on_reward_loop(self._custom_fn, self._args, sample_or_group)
        if self._custom_workers:
            return await self._in_process(_call_custom_reward, self._custom_spec, self._args, sample_or_group,
                                          pool=self._custom_pool())
        return await self._in_thread(self._custom_fn, self._args, sample_or_group)

    async def _on_reward_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``await fn(*args)`` on the async rewards' own loop (a thread), bounded by the timeout here: a reward
        that blocks its loop cannot block the rollout's. After a timeout the loop is pinged; one that does not
        answer is blocked for good and is replaced (its thread counts as abandoned)."""
        self._check_thread_budget()
        loop = self._reward_loop()
        future = asyncio.run_coroutine_threadsafe(fn(*args), loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            future.cancel()
            if not await _answers(loop, LOOP_PING_S) and loop is self._async_loop:
                self._abandoned.append(self._async_loop_thread)  # blocked for good: the next call starts a new loop
                self._async_loop = None
                logger.warning("an async reward blocks its event loop past --reward-timeout (a blocking call "
                               "inside an async def?); its calls go to a new loop")
            raise self._timeout_error() from None

    def _reward_loop(self) -> asyncio.AbstractEventLoop:
        if self._async_loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="relax-async-rewards", daemon=True)
            thread.start()
            self._async_loop, self._async_loop_thread = loop, thread
        return self._async_loop

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a thread of its own, at most ``max_workers`` at a time, bounded by the timeout from
        the moment it starts. A thread cannot be killed: past the timeout it is abandoned (a daemon, so it never
        holds up the exit) and its slot goes to the next call, so a hung reward never starves the others."""
        loop = asyncio.get_running_loop()
        async with self._slots_of(loop):
            result: asyncio.Future = loop.create_future()

            def deliver(outcome: Callable[[], None]) -> None:
                try:
                    loop.call_soon_threadsafe(lambda: None if result.done() else outcome())
                except RuntimeError:  # the loop closed while an abandoned reward ran on
                    pass

            def call() -> None:
                try:
                    value = fn(*args)
                except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
                    deliver(functools.partial(result.set_exception, err))  # `err` is unbound after this block
                else:
                    deliver(functools.partial(result.set_result, value))

            self._check_thread_budget()
            thread = threading.Thread(target=call, name="relax-reward", daemon=True)
            thread.start()
            try:
                return await asyncio.wait_for(result, self.timeout_s)
            except TimeoutError:
                self._abandoned.append(thread)
                raise self._timeout_error() from None

    def _slots_of(self, loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
        # One semaphore per event loop (an asyncio primitive belongs to the loop it first waited on).
        slots = self._thread_slots.get(loop)
        if slots is None:
            slots = self._thread_slots[loop] = asyncio.Semaphore(self._max_workers)
        return slots

    async def _in_process(self, fn: Callable[..., Any], *args: Any, pool=None) -> Any:
        pool = pool or self._process_pool()
        future = pool.schedule(fn, args=args, timeout=self.timeout_s)  # killed past the timeout
        try:
            return await asyncio.wrap_future(future)
        except TimeoutError:
            raise self._timeout_error() from None
        except ProcessExpired as err:  # the worker died (a crash, the OOM killer): pebble starts another
            if err.exitcode == OUT_OF_MEMORY_EXIT:
                raise MemoryError(f"the reward ran out of its worker's memory (--reward-worker-memory-mb "
                                  f"{self._worker_memory_mb}); a new worker takes its place") from None
            raise RewardWorkerDiedError(f"the reward's worker process died ({err}); a new one takes its place") \
                from None
        except asyncio.CancelledError:
            future.cancel()  # the rollout was cancelled: free the worker
            raise

    def _process_pool(self):
        if self._processes is None:
            from pebble import ProcessPool

            # spawn: a forked copy of a process that holds CUDA, Ray or torch threads is not safe.
            self._processes = ProcessPool(max_workers=min(MAX_REWARD_PROCESSES, os.cpu_count() or 1),
                                          initializer=_configure_reward_process,
                                          context=multiprocessing.get_context("spawn"))
        return self._processes

    def _custom_pool(self):
        if self._custom_processes is None:
            from pebble import ProcessPool

            self._custom_processes = ProcessPool(
                max_workers=self._custom_workers, initializer=_configure_custom_reward_process,
                initargs=(self._worker_memory_mb,), context=multiprocessing.get_context("spawn"))
        return self._custom_processes

    def _timeout_error(self) -> RewardTimeoutError:
        return RewardTimeoutError(f"the reward took longer than --reward-timeout {self.timeout_s:g} s")

    def _record_failure(self, samples: list[Sample], err: Exception) -> None:
        """Give the samples reward 0.0, count the error, and log its message the first time it is seen."""
        for sample in samples:
            sample.reward = 0.0
        message = f"{type(err).__name__}: {err}"
        if message not in self.error_counts:
            indices = ", ".join(str(sample.index) for sample in samples)
            where = f"sample {indices}" if len(samples) == 1 else f"samples {indices} (group {samples[0].group_index})"
            logger.error(
                "reward failed for %s, reward set to 0.0: %s (further failures with this message are only counted "
                "in reward/num_errors)",
                where,
                message,
                exc_info=None if isinstance(err, RewardTimeoutError) else err,
            )
        self.error_counts[message] += len(samples)
        self._errors_since_metrics += len(samples)
        if isinstance(err, RewardTimeoutError):
            self._timeouts_since_metrics += len(samples)


def _configure_reward_process() -> None:
    """In a worker process: no time limit of math-verify's own (which would end an overrun silently as a wrong
    answer); the pool's kill at --reward-timeout is the one bound, so every overrun is counted. math-verify is
    imported and run once here, before the worker takes a task: a task's time then is its own grading, not the
    seconds of importing sympy and building the LaTeX parser (which, on a loaded machine, timed out a plain
    ``\boxed{1}`` at a 1 s --reward-timeout)."""
    from math_verify import parse, verify

    from relax.rollout.rewards import math_rewards

    math_rewards.MATH_VERIFY_TIMEOUT_S = None
    verify(parse("$1$", parsing_timeout=None), parse("$1$", parsing_timeout=None), timeout_seconds=None)


_loaded_custom: dict[str, Callable[..., Any]] = {}


def _configure_custom_reward_process(memory_mb: int | None) -> None:
    """In a --custom-rm-workers process: cap its address space, so a leaking reward fails with MemoryError here
    (counted, the sample scored 0) instead of taking the trainer's memory."""
    if memory_mb is not None:
        import resource

        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _call_custom_reward(spec: str, args: Any, sample_or_group: Any) -> Any:
    """In a worker process: import the custom reward once (by its dotted path), then call it. A call that runs out
    of the worker's memory ends the worker (`OUT_OF_MEMORY_EXIT`): what it leaked may keep every later call here
    failing, and a fresh worker takes its place."""
    fn = _loaded_custom.get(spec)
    if fn is None:
        fn = _loaded_custom[spec] = load_custom_reward(spec)
    try:
        return fn(args, sample_or_group)
    except MemoryError:
        os._exit(OUT_OF_MEMORY_EXIT)


async def _answers(loop: asyncio.AbstractEventLoop, timeout_s: float) -> bool:
    """Whether ``loop`` (running in another thread) runs a callback within ``timeout_s``."""
    try:
        await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop)),
                               timeout_s)
    except (TimeoutError, RuntimeError):
        return False
    return True


def _checked_reward(value: Any) -> Reward:
    """``value`` as a float, or a dict of floats; anything else, or a NaN/infinity, raises."""
    if isinstance(value, dict):
        return {key: _checked_number(number) for key, number in value.items()}
    return _checked_number(value)


def _checked_number(value: Any) -> float:
    if not isinstance(value, numbers.Real):
        raise TypeError(f"a reward must be a float or a dict of floats, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"a reward must be finite, got {value}")
    return float(value)
