#!/usr/bin/env bash
# Run the test suite (creates or reuses .venv first). Extra arguments go to pytest (test files or folders among
# them are run instead of the whole suite).
#
# Then, with no extra arguments (or OMNI_ACCUM_TEST_028=1), the vllm-omni integration tests run again
# against vllm-omni 0.28.0 in .venv-028 (built by env.sh, started from .venv's packages; the path is
# OMNI_ACCUM_VENV_028). OMNI_ACCUM_TEST_028=0 skips that run (these switches, OMNI_ACCUM_E2E too, take
# 1 / true / yes and 0 / false / no in any case, as CI does; another value is refused; CI=true runs the
# end-to-end test whatever OMNI_ACCUM_E2E says). Likewise OMNI_ACCUM_TEST_016 for vllm-omni
# 0.16.0 in .venv-016 (OMNI_ACCUM_VENV_016), with the integration files that apply to that release (its
# adapter accumulates the whole payload; it has no runner transport, data plane, processor hook, arena
# connector or hand-off). Those two environments are built in the background while the 0.30.0 suite runs.
# The whole suite with no arguments runs in two lanes side by side on a machine of two cores or more (their files
# split by scripts/test_lanes.py from tests/durations.txt; OMNI_ACCUM_TEST_LANES=1 runs one lane, 2 asks for two).
# The exit status is non-zero when any run fails, and the last line sums the
# runs up as pytest does.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
paths=(tests)
whole=1  # the whole suite (no test file or folder among the arguments)
for d in examples/plugins/*/tests; do [ -d "$d" ] && paths+=("$d"); done
# Test files or folders among the extra arguments replace those paths (`bash scripts/test.sh tests/test_x.py` runs
# that file, not the whole suite and that file again); the value of an option that takes one is not a test path.
prev=""
for a in "$@"; do
  case "$prev" in -k|-m|-p|-o|-c|-W|--basetemp|--ignore|--ignore-glob|--deselect|--rootdir|--junitxml) prev=""; continue ;; esac
  case "$a" in -*) ;; *) [ -e "${a%%::*}" ] && { paths=(); whole=0; break; } ;; esac
  prev="$a"
done
# The files that exercise the live integration; they run in every supported release's environment.
integration=(tests/test_integration_vllm_omni*.py tests/test_upstream_equivalence.py tests/test_vllm_omni_smoke.py)
# The ones that apply to vllm-omni 0.16.0 (the release's family, its lockstep; the families file skips,
# naming why, the cases 0.16 lacks).
integration_016=(tests/test_integration_vllm_omni_families.py tests/test_integration_vllm_omni_v016.py)
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT

# A switch's value as CI's is read (any case, blanks ignored): 1 / true / yes -> 1, 0 / false / no -> 0, unset or
# empty -> $2; anything else is refused (exit 2), naming the variable.
switch() {  # NAME DEFAULT
  local v
  v="$(printf '%s' "${!1:-}" | tr '[:upper:]' '[:lower:]' | tr -d '[:space:]')"
  case "$v" in
    "") echo "$2" ;;
    1|true|yes) echo 1 ;;
    0|false|no) echo 0 ;;
    *) echo "test.sh: $1='${!1}' is not a switch (1, true, yes or 0, false, no)" >&2; return 2 ;;
  esac
}
default=0; [ $# -eq 0 ] && default=1
want_028="$(switch OMNI_ACCUM_TEST_028 "$default")" || exit 2
want_016="$(switch OMNI_ACCUM_TEST_016 "$default")" || exit 2
want_e2e_switch="$(switch OMNI_ACCUM_E2E 0)" || exit 2
# Lanes (see below): 2 for the whole suite with no arguments on a machine of two cores or more, else 1;
# OMNI_ACCUM_TEST_LANES=1 or 2 asks for one, for the whole suite (test files named: always one).
lanes_default=1
[ $# -eq 0 ] && [ "$(nproc 2>/dev/null || echo 1)" -ge 2 ] && lanes_default=2
lanes="$(printf '%s' "${OMNI_ACCUM_TEST_LANES:-$lanes_default}" | tr -d '[:space:]')"
case "$lanes" in
  1|2) ;;
  *) echo "test.sh: OMNI_ACCUM_TEST_LANES='${OMNI_ACCUM_TEST_LANES}' is not a number of lanes (1 or 2)" >&2; exit 2 ;;
esac
[ "$whole" = "1" ] || lanes=1

venv_028="${OMNI_ACCUM_VENV_028:-$ROOT/.venv-028}"
venv_016="${OMNI_ACCUM_VENV_016:-$ROOT/.venv-016}"
start=$(date +%s)
# Room for every environment this run will build, side by side on one file system as a rule (the sizes they
# leave on disk; see scripts/disk.sh): a run that cannot fit stops here with one line instead of failing in pip.
source "$ROOT/scripts/disk.sh"
venv_main="${OMNI_ACCUM_VENV:-$ROOT/.venv}"
e2e_venv="${OMNI_ACCUM_E2E_VENV:-$ROOT/benchmarks/e2e/.work/venv}"
builds=()
[ -x "$venv_main/bin/python" ] || builds+=("$venv_main" 7 "the 0.30.0 environment")
[ "$want_028" = "1" ] && [ ! -x "$venv_028/bin/python" ] && builds+=("$venv_028" 1.5 "the 0.28.0 environment")
[ "$want_016" = "1" ] && [ ! -x "$venv_016/bin/python" ] && builds+=("$venv_016" 1.5 "the 0.16.0 environment")
# The end-to-end test runs with CI=true or OMNI_ACCUM_E2E=1 and no extra arguments (see below); it needs the
# harness's virtualenv (~5.3 GB from .venv's packages) and its tiny model (~1.2 GB).
want_e2e=0
{ [ "$want_e2e_switch" = "1" ] || case "$(echo "${CI:-}" | tr '[:upper:]' '[:lower:]' | tr -d '[:space:]')" in 1|true|yes) true ;; *) false ;; esac; } && [ $# -eq 0 ] && want_e2e=1
[ "$want_e2e" = "1" ] && [ ! -x "$e2e_venv/bin/python" ] && builds+=("$e2e_venv" 6.5 "the end-to-end harness")
if [ ${#builds[@]} -gt 0 ] && ! omni_accum_need_disk "${builds[@]}"; then
  echo "[setup] nothing was built or run" >&2
  exit 1
fi
# .venv first: the other releases' environments start from its packages.
( source "$ROOT/scripts/env.sh" ) 2>&1 | tee "$logs/setup.log"
# The checkout's own modules compiled once (into __pycache__ folders, which git ignores): with PYTHONDONTWRITEBYTECODE
# set, as on this machine, each fresh interpreter the suite starts (stage processes, CLI runs, peers) compiled
# omni-accum's source again: 0.5 s of a core to import it, 0.2 s with these. An edited file is compiled again in
# memory, as Python does with any stale .pyc.
[ -x "$venv_main/bin/python" ] && "$venv_main/bin/python" -m compileall -q omni_accum strategies tests >/dev/null 2>&1
# Then those are built in the background while the 0.30.0 suite runs (pip waits on the network and the disk,
# the suite on the CPU); each run below waits for its environment and prints its set-up log.
_setup_bg() {  # venv, release, log (its exit status goes to LOG.rc: a lane in a subshell cannot `wait` for it)
  ( export OMNI_ACCUM_VENV="$1" OMNI_ACCUM_VLLM_VERSION="$2"; source "$ROOT/scripts/env.sh" ) >"$3" 2>&1
  echo $? >"$3.rc"
}
pid_028="" pid_016="" pid_e2e=""
[ "$want_028" = "1" ] && { _setup_bg "$venv_028" 0.28.0 "$logs/setup-028.log" & pid_028=$!; }
[ "$want_016" = "1" ] && { _setup_bg "$venv_016" 0.16.0 "$logs/setup-016.log" & pid_016=$!; }
# With the end-to-end test enabled (CI=true or OMNI_ACCUM_E2E=1) and no extra arguments, the harness's
# own virtualenv (~5.3 GB on disk, started from .venv's packages) is built in the background too, once the two builds
# above have ended: the three at once held pip's unpacked wheels on the disk together and filled a CI
# machine's disk. The test calls setup_env.sh again, which waits for this build and finds it up to date.
if [ "$want_e2e" = "1" ]; then
  ( for p in $pid_028 $pid_016; do while kill -0 "$p" 2>/dev/null; do sleep 5; done; done
    exec bash "$ROOT/benchmarks/e2e/setup_env.sh" ) >"$logs/setup-e2e.log" 2>&1 &
  pid_e2e=$!
fi
_pytest() {  # log, then pytest's arguments: one run in .venv, printed as it goes and kept in LOG
  local log="$1"
  shift
  ( source "$ROOT/scripts/env.sh" && python -m pytest "$@" ) 2>&1 | tee "$log"
  return "${PIPESTATUS[0]}"
}
_other_release() {  # set-up log, venv, release, log; then the test files
  local setup_log="$1" venv="$2" release="$3" log="$4"
  shift 4
  while [ ! -e "$setup_log.rc" ]; do sleep 5; done
  local rc_setup
  rc_setup="$(cat "$setup_log.rc")"
  cat "$setup_log"
  if [ "$rc_setup" != "0" ]; then
    echo "[setup] building $venv (vllm-omni $release) failed (exit status $rc_setup): see the lines above" | tee "$log"
    return 1
  fi
  # Tests marked `once` (omni-accum's own recovery from processes killed mid-stream: a minute each, the same code
  # whatever the release) run against the default release only.
  ( export OMNI_ACCUM_VENV="$venv" OMNI_ACCUM_VLLM_VERSION="$release"
    source "$ROOT/scripts/env.sh" && python -m pytest -m "not once" "$@" ) 2>&1 | tee "$log"
  return "${PIPESTATUS[0]}"
}
_releases() {  # the 0.28.0 and 0.16.0 runs, as asked; their exit statuses go to $logs/028.rc and $logs/016.rc
  if [ "$want_028" = "1" ]; then
    echo "== vllm-omni 0.28.0: the integration tests in $venv_028 =="
    _other_release "$logs/setup-028.log" "$venv_028" 0.28.0 "$logs/028.log" "${integration[@]}" "$@"
    echo $? >"$logs/028.rc"
  fi
  if [ "$want_016" = "1" ]; then
    echo "== vllm-omni 0.16.0: the integration tests that apply in $venv_016 =="
    _other_release "$logs/setup-016.log" "$venv_016" 0.16.0 "$logs/016.log" "${integration_016[@]}" "$@"
    echo $? >"$logs/016.rc"
  fi
}
_e2e_built() {  # wait for the end-to-end harness's background build, if there is one; say when it failed
  [ -n "$pid_e2e" ] || return 0
  wait "$pid_e2e" || { echo "[setup] the end-to-end harness's virtualenv (background build) failed:"; cat "$logs/setup-e2e.log"; }
}
# The whole suite on a machine of two cores or more runs in two lanes side by side (OMNI_ACCUM_TEST_LANES=1: one):
# most of its time is processes starting (a fresh interpreter importing vLLM takes ~25 s of one core), which leaves a
# core idle. scripts/test_lanes.py splits the test files by their times in tests/durations.txt: lane 1 runs its
# files, then the end-to-end test; lane 2 its files, then the 0.28.0 and 0.16.0 runs. Lane 1 is printed as it runs,
# lane 2 when it ends. Tests that look at shared places (/dev/shm) look at their own process's files only.
main_logs=("$logs/main.log")
if [ "$lanes" -ge 2 ]; then
  hold=()
  [ "$want_e2e" = "1" ] && hold=(--hold tests/test_e2e_server.py --reserve 1=@e2e)
  split="$(python3 "$ROOT/scripts/test_lanes.py" split 2 "$ROOT/tests/durations.txt" "${hold[@]}" \
    --reserve 2=@0.28.0 --reserve 2=@0.16.0 "${paths[@]}")" || exit 2
  read -r -a files_1 <<<"$(sed -n 1p <<<"$split")"
  read -r -a files_2 <<<"$(sed -n 2p <<<"$split")"
  echo "== lanes: lane 1 runs ${#files_1[@]} test files$([ "$want_e2e" = "1" ] && echo ", then the end-to-end test"); lane 2 ${#files_2[@]}, then the other releases (printed when it ends) =="
  ( _pytest "$logs/main-2.log" "${files_2[@]}" "$@"; echo $? >"$logs/main-2.rc"; _releases "$@" ) >"$logs/lane-2.out" 2>&1 &
  pid_lane2=$!
  _pytest "$logs/main.log" "${files_1[@]}" "$@"
  rc_main=$?
  if [ "$want_e2e" = "1" ]; then
    _e2e_built
    echo "== the end-to-end test (lane 1) =="
    _pytest "$logs/e2e.log" tests/test_e2e_server.py "$@" || rc_main=1
    main_logs+=("$logs/e2e.log")
  fi
  wait "$pid_lane2"
  echo "== lane 2: its share of the vllm-omni 0.30.0 suite, then the other releases =="
  cat "$logs/lane-2.out"
  [ "$(cat "$logs/main-2.rc" 2>/dev/null)" = "0" ] || rc_main=1
  main_logs+=("$logs/main-2.log")
else
  _pytest "$logs/main.log" "${paths[@]}" "$@"
  rc_main=$?
  _e2e_built
  _releases "$@"
fi
rc_028=0
[ "$want_028" = "1" ] && rc_028="$(cat "$logs/028.rc" 2>/dev/null || echo 1)"
rc_016=0
[ "$want_016" = "1" ] && rc_016="$(cat "$logs/016.rc" 2>/dev/null || echo 1)"
if [ "$want_028" = "1" ] || [ "$want_016" = "1" ] || [ ${#main_logs[@]} -gt 1 ]; then
  # One closing line for every run, in pytest's words (the per-run lines are above).
  runs=("${main_logs[@]}")
  [ "$want_028" = "1" ] && runs+=("$logs/028.log")
  [ "$want_016" = "1" ] && runs+=("$logs/016.log")
  python3 - "$(( $(date +%s) - start ))" "${runs[@]}" <<'EOF'
import re, sys
counts = {}
for path in sys.argv[2:]:
    lines = [l for l in open(path, errors="replace").read().splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
    if not lines:
        counts["error"] = counts.get("error", 0) + 1  # a run that ended without a summary
        continue
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", lines[-1]):
        what = "error" if what.startswith("error") else what
        counts[what] = counts.get(what, 0) + int(n)
order = ["failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "error"]
parts = [f"{counts[k]} {k + 's' if k == 'error' and counts[k] != 1 else k}" for k in order if counts.get(k)]
print(f"== all {len(sys.argv) - 2} runs together (vllm-omni 0.30.0: the suite; 0.28.0 / 0.16.0: the integration tests) ==")
print(f"{'=' * 20} {', '.join(parts) or 'no tests ran'} in {float(sys.argv[1]):.2f}s {'=' * 20}")
EOF
fi
[ "$rc_main" -eq 0 ] && [ "$rc_028" -eq 0 ] && [ "$rc_016" -eq 0 ]
