"""The proxies the loops call in place of role objects that live in Ray processes (`relax.core.placement.ray.workers`).

A proxy (`RemoteActor`, `RemoteRollout`, ...) has its role's async methods and forwards them with
``await handle.method.remote(...)``; the few synchronous members the loops use (``save``, ``load``,
``data_source.state_dict``) wait on the call. A role's process that died surfaces as `RoleDiedError` naming the role.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ray

from relax.data.sample import Sample
from relax.utils.errors import RunFault

CALL_TIMEOUT_S = 600.0  # a synchronous proxy call (save, load) waits at most this long
# After one call of a group fails, how long the others get to settle, so that a process's death among them is named
# rather than its peer's collective error (a killed process surfaces in Ray within about a second).
DEATH_GRACE_S = 5.0


class RoleDiedError(RunFault):
    """A role's Ray process died (killed, out of memory, a crash); the message names the role."""


def role_died(role: str, err: Exception) -> RoleDiedError:
    """Ray's ``RayActorError`` of role ``role``'s worker, as the error that names it."""
    return RoleDiedError(f"the {role} role's Ray process died: {str(err).splitlines()[0]}")


async def named_call(role: str, ref) -> Any:
    """Await a call to one of role ``role``'s processes; the process's death names the role (`RoleDiedError`)."""
    try:
        return await ref
    except ray.exceptions.RayActorError as err:
        raise role_died(role, err) from err


async def settle_calls(calls: list, grace_s: float = DEATH_GRACE_S) -> list:
    """Await calls that meet in one collective (the ranks of a role; the weight broadcast's sender and receiver)
    and return their results in order.

    When one fails, the others get ``grace_s`` to settle before the error is raised, and a `RoleDiedError` among
    them is raised in preference: a killed process makes its peers' collectives fail too (gloo's "connection
    closed by peer"), often first, and the run must name the process that died, not the survivor that noticed.
    The grace is bounded so that a peer left waiting in a collective for the failed call never hangs the caller.
    """
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=grace_s)
    finally:
        for task in tasks:
            task.cancel()  # only the local waits still open: a Ray call, once sent, is not revoked
    errors = [task.exception() for task in tasks if task.done() and not task.cancelled() and task.exception()]
    if errors:
        raise next((err for err in errors if isinstance(err, RoleDiedError)), errors[0])
    return [task.result() for task in tasks]


class RemoteRole:
    """What every proxy shares: calls that name the role when its process is gone, instead of Ray's bare
    ``ActorDiedError``. A role spread over several processes (``handles``: its ranks in order) gets every call on
    every rank at once (their collectives meet) and answers with rank 0's result."""

    def __init__(self, name: str, handle: Any | list[Any]) -> None:
        self.name = name
        self.handles = list(handle) if isinstance(handle, list | tuple) else [handle]
        self.handle = self.handles[0]

    async def _call(self, method: str, *args: Any) -> Any:
        results = await settle_calls([named_call(self.name, getattr(h, method).remote(*args)) for h in self.handles])
        return results[0]

    def _wait(self, method: str, *args: Any) -> Any:
        try:
            return ray.get([getattr(h, method).remote(*args) for h in self.handles], timeout=CALL_TIMEOUT_S)[0]
        except ray.exceptions.RayActorError as err:
            raise role_died(self.name, err) from err

    async def health(self) -> dict:
        return await self._call("health")

    def save(self, directory: Path, include_optimizer: bool = True, asynchronous: bool = False) -> list:
        """``asynchronous``: the call is submitted and its future returned; the role's process runs the save to its
        end before it serves a later call (the save never yields its event loop), so what it writes is the state
        after the step the save follows."""
        if not asynchronous:
            self._wait("save", str(directory), include_optimizer)
            return []
        return [_named_future(self, h.save.remote(str(directory), include_optimizer).future()) for h in self.handles]

    def load(self, directory: Path) -> None:
        self._wait("load", str(directory))


def _named_future(role: RemoteRole, future):
    """``future`` with a Ray actor's death turned into `RoleDiedError` naming ``role``."""
    named: concurrent.futures.Future = concurrent.futures.Future()

    def settle(done) -> None:
        error = done.exception()
        if error is None:
            named.set_result(done.result())
        else:
            named.set_exception(role_died(role.name, error) if isinstance(error, ray.exceptions.RayActorError)
                                else error)

    future.add_done_callback(settle)
    return named


class RemoteActor(RemoteRole):
    """`relax.components.actor.Actor` in another process."""

    def __init__(self, handle: Any, train_batch_size: int) -> None:
        super().__init__("actor", handle)
        self.train_batch_size = train_batch_size
        self._hf_config = None

    def needs_old_log_probs(self, num_samples: int) -> bool:
        return num_samples > self.train_batch_size

    async def compute_log_probs(self, samples, gather_ids=None):
        return await self._call("compute_log_probs", samples, gather_ids)

    async def compute_values(self, samples):
        """A reward model's per-token scores (``--loss-type rm``: the actor is the score model)."""
        return await self._call("compute_values", samples)

    async def train(self, samples, fields, gather_ids=None) -> dict[str, float]:
        return await self._call("train", samples, fields, gather_ids)

    async def streamed_step_unsupported(self, num_samples: int) -> str | None:
        return await self._call("streamed_step_unsupported", num_samples)

    async def train_chunk(self, step: int, samples, fields, expected_samples: int, last: bool) -> None:
        await self._call("train_chunk", step, samples, fields, expected_samples, last)

    async def finish_streamed_step(self, step: int) -> dict[str, float]:
        return await self._call("finish_streamed_step", step)

    async def train_chunk_rows(self, step: int, rows, samples, fields, expected_samples: int, last: bool,
                               needs: tuple[str, ...], dump_limit: int):
        return await self._call("train_chunk_rows", step, rows, samples, fields, expected_samples, last, needs,
                                dump_limit)

    @property
    def backend(self) -> SimpleNamespace:
        """What the controller reads of the backend: the model config (for checkpoint metadata)."""
        if self._hf_config is None:
            self._hf_config = self._wait("hf_config")
        return SimpleNamespace(hf_config=self._hf_config)


class RemoteReference(RemoteRole):
    """`relax.components.actor_fwd.ActorFwd` (the reference) in another process: its own, or, with ``inside`` =
    ``"actor"`` (--hybrid), the actor's processes, which hold it beside the policy."""

    def __init__(self, handle: Any, inside: str | None = None) -> None:
        super().__init__(inside or "reference", handle)
        self._method = "reference_log_probs" if inside else "compute_log_probs"

    async def compute_log_probs(self, samples):
        return await self._call(self._method, samples)

    async def stream_role_step(self, step: int) -> int:
        return await self._call("stream_role_step", step)


class RemoteAdvantages(RemoteRole):
    """`relax.components.advantages.Advantages` in its own process (``--resource '{"advantages": [1, 0]}'``); its
    settings (``spec``, ``needs_kl``, `result_of`) are read from the local copy ``local``, the work is done there."""

    def __init__(self, handle: Any, local: Any) -> None:
        super().__init__("advantages", handle)
        self.local = local

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    async def compute(self, samples, log_probs=None, ref_log_probs=None, values=None):
        return await self._call("compute_advantages", samples, log_probs, ref_log_probs, values)

    async def stream_role_step(self, step: int) -> int:
        return await self._call("stream_role_step", step)


class RayJudge:
    """The GenRM judge in its own Ray process (``--resource '{"genrm": [1, g]}'``), called by actor name from the
    rollout's rewards: ``await judge(args, sample)`` as `relax.rollout.rewards.genrm.GenerativeReward` is called."""

    def __init__(self, actor_name: str) -> None:
        self.actor_name = actor_name
        self._handle = None
        self.verdicts = 0

    async def __call__(self, args: Any, sample: Any) -> float:
        if self._handle is None:
            self._handle = ray.get_actor(self.actor_name)
        # What the judge's prompt reads (and its seed): not the sample's token lists and media.
        shown = Sample(index=sample.index, prompt=sample.prompt, response=sample.response, label=sample.label)
        try:
            verdict = await self._handle.verdict.remote(shown)
        except ray.exceptions.RayActorError as err:
            raise role_died("genrm", err) from err
        self.verdicts += 1
        return verdict

    def pop_metrics(self) -> dict[str, int]:
        verdicts, self.verdicts = self.verdicts, 0
        return {"reward/genrm_verdicts": verdicts}


class RemoteCritic(RemoteRole):
    """`relax.components.critic.Critic` in another process."""

    def __init__(self, handle: Any) -> None:
        super().__init__("critic", handle)

    async def compute_values(self, samples):
        return await self._call("compute_values", samples)

    async def train(self, samples, returns, old_values) -> dict[str, float]:
        return await self._call("train", samples, returns, old_values)


class RemoteDataSource:
    """The rollout's prompt cursor, read, set and (for the loops that train on the dataset: SFT, DPO, rm) advanced
    through the rollout worker."""

    def __init__(self, rollout: RemoteRole) -> None:
        self.rollout = rollout

    def take(self, count: int) -> tuple[int, list]:
        return self.rollout._wait("take_data", count)

    def state_dict(self) -> dict:
        return self.rollout._wait("data_source_state")

    def load_state_dict(self, state: dict) -> None:
        self.rollout._wait("load_data_source_state", state)


class RemoteRollout(RemoteRole):
    """`relax.components.rollout.Rollout` in another process. ``eval_sets`` maps each held-out set
    to its number of prompts (the controller only asks whether there are any)."""

    def __init__(self, handle: Any, eval_sets: dict[str, int]) -> None:
        super().__init__("rollout", handle)
        self.eval_sets = eval_sets
        self.data_source = RemoteDataSource(self)

    async def generate(self, rollout_id: int):
        return await self._call("generate", rollout_id)

    async def evaluate(self, step: int):
        return await self._call("evaluate", step)

    async def eval_set(self, name: str) -> list:
        return await self._call("eval_set", name)

    async def generate_into_plane(self, rollout_id: int) -> tuple[dict, dict]:
        return await self._call("generate_into_plane", rollout_id)

    async def follow_published_weights(self, root: str, run: str) -> None:
        await self._call("follow_published_weights", root, run)

    async def catch_up_with_published_weights(self) -> int:
        return await self._call("catch_up_with_published_weights")
