"""Agentic rollout with an external agent program (upstream's managed-command rollout).

``--custom-generate-function-path relax.rollout.agentic.agent_rollout:generate --agent-command "python agent.py"``
runs the agent once per sample. The agent talks to the policy through the agent gateway's OpenAI-compatible
``/v1/chat/completions`` (`relax.rollout.agentic.gateway`), which records the session token-in/token-out; when the
agent exits, the recorded trajectory becomes the sample.

The agent's environment holds only what it needs, never the trainer's secrets: ``PATH``, ``HOME``, locale and
Python path variables, and

- ``RELAX_BASE_URL`` (``http://127.0.0.1:PORT/v1``) and ``RELAX_SESSION_ID`` (also the API key, sent as
  ``Authorization: Bearer``); ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` repeat them so ``OpenAI()`` works as is;
- ``RELAX_INPUT_JSON``: a file with the sample's ``prompt``, ``label``, ``metadata``, ``index`` and ``group_index``;
- ``RELAX_OUTPUT_JSON``: where the agent may write ``{"reward": float | {name: float}, "metadata": {...}}``;
  without a reward the run's reward function scores the sample; the metadata is merged into the sample's;
- ``RELAX_SESSION_IO_DIR``: a scratch directory of the session (both files live there; removed afterwards);
- ``RELAX_GROUP_ID``: the sample's prompt group.

An agent that cannot start, exits non-zero, outlives ``--agent-timeout`` (its whole process group is killed) or
writes a bad output file gives a FAILED sample with ``metadata["error"]`` (with the tail of its stderr); the run
goes on.

One gateway serves all sessions of the event loop: the first session starts it, and it closes when the last open
session closes, so it never outlives the rollout step that needed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import numbers
import os
import shlex
import signal
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax.backends.inference.answer_room import answer_room
from relax.backends.inference.base import SamplingParams
from relax.data.sample import Sample, SampleStatus
from relax.rollout.agentic.admission import ProgramAdmission, kv_capacity_of
from relax.rollout.agentic.gateway import AgentGateway, Trajectory, openai_tool_calls
from relax.rollout.agentic.tool_parser import get_tool_call_parser

logger = logging.getLogger("relax")

# The parent's variables an agent may see: enough to find programs and Python packages; no keys or tokens.
PASSED_ENV_VARS = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")
KILL_GRACE_S = 2.0  # between SIGTERM and SIGKILL of a timed-out agent's process group
STDERR_TAIL_CHARS = 2000
_STATUS_OF_FINISH = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


@dataclass
class AgentOutcome:
    """What the agent reported: a reward (None: let the run's reward function score), metadata, or an error."""

    reward: float | dict[str, float] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


async def generate(args: Any, sample: Sample, sampling_params: SamplingParams) -> Sample:
    """Run ``--agent-command`` for ``sample`` and return the sample built from its recorded session."""
    if not getattr(args, "agent_command", None):
        raise ValueError("relax.rollout.agentic.agent_rollout needs --agent-command (the agent program to run)")
    argv = shlex.split(args.agent_command)
    async with shared_gateway(args) as (gateway, admission):
        # --agentic-program-admission: the program starts once its context budget fits the engine's KV pool; the
        # budget is the session's, which the room a prompt and its answer share on the engine caps
        room = answer_room(args)
        reserve = getattr(args, "rollout_max_context_len", None) or len(sample.tokens) + args.rollout_max_response_len
        async with admission.admit(reserve if room is None else min(reserve, room.tokens)) as admitted:
            session = gateway.open_session(args.engine, sampling_params,
                                           max_context_len=getattr(args, "rollout_max_context_len", None),
                                           answer_room=None if room is None else room.tokens,
                                           name=f"{sample.index}-{uuid.uuid4().hex[:6]}")
            try:
                with tempfile.TemporaryDirectory(prefix="relax-agent-") as io_dir:
                    env = agent_environment(gateway.base_url, session.session_id, Path(io_dir), sample)
                    outcome = await run_agent(argv, env, Path(io_dir), float(args.agent_timeout))
            finally:
                trajectory = await gateway.close_session(session)
    result = trajectory_to_sample(sample, trajectory, outcome, args.tokenizer)
    if getattr(args, "agentic_program_admission", False):
        result.metadata.update(admission_wait_s=admitted.wait_s, admission_bypassed=admitted.bypassed)
    return result


# ----------------------------------------------------------------------------- the shared gateway

_SHARED: dict[tuple[int, int], _SharedGateway] = {}


@dataclass
class _SharedGateway:
    gateway: AgentGateway
    ready: asyncio.Future  # the server's start, awaited by every user
    admission: ProgramAdmission  # the programs' FIFO ledger against the engine's KV pool
    users: int = 0


def _admission(args: Any) -> ProgramAdmission:
    """--agentic-program-admission's ledger over the rollout engine's pool; without the flag one that admits all."""
    if not getattr(args, "agentic_program_admission", False):
        return ProgramAdmission(None)
    capacity = kv_capacity_of(args.engine)
    if capacity is None:
        logger.warning("--agentic-program-admission: the rollout engine's KV pool cannot be read from this process "
                       "(engines in other processes); every agent program is admitted at once")
    return ProgramAdmission(capacity, headroom=args.agentic_admission_headroom,
                            pressure=args.agentic_admission_pressure, max_wait_s=args.agentic_admission_max_wait)


@contextlib.asynccontextmanager
async def shared_gateway(args: Any) -> AsyncIterator[tuple[AgentGateway, ProgramAdmission]]:
    """The running loop's gateway for ``args.tokenizer`` and its programs' admission: started by its first user,
    closed after its last one."""
    key = (id(asyncio.get_running_loop()), id(args.tokenizer))
    shared = _SHARED.get(key)
    if shared is None:
        parser_name = getattr(args, "tool_call_parser", None)
        splitter = openai_tool_calls(get_tool_call_parser(parser_name)) if parser_name else None
        gateway = AgentGateway(args.tokenizer, chat_template_kwargs=getattr(args, "chat_template_kwargs", None),
                               split_tool_calls=splitter,
                               session_lifecycle=bool(getattr(args, "agentic_session_lifecycle", False)))
        shared = _SHARED[key] = _SharedGateway(gateway, asyncio.ensure_future(gateway.start()), _admission(args))
    shared.users += 1
    try:
        await asyncio.shield(shared.ready)  # one user's cancellation must not stop the start the others wait on
        yield shared.gateway, shared.admission
    finally:
        shared.users -= 1
        if shared.users == 0:
            if _SHARED.get(key) is shared:
                del _SHARED[key]  # before any await: a session opened from now on starts a fresh gateway
            await shared.gateway.close()


# ----------------------------------------------------------------------------- the agent process


def agent_environment(base_url: str, session_id: str, io_dir: Path, sample: Sample) -> dict[str, str]:
    """The agent's environment; writes the input file into ``io_dir``."""
    input_path, output_path = io_dir / "input.json", io_dir / "output.json"
    record = {"prompt": sample.prompt, "label": sample.label, "metadata": sample.metadata, "index": sample.index,
              "group_index": sample.group_index}
    input_path.write_text(json.dumps(record, default=str))
    env = {name: os.environ[name] for name in PASSED_ENV_VARS if name in os.environ}
    env.update({
        "RELAX_BASE_URL": base_url, "RELAX_SESSION_ID": session_id, "RELAX_INPUT_JSON": str(input_path),
        "RELAX_OUTPUT_JSON": str(output_path), "RELAX_SESSION_IO_DIR": str(io_dir),
        "RELAX_GROUP_ID": str(sample.group_index), "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": session_id,
    })
    return env


async def run_agent(argv: list[str], env: dict[str, str], io_dir: Path, timeout_s: float) -> AgentOutcome:
    """Run the agent in a process group of its own, at most ``timeout_s`` seconds; its outcome."""
    stderr_path = io_dir / "agent.stderr"  # a file, not a pipe: a chatty agent can never block on it
    with open(stderr_path, "wb") as stderr:  # noqa: ASYNC230 - a local scratch file
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=stderr,
                start_new_session=True)  # its own process group, so a timeout kills its children too
        except OSError as error:
            return AgentOutcome(error=f"the agent could not start ({argv[0]!r}): {error}")
        try:
            exit_code = await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError:
            await _kill_group(process)
            return AgentOutcome(error=f"the agent did not finish within --agent-timeout {timeout_s:g} s and was "
                                      f"killed{_stderr_tail(stderr_path)}")
        except asyncio.CancelledError:
            await _kill_group(process)
            raise
        finally:
            _signal_group(process.pid, signal.SIGKILL)  # children it left behind
    if exit_code != 0:
        return AgentOutcome(error=f"the agent exited with code {exit_code}{_stderr_tail(stderr_path)}")
    return read_agent_output(io_dir / "output.json")


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _kill_group(process: asyncio.subprocess.Process) -> None:
    """SIGTERM to the agent's process group, SIGKILL after a grace period."""
    _signal_group(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), KILL_GRACE_S)
    except TimeoutError:
        _signal_group(process.pid, signal.SIGKILL)
        await process.wait()


def _stderr_tail(path: Path) -> str:
    text = path.read_bytes()[-STDERR_TAIL_CHARS:].decode(errors="replace").strip()
    return f"; stderr tail:\n{text}" if text else " (stderr empty)"


def read_agent_output(path: Path) -> AgentOutcome:
    """The agent's ``{"reward": ..., "metadata": {...}}``; no file means no reward and no metadata."""
    if not path.exists():
        return AgentOutcome()
    try:
        record = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        return AgentOutcome(error=f"RELAX_OUTPUT_JSON is not valid JSON: {error}")
    if not isinstance(record, dict):
        return AgentOutcome(error=f"RELAX_OUTPUT_JSON must hold an object, got {type(record).__name__}")
    metadata = record.get("metadata") or {}
    if not isinstance(metadata, dict):
        return AgentOutcome(error=f"RELAX_OUTPUT_JSON: metadata must be an object, got {type(metadata).__name__}")
    reward = record.get("reward")
    if reward is not None:
        try:
            reward = _checked_reward(reward)
        except ValueError as error:
            return AgentOutcome(metadata=metadata, error=f"RELAX_OUTPUT_JSON: reward: {error}")
    return AgentOutcome(reward=reward, metadata=metadata)


def _checked_reward(value: Any) -> float | dict[str, float]:
    if isinstance(value, dict):
        return {str(key): _checked_number(number) for key, number in value.items()}
    return _checked_number(value)


def _checked_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"expected a finite number or an object of them, got {value!r}")
    return float(value)


# ----------------------------------------------------------------------------- the sample


def _no_turn_error(trajectory: Trajectory) -> str:
    if trajectory.stop_reason == "budget_exhausted":
        return "the agent's first prompt leaves no room for a model token in --rollout-max-context-len"
    return "the session recorded no model turn: the agent made no successful chat completion request"


def trajectory_to_sample(sample: Sample, trajectory: Trajectory, outcome: AgentOutcome, tokenizer: Any) -> Sample:
    """Fill ``sample`` (in place) from the recorded session and the agent's outcome."""
    sample.metadata = {**sample.metadata, **outcome.metadata, "rollout_turns": trajectory.turns}
    if trajectory.turns:
        sample.tokens = trajectory.tokens
        sample.response_length = len(trajectory.response_ids)
        sample.loss_mask = list(trajectory.loss_mask)
        sample.rollout_log_probs = list(trajectory.log_probs)
        sample.response = tokenizer.decode(trajectory.response_ids, skip_special_tokens=True)
        versions = trajectory.weight_versions
        sample.weight_version = versions[0] if len(set(versions)) == 1 else list(versions)
    error = outcome.error or (None if trajectory.turns else _no_turn_error(trajectory))
    if error is not None:  # kept for inspection, left out of the loss (as the multi-turn loop does)
        sample.status = SampleStatus.FAILED
        sample.metadata["error"] = error
        sample.loss_mask = [0] * sample.response_length
        return sample
    stop_reason = trajectory.stop_reason or trajectory.finish_reason
    sample.metadata["rollout_stop_reason"] = stop_reason
    sample.status = SampleStatus.TRUNCATED if stop_reason == "budget_exhausted" else \
        _STATUS_OF_FINISH[trajectory.finish_reason]
    if outcome.reward is not None:  # else the run's reward function scores the sample
        sample.reward = outcome.reward
    return sample
