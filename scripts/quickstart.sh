#!/usr/bin/env bash
# Fresh machine -> a trained model: set up, then run the CPU quickstart (GRPO on 3-digit addition).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# --overwrite: running the quickstart again starts it afresh in runs/quickstart (a plain `relax train` refuses a
# used run directory).
relax train --config examples/quickstart/config.yaml --overwrite "$@"
