"""Tuner budget and quality check (not a test: run by hand, figures go in the release note).

    python benchmarks/tune_quality.py [--quick-only]

1. Times `omni-accum tune --quick` and the default grid on qwen3-omni-seed (targets: 20 s, 120 s).
2. Runs the default grid a second time and reports how often the two runs agree on the winner
   among cells whose margin exceeds 10 % (target: >= 90 %).
3. Replays every bucket with the tuned policy against the `default` preset, arms interleaved, and
   reports the p50 ratio per bucket (target: never slower than default by more than noise).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from omni_accum.policy.loader import load_policy
from omni_accum.bench.replay import measure
from omni_accum.tuner import TuneOptions, tune
from omni_accum.tuner.stats import bootstrap_gain
from omni_accum.bench.workloads import load_workload


def run(quick: bool, out: Path) -> tuple[float, object]:
    t0 = time.monotonic()
    res = tune(TuneOptions(workload="qwen3-omni-seed", out=out, quick=quick, verify=not quick))
    return time.monotonic() - t0, res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    t_quick, _ = run(True, tmp / "quick.yaml")
    print(f"tune --quick: {t_quick:.1f} s (target <= 20 s)", flush=True)
    if args.quick_only:
        return 0
    t_a, a = run(False, tmp / "a.yaml")
    print(f"tune (default grid): {t_a:.1f} s (target <= 120 s)", flush=True)
    _, b = run(False, tmp / "b.yaml")
    cells_a = {(c.key, c.context_len, c.concurrency): c for c in a.policy.tuned.cells}
    cells_b = {(c.key, c.context_len, c.concurrency): c for c in b.policy.tuned.cells}
    big = [k for k, c in cells_a.items() if (c.margin or 0) > 0.10 or (cells_b[k].margin or 0) > 0.10]
    agree = [k for k in big if (cells_a[k].strategy, cells_a[k].params) == (cells_b[k].strategy, cells_b[k].params)]
    print(
        f"winner agreement on cells with margin > 10 %: {len(agree)}/{len(big)} = "
        f"{100 * len(agree) / max(1, len(big)):.0f} %"
    )
    for k in sorted(set(big) - set(agree)):
        print(
            f"  differs: {k}: {cells_a[k].strategy}{cells_a[k].params or ''} vs "
            f"{cells_b[k].strategy}{cells_b[k].params or ''}"
        )
    wl = load_workload("qwen3-omni-seed")
    default = load_policy("default")
    tuned = a.policy
    print("tuned vs default preset per bucket (one interleaved run, 3 rounds, step p50):")
    worst = 0.0
    for cl in tuned.tuned.context_len_edges:
        for c in tuned.tuned.concurrency_edges:
            wl_b = wl.model_copy(update={"decode_steps": max(8, -(-24 // c))})
            res = measure(
                wl_b,
                {"default": default, "tuned": tuned},
                context_len=cl,
                concurrency=c,
                repeats=3,
                check=False,
                length_hints=False,
            )
            d, t = res
            g = bootstrap_gain(d.pooled(), t.pooled())
            worst = min(worst, g.high)
            print(
                f"  context {cl:>6} conc {c:>3}: default {d.step_us_p50:10.1f} us  tuned {t.step_us_p50:8.1f} us  "
                f"ratio {t.step_us_p50 / d.step_us_p50:.4f}  "
                f"gain {100 * g.gain:+.1f}% [{100 * g.low:+.1f}, {100 * g.high:+.1f}]"
            )
    print(
        "tuned slower than default beyond noise in some bucket"
        if worst < 0
        else "tuned never slower than default beyond noise"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
