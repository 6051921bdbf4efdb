"""Interaction environments that fail the ways a real one can, for the --env-workers tests (importable by the
spawned worker processes: `tests.support.e2e_envs:build_env`). The sample's ``metadata["env"]`` picks the behaviour."""

from __future__ import annotations

import ctypes
import os
import time

from relax.rollout.agentic.env import BaseInteractionEnv


class Episode(BaseInteractionEnv):
    def __init__(self, kind: str, pid_file: str | None = None) -> None:
        self.kind, self.turns = kind, 0
        if pid_file:  # where the test finds the worker's pid
            with open(pid_file, "w") as handle:
                handle.write(str(os.getpid()))

    def reset(self):
        if self.kind == "exits_at_reset":
            os._exit(3)
        return {}, {}

    def step(self, response_text):
        self.turns += 1
        if self.kind == "exits":
            os._exit(3)
        if self.kind == "segfaults":
            ctypes.string_at(0)
        if self.kind == "leaks":
            hoard = bytearray(2 * 1024**3)  # 2 GiB: past --env-worker-memory-mb
            return {"obs_str": str(len(hoard))}, True, {}
        if self.kind == "hangs":
            time.sleep(120)
        if self.kind == "raises":
            raise RuntimeError("the tool crashed")
        return {"obs_str": f"turn {self.turns} of {self.kind}", "role": "user"}, self.turns == 2, {"pid": os.getpid()}

    def format_observation(self, observation):
        return {"role": "user", "content": observation["obs_str"] + " (formatted in the worker)"}


def build_env(sample, args):
    return Episode(sample.metadata.get("env", "ok"), sample.metadata.get("pid_file"))


def build_env_crashing_now_and_then(sample, args):
    """In every step, the first environment built for its second prompt group ends its worker's process as its episode
    starts (a marker file per prompt under --output-dir picks exactly one sample)."""
    crashes = os.path.join(args.output_dir, "env-crashes")
    os.makedirs(crashes, exist_ok=True)
    if sample.group_index % 4 == 1:  # four prompt groups a step
        try:
            os.close(os.open(os.path.join(crashes, str(sample.index)), os.O_CREAT | os.O_EXCL))
            return Episode("exits_at_reset")
        except FileExistsError:
            pass
    return Episode("ok")
