#!/usr/bin/env bash
# Create .venv (if needed) and install Relax into it. Usage: bash scripts/setup.sh [extras], e.g. "test".
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# torch first and pinned: an unpinned torch can pull a multi-GB CUDA build on a CPU machine.
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".${extras:+[$extras]}"
