"""Interaction environments in worker processes (``--env-workers N``): a crash, a leak or a hang of an environment
costs its episodes, not the rollout's process.

`EnvWorkerPool` keeps N spawned processes. Each episode's environment is built in one of them (the least busy)
and lives there until ``close``; its ``reset``, ``step`` and ``format_observation`` run there, each call in a
thread of the worker (so one slow environment does not hold up the others of the same worker), and the answers
come back over a pipe. ``step`` formats a not-done observation in the worker too, so `RemoteEnv` answers the
multi-turn loop's synchronous ``format_observation`` from that result.

What a fault costs:

- an environment that raises or runs past ``--env-step-timeout``: its episode (as in-process: `EnvCallError`,
  stop reason ``env_error``); the worker goes on;
- a worker that dies (a segfault, ``os._exit``, the OOM killer, ``--env-worker-memory-mb`` exceeded in a way that
  kills it): every episode it held fails with an error naming the worker and how it died, and the next episode
  starts a new worker in its place. A MemoryError that the environment raises under the cap fails only its call.

The environment's ``build_env(sample, args)`` gets the `GenerateArgs` of the run's config and tokenizer, with
``engine`` and ``processor`` None (they stay in the rollout's process). Samples, observations and infos cross the pipe
pickled.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import itertools
import logging
import multiprocessing
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from relax.data.sample import Sample
from relax.rollout.agentic.env import EnvCallError, load_env_builder
from relax.rollout.generation.context import GenerateArgs

logger = logging.getLogger(__name__)

_EXIT_WAIT_S = 30.0  # how long the reader waits for a worker whose pipe closed to end, before naming how it ended


# ----------------------------------------------------------------------------- the worker process


def _worker_main(connection, env_path: str, config: Any, tokenizer: Any, memory_mb: int | None) -> None:
    """A worker: build environments by episode id and run their calls, each in a thread, until the pipe closes."""
    builder = load_env_builder(env_path)
    args = GenerateArgs(config, engine=None, tokenizer=tokenizer)  # the engine and processor stay in the rollout
    if memory_mb is not None:  # on top of what the worker maps once started: it bounds what environments allocate
        import resource

        limit = _address_space_bytes() + memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    envs: dict[int, Any] = {}
    send_lock = threading.Lock()

    def answer(call_id: int, ok: bool, value: Any) -> None:
        with send_lock:
            try:
                connection.send((call_id, ok, value))
            except Exception as err:  # noqa: BLE001 - an answer that does not pickle is the environment's error
                connection.send((call_id, False, f"its result cannot be sent back ({type(err).__name__}: {err})"))

    def run(call_id: int, episode: int, method: str, payload: tuple) -> None:
        try:
            if method == "build":
                envs[episode] = builder(payload[0], args)
                result = None
            elif method == "step":
                env = envs[episode]
                observation, done, info = _resolved(env.step(*payload))
                message = None if done else env.format_observation(observation)
                result = (observation, done, info, message)
            elif method == "close":
                env = envs.pop(episode, None)
                result = None if env is None else _resolved(env.close())
            else:  # reset
                result = _resolved(envs[episode].reset())
        except BaseException as err:  # noqa: BLE001 - reported to the episode, the worker goes on
            answer(call_id, False, f"{type(err).__name__}: {err}")
            return
        answer(call_id, True, result)

    while True:
        try:
            call_id, episode, method, payload = connection.recv()
        except (EOFError, OSError):
            return  # the rollout's process closed the pipe or died
        threading.Thread(target=run, args=(call_id, episode, method, payload), daemon=True).start()


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _resolved(value: Any) -> Any:
    if inspect.isawaitable(value):
        return asyncio.run(_awaited(value))
    return value


async def _awaited(awaitable) -> Any:
    return await awaitable


# ----------------------------------------------------------------------------- the rollout's side


@dataclass(eq=False)
class _Worker:
    process: Any
    connection: Any
    episodes: set[int] = field(default_factory=set)
    pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = field(default_factory=dict)
    dead: str | None = None  # how it died
    lock: threading.Lock = field(default_factory=threading.Lock)


class EnvWorkerPool:
    def __init__(self, env_path: str, config: Any, tokenizer: Any, workers: int,
                 memory_mb: int | None = None) -> None:
        if workers < 1:
            raise ValueError(f"--env-workers must be >= 1, got {workers}")
        self.env_path, self.config, self.tokenizer = env_path, config, tokenizer
        self.size, self.memory_mb = workers, memory_mb
        self._workers: list[_Worker] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.started = 0  # workers started, replacements included
        self.deaths = 0
        self._closing = False
        # At exit multiprocessing terminates the workers (daemons): that is no death to report.
        atexit.register(self._mark_closing)

    async def open(self, sample: Sample) -> RemoteEnv:
        """Build ``sample``'s environment in a worker; the `RemoteEnv` that drives it."""
        worker = self._pick()
        episode = next(self._ids)
        worker.episodes.add(episode)
        env = RemoteEnv(self, worker, episode)
        await env.call("build", sample)
        return env

    def _pick(self) -> _Worker:
        with self._lock:
            self._workers = [w for w in self._workers if w.dead is None]
            if len(self._workers) < self.size:
                self._workers.append(self._start())
            return min(self._workers, key=lambda w: len(w.episodes))

    def _start(self) -> _Worker:
        context = multiprocessing.get_context("spawn")  # safe beside CUDA and threads
        parent, child = context.Pipe()
        process = context.Process(target=_worker_main, name="relax-env-worker", daemon=True,
                                  args=(child, self.env_path, self.config, self.tokenizer, self.memory_mb))
        process.start()
        child.close()
        worker = _Worker(process, parent)
        threading.Thread(target=self._read, args=(worker,), name="relax-env-reader", daemon=True).start()
        self.started += 1
        if self.started > self.size:
            logger.warning("environment worker %d started in place of one that died", process.pid)
        return worker

    def _read(self, worker: _Worker) -> None:
        """The worker's answers, to the futures waiting for them; at EOF, the worker's death to all of them.

        This thread alone decides how a worker ended, and fails every call it holds with that: a call sent after
        the worker died (its pipe broken before this thread saw the EOF) stays pending until then, so its error
        names the death too rather than a bare broken pipe."""
        while True:
            try:
                call_id, ok, value = worker.connection.recv()
            except (EOFError, OSError):
                break
            with worker.lock:
                waiting = worker.pending.pop(call_id, None)
            if waiting is not None:
                _deliver(*waiting, ok, value)
        worker.process.join(_EXIT_WAIT_S)  # its pipe closes as it exits: on a loaded machine the exit may lag
        with worker.lock:
            worker.dead = _how_it_ended(worker.process)
            waiting, worker.pending = list(worker.pending.values()), {}
        if not self._closing:
            self.deaths += 1
            logger.warning("environment worker %s %s; its %d episode(s) fail", worker.process.pid, worker.dead,
                           len(worker.episodes))
        for loop, future in waiting:
            _deliver(loop, future, False, None)

    def send(self, worker: _Worker, episode: int, method: str, payload: tuple) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        call_id = next(self._ids)
        with worker.lock:
            if worker.dead is None:
                worker.pending[call_id] = (loop, future)
        if worker.dead is not None:
            future.set_exception(self.died(worker))
            return future
        try:
            worker.connection.send((call_id, episode, method, payload))
        except OSError:
            pass  # a broken or closed pipe: the reader, at its EOF, fails this call with how the worker ended
        except BaseException:  # a payload that does not pickle: the caller's error, the worker goes on
            with worker.lock:
                worker.pending.pop(call_id, None)
            raise
        return future

    def died(self, worker: _Worker) -> EnvCallError:
        return EnvCallError(f"the environment's worker process {worker.process.pid} "
                            f"{worker.dead or 'is gone'} (--env-workers)")

    def _mark_closing(self) -> None:
        self._closing = True

    def close(self) -> None:
        self._closing = True
        for worker in self._workers:
            worker.connection.close()
            worker.process.join(2)
            if worker.process.is_alive():
                worker.process.kill()
        self._workers = []


def _deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future, ok: bool, value: Any) -> None:
    """Settle ``future`` on its loop, from the reader's thread; a loop that has ended has no one waiting."""
    try:
        loop.call_soon_threadsafe(_settle, future, ok, value)
    except RuntimeError:  # the loop is closed
        pass


def _settle(future: asyncio.Future, ok: bool, value: Any) -> None:
    if future.done():  # the caller timed out meanwhile
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(EnvCallError(value) if value is not None else ConnectionError("worker died"))


def _how_it_ended(process) -> str:
    code = process.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class RemoteEnv:
    """One episode's environment in a worker, with the methods the multi-turn loop calls."""

    def __init__(self, pool: EnvWorkerPool, worker: _Worker, episode: int) -> None:
        self.pool, self.worker, self.episode = pool, worker, episode
        self._messages: dict[int, Any] = {}  # id(observation) -> the message the worker formatted for it

    async def call(self, method: str, *payload: Any) -> Any:
        try:
            return await self.pool.send(self.worker, self.episode, method, payload)
        except ConnectionError:
            raise self.pool.died(self.worker) from None

    async def reset(self) -> Any:
        return await self.call("reset")

    async def step(self, response_text: str) -> Any:
        observation, done, info, message = await self.call("step", response_text)
        self._messages = {} if message is None else {id(observation): message}
        return observation, done, info

    def format_observation(self, observation: Any) -> Any:
        try:
            return self._messages[id(observation)]
        except KeyError:
            raise RuntimeError("format_observation of an environment in a worker answers only for the observation "
                               "its last step returned") from None

    async def close(self) -> None:
        self.worker.episodes.discard(self.episode)
        if self.worker.dead is None:
            await self.call("close")

