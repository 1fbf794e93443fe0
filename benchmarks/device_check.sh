#!/usr/bin/env bash
# omni-accum on a CUDA GPU, in one run of under 5 minutes (issue: tuner --device cuda).
#
#   bash benchmarks/device_check.sh --fetch-wheels   # here, with PyPI: fill .whl/ (pydantic + omni-accum wheels)
#   bash benchmarks/device_check.sh                  # on the GPU machine (torch, pluggy, PyYAML already there)
#
# It (1) tunes the qwen3-omni-seed workload with --device cuda --quick (CUDA-event timing, prealloc
# buffers on the device) and prints the decision table, and (2) times one decode step (merge + read of
# the newest row) for cat / token_list / prealloc at 1k, 8k and 32k rows of context on the GPU, as
# ratios to prealloc. Results go to $OUT (default /tmp/omni-accum-device). DEVICE=cpu does a dry run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/omni-accum-device}"
DEVICE="${DEVICE:-cuda}"
mkdir -p "$OUT"
# Never let the checkout's omni_accum/ (it lacks the strategies/config subpackages an install maps in)
# shadow the installed package: keep the current folder off sys.path.
export PYTHONSAFEPATH=1

if [ "${1:-}" = "--fetch-wheels" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  rm -rf .whl && mkdir -p .whl
  plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d .whl pydantic pydantic-core annotated-types typing-inspection
  PIP="${PIP:-python3 -m pip}"
  $PIP wheel -q --no-deps --no-build-isolation -w .whl .
  ls .whl
  exit 0
fi

if ! python3 -c "import pydantic, omni_accum.strategies" >/dev/null 2>&1; then
  [ -d .whl ] || { echo "pydantic or omni-accum missing and no .whl/ folder: run '$0 --fetch-wheels' first" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1

python3 - "$DEVICE" <<'PY'
import sys, torch
dev = sys.argv[1]
if dev == "cuda" and not torch.cuda.is_available():
    sys.exit("no CUDA device: torch.cuda.is_available() is False")
print("torch", torch.__version__, "device", torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", flush=True)
PY

echo "== 1. omni-accum tune --device $DEVICE --quick (qwen3-omni-seed)"
timeout 180 python3 -m omni_accum.cli tune --device "$DEVICE" --quick --workload qwen3-omni-seed --no-verify \
  --out "$OUT/tuned-$DEVICE.yaml" || echo "tune exited with $?"
[ -f "$OUT/tuned-$DEVICE.yaml" ] && python3 -m omni_accum.cli tune --show "$OUT/tuned-$DEVICE.yaml" | tail -n 20

echo "== 2. one decode step per strategy on $DEVICE (median of 40, ratio to prealloc)"
timeout 90 python3 - "$DEVICE" "$OUT" <<'PY'
import json, sys
from omni_accum.bench import strategy_arm
from omni_accum.bench.replay import measure
from omni_accum.bench.workloads import load_workload

dev, out = sys.argv[1], sys.argv[2]
wl = load_workload("qwen3-omni-seed").model_copy(update={"decode_steps": 40})
arms = {s: strategy_arm(wl, s) for s in ("cat", "token_list", "prealloc")}
rows = []
for cl in (1000, 8000, 32000):
    res = {r.arm: r for r in measure(wl, arms, context_len=cl, concurrency=1, repeats=1, device=dev)}
    base = res["prealloc"].step_us_p50
    for arm, r in res.items():
        rows.append({"context_len": cl, "arm": arm, "step_us_p50": round(r.step_us_p50, 2),
                     "ratio_to_prealloc": round(r.step_us_p50 / base, 2), "views": "ok" if r.correct else r.mismatch})
        print(f"context {cl:>6}  {arm:<10} p50 {r.step_us_p50:10.1f} us  x{r.step_us_p50 / base:8.1f} vs prealloc  "
              f"views {'ok' if r.correct else r.mismatch}", flush=True)
json.dump({"device": dev, "results": rows}, open(f"{out}/device_step.json", "w"), indent=1)
PY
echo "results in $OUT"
