#!/usr/bin/env bash
# Fresh machine -> the whole CPU test suite: set up, then run pytest (GPU tests skip themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. .venv/bin/activate
# The architecture's contracts first (pyproject.toml [tool.importlinter], docs/architecture.md): seconds, not minutes.
lint-imports --no-cache
# Three workers on two cores: the tests wait on processes (Ray clusters, restarts, servers) more than half the
# time, so a third worker fills the gaps (docs/architecture.md says where the time goes; RELAX_TEST_WORKERS=0 runs
# them in this process); tests that start Ray clusters in the test's own process share one worker (their xdist_group).
python -m pytest -q -n "${RELAX_TEST_WORKERS:-3}" --dist loadgroup "$@"
