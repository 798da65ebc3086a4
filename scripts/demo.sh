#!/usr/bin/env bash
# The main job: set-up (see setup_env.sh), then the CPU demo recipe. Extra args go to `python -m trl_async.demo`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
OMP_NUM_THREADS=1 python -m trl_async.demo "$@"
