#!/usr/bin/env bash
# Fresh machine -> the whole CPU test suite: set up, then run pytest (GPU tests skip themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. .venv/bin/activate
python -m pytest -q "$@"
