#!/usr/bin/env bash
# The main job (creates or reuses .venv first): tune the built-in default workload (qwen3-omni-seed:
# context 1k/4k/8k/32k x concurrency 1/4/10), print the decision table and the gain over upstream
# vllm-omni 0.30.0, and write the tuned policy to out/tuned-policy.yaml. Extra arguments go to
# `omni-accum tune` (e.g. --quick, --workload FILE, --out PATH).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
exec omni-accum tune --workload qwen3-omni-seed --out out/tuned-policy.yaml "$@"
