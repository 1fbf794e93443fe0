#!/usr/bin/env bash
# Run the test suite (creates or reuses .venv first). Extra arguments go to pytest.
#
# Then, with no extra arguments (or OMNI_ACCUM_TEST_028=1), the vllm-omni integration tests run again
# against vllm-omni 0.28.0 in .venv-028 (built by env.sh, started from .venv's packages; the path is
# OMNI_ACCUM_VENV_028). OMNI_ACCUM_TEST_028=0 skips that run. The exit status is non-zero when either
# run fails, and the last line sums both runs up as pytest does.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
paths=(tests)
for d in examples/plugins/*/tests; do [ -d "$d" ] && paths+=("$d"); done
# The files that exercise the live integration; they run in every supported release's environment.
integration=(tests/test_integration_vllm_omni*.py tests/test_upstream_equivalence.py tests/test_vllm_omni_smoke.py)
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT

want_028="${OMNI_ACCUM_TEST_028:-}"
[ -z "$want_028" ] && { [ $# -eq 0 ] && want_028=1 || want_028=0; }

start=$(date +%s)
( source "$ROOT/scripts/env.sh" && python -m pytest "${paths[@]}" "$@" ) 2>&1 | tee "$logs/main.log"
rc_main=${PIPESTATUS[0]}
rc_028=0
if [ "$want_028" = "1" ]; then
  echo "== vllm-omni 0.28.0: the integration tests in ${OMNI_ACCUM_VENV_028:-$ROOT/.venv-028} =="
  (
    export OMNI_ACCUM_VENV="${OMNI_ACCUM_VENV_028:-$ROOT/.venv-028}" OMNI_ACCUM_VLLM_VERSION=0.28.0
    source "$ROOT/scripts/env.sh" && python -m pytest "${integration[@]}" "$@"
  ) 2>&1 | tee "$logs/028.log"
  rc_028=${PIPESTATUS[0]}
  # One closing line for both runs, in pytest's words (the per-run lines are above).
  python3 - "$logs/main.log" "$logs/028.log" "$(( $(date +%s) - start ))" <<'EOF'
import re, sys
counts = {}
for path in sys.argv[1:3]:
    lines = [l for l in open(path, errors="replace").read().splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
    if not lines:
        counts["error"] = counts.get("error", 0) + 1  # a run that ended without a summary
        continue
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", lines[-1]):
        what = "error" if what.startswith("error") else what
        counts[what] = counts.get(what, 0) + int(n)
order = ["failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "error"]
parts = [f"{counts[k]} {k + 's' if k == 'error' and counts[k] != 1 else k}" for k in order if counts.get(k)]
print("== both runs together (vllm-omni 0.30.0: the suite; 0.28.0: the integration tests) ==")
print(f"{'=' * 20} {', '.join(parts) or 'no tests ran'} in {float(sys.argv[3]):.2f}s {'=' * 20}")
EOF
fi
[ "$rc_main" -eq 0 ] && [ "$rc_028" -eq 0 ]
