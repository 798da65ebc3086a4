#!/usr/bin/env bash
# The test command: fast tier, then the slow tier (end-to-end training runs). Offline, CPU only.
# Usage: bash scripts/test.sh [extra pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
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
