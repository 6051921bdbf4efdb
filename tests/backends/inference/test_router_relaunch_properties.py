"""Properties of the router's relaunch of engines it can restart (``relaunch_limit``), over random sequences of
generations, weight updates and engine deaths (before or during a call), with in-memory engines that die, come
back on the base weights and load versions from a shared store the way `relax serve` processes do.

For every sequence: each call returns every request, each generated at the newest pushed weight version (a
relaunched engine never serves older weights), whole groups stay on one engine, no engine is relaunched more
than the limit, and a call or an update fails with `NoEngineAvailableError` only when every engine is beyond its limit.
"""

from __future__ import annotations

import asyncio

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.backends.inference.base import (
    GenerationOutput,
    GenerationRequest,
    InferenceEngine,
    SamplingParams,
    group_key,
)
from relax.backends.inference.router import EngineRouter, NoEngineAvailableError


class Store:
    """What `--rollout-weights-dir` holds: published versions."""

    def __init__(self) -> None:
        self.versions: set[int] = set()


class ProcessLikeEngine(InferenceEngine):
    def __init__(self, name: str, store: Store) -> None:
        self.name, self.store = name, store
        self.base_url = name
        self.weights_dir = f"/store/{id(store)}"  # shared: the router publishes once
        self.alive = True
        self.die_during_next_call = False
        self.version = 0
        self.relaunches = 0
        self.calls: list[list[str]] = []

    @property
    def weight_version(self) -> int:
        return self.version

    def _check(self) -> None:
        if not self.alive:
            raise ConnectionError(f"{self.name}: connection refused")

    async def generate(self, requests):
        self._check()
        await asyncio.sleep(0)
        if self.die_during_next_call:
            self.die_during_next_call, self.alive = False, False
            raise ConnectionError(f"{self.name}: connection reset")
        self.calls.append([r.request_id for r in requests])
        return [GenerationOutput(r.request_id, [1], [0.0], "length", weight_version=self.version) for r in requests]

    async def health(self):
        self._check()
        return {"status": "ok", "weight_version": self.version}

    async def publish_weights(self, tensors, version: int) -> None:
        self.store.versions.add(version)

    async def load_weights(self, version: int | None = None) -> int:
        self._check()
        assert version in self.store.versions, "loads only a published version"
        self.version = version
        return version

    async def abort(self, request_ids) -> None:
        self._check()

    async def pause(self, owner: str = "operator") -> None:
        self._check()

    async def resume(self, owner: str = "operator") -> None:
        self._check()

    async def update_weights(self, named_tensors, version: int) -> None:  # not used: the engines share a store
        raise AssertionError("the router publishes and loads")

    async def relaunch(self) -> None:
        self.relaunches += 1
        await asyncio.sleep(0.001)
        self.alive, self.version = True, 0  # a new process on the base weights


def requests_for(call: int, groups: int) -> list[GenerationRequest]:
    params = SamplingParams(max_new_tokens=1)
    return [GenerationRequest(f"g{call * 10 + g}-i{k}-{k}", [1, 2], params) for g in range(groups) for k in range(2)]


operation = st.one_of(
    st.tuples(st.just("generate"), st.integers(1, 4)),
    st.tuples(st.just("update"), st.just(0)),
    st.tuples(st.just("kill"), st.integers(0, 2)),
    st.tuples(st.just("kill_during"), st.integers(0, 2)),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(operation, min_size=1, max_size=14), st.integers(1, 3), st.integers(1, 2))
def test_relaunched_engines_serve_the_current_weights_and_stay_bounded(operations, engines_count, limit):
    store = Store()
    engines = [ProcessLikeEngine(f"http://e{i}", store) for i in range(engines_count)]
    router = EngineRouter(engines, retry_down_after_s=0.0, wait_for_engine_s=0.05, relaunch_limit=limit,
                          max_retries=engines_count * (limit + 1))
    tensors = [("w", torch.zeros(1))]

    async def scenario() -> None:
        version = 0
        await router.update_weights(tensors, version)
        for call, (kind, argument) in enumerate(operations):
            if kind == "update":
                version += 1
                try:
                    await router.update_weights(tensors, version)
                except NoEngineAvailableError:
                    assert all(e.relaunches >= limit and not e.alive for e in engines), "an update lost"
                    return
            elif kind == "kill":
                engines[argument % engines_count].alive = False
            elif kind == "kill_during":
                engines[argument % engines_count].die_during_next_call = True
            else:
                requests = requests_for(call, argument)
                recoverable = any(e.alive or e.relaunches < limit for e in engines)
                try:
                    outputs = await router.generate(requests)
                except NoEngineAvailableError:
                    assert all(e.relaunches >= limit for e in engines), "failed while an engine could come back"
                    return
                except ConnectionError:  # the retries ran out on engines that kept failing
                    assert not recoverable or all(e.relaunches >= limit for e in engines)
                    return
                assert [o.request_id for o in outputs] == [r.request_id for r in requests], "a request lost"
                assert all(o.weight_version == version for o in outputs), "served with stale weights"
            for engine in engines:
                assert engine.relaunches <= limit
        # Every group generated in one engine call (its prefill shared), never split across engines.
        for engine in engines:
            for ids in engine.calls:
                for key in {group_key(i) for i in ids}:
                    assert sum(group_key(i) == key for i in ids) == 2
        await router.aclose()

    asyncio.run(scenario())
