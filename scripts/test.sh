#!/usr/bin/env bash
# The test command (what .ci/run calls): tier 1 fast tests, tier 2 slow tests (both in .venv), then tier 3, the
# vLLM tests, in their own environment (.venv-vllm; see scripts/test_vllm.sh). Offline, CPU only.
# Usage: bash scripts/test.sh [extra pytest args for tiers 1 and 2]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
(
  # shellcheck disable=SC1091
  . "$ROOT/scripts/setup_env.sh"
  cd "$ROOT"
  run_tier() {  # pytest exits 5 when a tier selects no test; that is not a failure of the tier.
    local rc=0
    python -m pytest "$@" || rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
  }
  echo "== tier 1: fast tests =="
  run_tier -m "not slow and not vllm" -q "$@"
  echo "== tier 2: slow tests =="
  run_tier -m "slow and not vllm" -q "$@"
)
if [ "${TRL_ASYNC_SKIP_VLLM_TIER:-0}" = "1" ]; then
  echo "== tier 3: vLLM tests skipped (TRL_ASYNC_SKIP_VLLM_TIER=1) =="
else
  bash "$ROOT/scripts/test_vllm.sh"
fi
