"""`relax` command: train, eval, export, serve, scale, health, config-docs, model-docs. Each command lives in its own
module, imported only when it runs: `relax --help` and `relax --version` load no torch."""

from __future__ import annotations

import sys

try:  # a Ctrl-C while these load, before main() can catch it (seen in a suite run): exit 130, no traceback
    import difflib
    import faulthandler
    import importlib
    import io
    import os

    from relax.cli.common import cause_first, log_to_run_file, offline_environment, run_fault
    from relax.utils import interrupts
except KeyboardInterrupt:
    sys.stderr.write("\nrelax: interrupted\n")
    raise SystemExit(130) from None

USAGE = """usage: relax <command> [options]   (relax --version prints the version)

commands:
  train        train a model with RL (relax train --help lists every setting)
  eval         measure a model or checkpoint on held-out prompt sets
  export       turn a checkpoint into a Hugging Face model folder
  serve        serve a model over HTTP (SGLang native and OpenAI protocols)
  scale        add or remove rollout engines of a running training (its --rollout-api-port)
  health       show a run's health state: each role's heartbeat and errors (--use-health-check)
  config-docs  print the configuration reference (docs/config.md)
  model-docs   print the supported-model table (docs/models.md)
"""

# command -> "module:function"; the module is imported when its command runs.
COMMANDS = {
    "train": "relax.cli.train:cmd_train",
    "eval": "relax.cli.evaluate:cmd_eval",
    "export": "relax.cli.export:cmd_export",
    "serve": "relax.cli.serve:cmd_serve",
    "scale": "relax.cli.inspect:cmd_scale",
    "health": "relax.cli.inspect:cmd_health",
    "config-docs": "relax.cli.inspect:cmd_config_docs",
    "model-docs": "relax.cli.inspect:cmd_model_docs",
}


# Environment a command needs before torch loads (torch reads it once, at import).
COMMAND_ENVIRONMENT = {
    # c10d errors (a failed /init_weights_update_group) are logged by torch's C++ logger with their C++ stack
    # frames; the error reaches the client and the log as one line anyway.
    "serve": {"TORCH_CPP_LOG_LEVEL": "FATAL"},
    # The trainer's micro-batches change size every step and the engine's pool sits beside them: expandable
    # segments grow one mapping instead of leaving freed blocks of the wrong size reserved (fragmentation measured
    # at 19.6 GiB on the H200 before an out-of-memory error; relax.core.loops.memory_plan). Read at the first CUDA
    # allocation; a value given in the environment is kept.
    "train": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
}


def command_function(command: str):
    offline_environment()  # before the command's module imports transformers
    for name, value in COMMAND_ENVIRONMENT.get(command, {}).items():
        os.environ.setdefault(name, value)
    module, function = COMMANDS[command].split(":")
    return getattr(importlib.import_module(module), function)


def _report_native_crashes() -> None:
    """A crash in native code (a segfault in a library) leaves every thread's Python stack on stderr, not nothing;
    where stderr is no file (captured, as under pytest's capsys) there is nowhere to write it."""
    try:
        faulthandler.enable()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _report_native_crashes()
    interrupts.install()
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"relax {_version()}")
        return 0
    if argv[0] not in COMMANDS:
        hints = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f" (did you mean {hints[0]!r}?)" if hints else ""
        print(f"relax: unknown command {argv[0]!r}{hint}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return _run_command(argv[0], argv[1:])
    except KeyboardInterrupt:  # Ctrl-C before the run's own handler is installed (start-up, eval, export)
        print(f"\nrelax {argv[0]}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        # A Ctrl-C inside the command's imports can surface as another error: numpy interrupted while importing
        # a submodule raises RecursionError at the next use of it (seen from accelerate's import).
        if interrupts.caused_by_interrupt(err) or interrupts.received():
            print(f"\nrelax {argv[0]}: interrupted", file=sys.stderr)
            return 130
        raise


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("relax-rl")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _run_command(command: str, argv: list[str]) -> int:
    with interrupts.deferred():  # a Ctrl-C inside torch's native import could abort the interpreter
        function = command_function(command)  # first: its environment is set before anything imports torch
    from relax.config import ConfigError
    from relax.core.state.checkpoint import CheckpointError
    from relax.data.dataset import DatasetError
    from relax.data.multimodal.errors import MediaError
    from relax.utils.heap import freeze_long_lived_objects

    freeze_long_lived_objects()  # the command's imports are done: later collections skip them

    try:
        return function(argv)
    # Bad input Relax named (a row's media too: a restart would meet the same row again): exit 2, not restarted.
    except (ConfigError, DatasetError, CheckpointError, MediaError) as err:
        log_to_run_file(f"relax {command}: error: {err}")
        print(f"relax {command}: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        if interrupts.caused_by_interrupt(err) or interrupts.received():  # Ctrl-C inside a library's start-up
            raise KeyboardInterrupt from None
        fault = run_fault(err)
        if fault is not None:  # a process died or hung: its name says it all, and a restart may recover
            log_to_run_file(f"relax {command}: failed: {fault}")
            print(f"relax {command}: failed: {fault}", file=sys.stderr)
            return 1
        log_to_run_file(f"relax {command}: failed: {cause_first(err)}", exc_info=err)
        raise


if __name__ == "__main__":
    sys.exit(main())
