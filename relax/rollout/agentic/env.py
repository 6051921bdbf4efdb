"""The interaction-environment contract (upstream's ``BaseInteractionEnv``) and how environments are loaded.

An environment lives for one sample (one episode). The multi-turn generate loop calls:

1. ``reset()`` once, before the first model turn; the loop does not use what it returns (what the
   model must see first belongs in the prompt);
2. ``step(response_text)`` after every model turn, with that turn's decoded text; it returns
   ``(observation, done, info)``. ``done`` ends the episode (stop reason ``env_done``);
3. ``format_observation(observation)`` turns a not-done observation into one chat message that is
   encoded and appended to the context with loss mask 0;
4. ``close()`` always, also when a step raised or timed out.

``build_env``, ``reset`` and ``step`` that raise, or run past ``--env-step-timeout`` seconds, fail
the sample (status FAILED, ``metadata["error"]`` says which call and why); the run goes on.

``step`` and ``reset`` may be plain or ``async def``. An observation is a dict: ``obs_str`` (the
text), optionally ``role`` (``"user"`` by default; ``"tool"`` for tool results) and
``multi_modal_data`` (``{"image": [PIL.Image, ...]}``).

Environments are built by a module-level ``build_env(sample, args)`` in the module named by
``--rollout-interaction-env-path``.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import Any

from relax.data.sample import Sample
from relax.utils.dotted_path import load_dotted_function

Observation = dict[str, Any]
Message = dict[str, Any]


class BaseInteractionEnv:
    """Subclass and implement ``step`` (and usually ``reset``); the defaults are a no-op environment."""

    def reset(self) -> tuple[Observation, dict[str, Any]]:
        return {}, {}

    def step(self, response_text: str) -> tuple[Observation, bool, dict[str, Any]]:
        raise NotImplementedError

    def close(self) -> None:
        return None

    def format_observation(self, observation: Observation) -> Message:
        """One chat message: each image of ``multi_modal_data`` as an image item, then the text."""
        images = (observation.get("multi_modal_data") or {}).get("image") or []
        text = observation.get("obs_str", "")
        role = observation.get("role", "user")
        if not images:
            return {"role": role, "content": text}
        content = [{"type": "image", "image": image} for image in images]
        content.append({"type": "text", "text": text})
        return {"role": role, "content": content}


EnvBuilder = Callable[[Sample, Any], BaseInteractionEnv]


def load_env_builder(module_path: str) -> EnvBuilder:
    """The ``build_env`` function of the module ``--rollout-interaction-env-path`` names
    (``pkg.module``, or ``pkg.module:function`` for another function name)."""
    dotted = module_path if ":" in module_path else f"{module_path}:build_env"
    return load_dotted_function(dotted, "--rollout-interaction-env-path")


class EnvCallError(RuntimeError):
    """An environment method raised or ran past ``--env-step-timeout``; the sample fails, the run goes on."""


async def call_env(method: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """``method(*args)`` (sync or ``async def``), bounded by ``timeout`` seconds.

    A sync method runs in a daemon thread so that it neither blocks the event loop (the other
    samples keep generating) nor, if it hangs for good, keeps the process from exiting; the hung
    thread is abandoned. Raises `EnvCallError` naming the method for an exception or a timeout.
    """
    name = getattr(method, "__qualname__", repr(method))
    try:
        if inspect.iscoroutinefunction(method):
            return await asyncio.wait_for(method(*args), timeout)
        result = await asyncio.wait_for(_in_daemon_thread(method, *args), timeout)
        return await asyncio.wait_for(result, timeout) if inspect.isawaitable(result) else result
    except TimeoutError:
        raise EnvCallError(f"{name} did not return within --env-step-timeout {timeout:g} s") from None
    except Exception as err:
        raise EnvCallError(f"{name} raised {type(err).__name__}: {err}") from err


def _in_daemon_thread(method: Callable[..., Any], *args: Any) -> asyncio.Future:
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome: Any, error: BaseException | None) -> None:
        if future.done():  # timed out and cancelled meanwhile
            return
        if error is None:
            future.set_result(outcome)
        else:
            future.set_exception(error)

    def target() -> None:
        try:
            outcome, error = method(*args), None
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome, error = None, err
        try:
            loop.call_soon_threadsafe(settle, outcome, error)
        except RuntimeError:  # an abandoned call that outlived its event loop
            pass

    threading.Thread(target=target, name="relax-env", daemon=True).start()
    return future
