#!/usr/bin/env bash
# Create .venv (if needed) and install Relax into it. Usage: bash scripts/setup.sh [extras], e.g. "test".
# Fails loudly: pip's whole output goes to .venv/setup.log (its tail is printed when a step fails), and the result is
# checked (relax imports, the `relax` command answers, every extra's packages import) before this says it is done.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
log=.venv/setup.log

fail() {
  echo "setup: FAILED: $1" >&2
  if [ -f "$log" ]; then
    echo "setup: the last lines of $log:" >&2
    tail -n 30 "$log" >&2
  fi
  exit 1
}

command -v python3 >/dev/null || fail "python3 is not on PATH (Relax needs Python 3.11 or newer)"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || fail "Python $(python3 -c 'import platform; print(platform.python_version())') is too old (Relax needs 3.11+)"
python3 -m venv .venv || fail "python3 -m venv .venv (on Debian/Ubuntu: apt install python3-venv)"
# shellcheck disable=SC1091
. .venv/bin/activate
: > "$log"
step() {  # step "what" command...: run it with its output in the log, or fail naming it
  local what="$1"
  shift
  echo "setup: $what" >&2
  "$@" >> "$log" 2>&1 || fail "$what"
}
step "pip upgrade" python -m pip install --upgrade pip
# torch first and pinned: an unpinned torch can pull a multi-GB CUDA build on a CPU machine. pip byte-compiles every
# package it installs; keep it: where PYTHONDONTWRITEBYTECODE is set (as on our machines) Python never writes the
# cache itself, and without pip's every process would compile torch's and transformers' sources again at each import
# (`--no-compile` cut the set-up from 80 s to 47 s and made the suite far slower).
step "torch 2.13.0" python -m pip install "torch==2.13.0"
step "relax-rl${extras:+[$extras]}" python -m pip install -e ".${extras:+[$extras]}"

# The result, checked: a pip that exits 0 without installing the package (seen once on a fresh clone) fails here.
python -c "import relax, torch, transformers, gguf" >> "$log" 2>&1 || fail "import relax, torch, transformers, gguf (relax-rl is not installed in .venv)"
relax --version >> "$log" 2>&1 || fail "the relax command (relax --version) does not run"
case ",$extras," in
  *,test,*|*,ray,*) python -c "import ray, transfer_queue" >> "$log" 2>&1 || fail "import ray, transfer_queue (the ray extra)" ;;
esac
case ",$extras," in
  *,test,*) python -c "import pytest, xdist, schemathesis, importlinter, openai, anthropic, bm25s, trl" >> "$log" 2>&1 \
              || fail "import pytest, xdist, schemathesis, importlinter, openai, anthropic, bm25s, trl (the test extra)"
            if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then  # the tests compile the CUDA kernels with it
              python -c "from relax.backends.inference.engine_core import nvrtc; nvrtc.library()" >> "$log" 2>&1 \
                || fail "the NVRTC library (nvidia-cuda-nvrtc, the test extra)"
            fi ;;
esac
echo "setup: done ($(relax --version); pip's output in $log)" >&2
