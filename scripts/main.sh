#!/usr/bin/env bash
# The main job on the built-in default workload (creates or reuses .venv first).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
exec python -m omni_accum.demo "$@"
