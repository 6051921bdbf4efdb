"""`relax health` (a run's health state), `relax config-docs` and `relax model-docs` (the generated references), `relax scale` (the scaling client)."""

from __future__ import annotations

import json
from pathlib import Path

from relax.backends.models.registry import models_markdown
from relax.cli.args import CommandLineParser, render_config_reference
from relax.cli.scale import main as scale_main
from relax.config import ConfigError
from relax.core.state.health import STATE_FILE, HealthStateError, format_state, read_state


def cmd_config_docs(argv: list[str]) -> int:
    print(render_config_reference())
    return 0


def cmd_model_docs(argv: list[str]) -> int:
    print(models_markdown(), end="")
    return 0


def cmd_scale(argv: list[str]) -> int:
    return scale_main(argv)


def cmd_health(argv: list[str]) -> int:
    parser = CommandLineParser(prog="relax health", description="Show the health state of a run "
                                     f"(<run dir>/{STATE_FILE}, written every second under --use-health-check).")
    parser.add_argument("run_dir", type=Path, help="the run's --output-dir")
    parser.add_argument("--json", action="store_true", help=f"print {STATE_FILE} as it is")
    args = parser.parse_args(argv)
    try:
        state = read_state(args.run_dir)
    except HealthStateError as err:
        raise ConfigError(str(err)) from None
    if state is None:
        raise ConfigError(f"{args.run_dir / STATE_FILE}: no health state (was the run started with "
                          "--use-health-check?)")
    print(json.dumps(state, indent=2) if args.json else format_state(state))
    healthy = all(role.get("healthy", True) for role in state.get("roles", {}).values()) and not state.get("fatal")
    return 0 if healthy else 1
