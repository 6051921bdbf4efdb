#!/usr/bin/env bash
# Fresh machine -> the whole CPU test suite: set up, then run pytest (GPU tests skip themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. .venv/bin/activate
# The architecture's contracts first (pyproject.toml [tool.importlinter], docs/architecture.md): seconds, not minutes.
lint-imports --no-cache
# Two workers (the tests wait on processes about half the time; RELAX_TEST_WORKERS=0 runs them in this process);
# tests that start Ray clusters share one worker (their xdist_group), one after the other.
python -m pytest -q -n "${RELAX_TEST_WORKERS:-2}" --dist loadgroup "$@"
