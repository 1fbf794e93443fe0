"""Statistics of the tuner: medians, bootstrap confidence intervals, the decision rule."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

#: Leave the baseline only for a win whose whole interval lies above this (relative; ``core.keep_reason``).
MIN_GAIN = 0.05
#: ... and larger than this many microseconds per step: a 0.4 us win on a 5 us step is real but not
#: worth a switch, and such cells flip between runs.
MIN_GAIN_US = 1.0


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        raise ValueError("median of no samples")
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


@dataclass(frozen=True)
class Gain:
    """Relative gain of a candidate over the baseline: ``1 - median(candidate) / median(baseline)``.

    Attributes:
        gain: point estimate (0.25 = 25 % faster; negative = slower).
        low: lower end of the bootstrap confidence interval.
        high: upper end.
    """

    gain: float
    low: float
    high: float


def bootstrap_gain(
    baseline: Sequence[float],
    candidate: Sequence[float],
    *,
    resamples: int = 400,
    confidence: float = 0.95,
    seed: int = 0,
) -> Gain:
    """Bootstrap the relative gain of medians (percentile interval, deterministic seed)."""
    if not baseline or not candidate:
        raise ValueError("bootstrap needs samples on both arms")
    point = 1.0 - median(candidate) / median(baseline)
    rng = random.Random(seed)
    nb, nc = len(baseline), len(candidate)
    gains = []
    for _ in range(resamples):
        b = median([baseline[rng.randrange(nb)] for _ in range(nb)])
        c = median([candidate[rng.randrange(nc)] for _ in range(nc)])
        gains.append(1.0 - c / b if b > 0 else 0.0)
    gains.sort()
    alpha = (1.0 - confidence) / 2.0
    lo = gains[int(alpha * (resamples - 1))]
    hi = gains[int((1.0 - alpha) * (resamples - 1))]
    return Gain(point, lo, hi)


def round_gain(baseline: Sequence[Sequence[float]], candidate: Sequence[Sequence[float]], *, seed: int = 0) -> Gain:
    """The relative gain of medians with its interval over the rounds both arms ran (Student's t over the rounds'
    ratios, :func:`omni_accum.bench.intervals.ratio_interval_rounds`): a round's drift (the machine's load between
    rounds, the arms' order in it) counts as noise, which an interval over the pooled steps left out. Under two
    rounds both ran: :func:`bootstrap_gain` over the pooled steps."""
    from omni_accum.bench.intervals import ratio_interval_rounds

    paired = sum(1 for b, c in zip(baseline, candidate) if len(b) and len(c))
    q = ratio_interval_rounds(baseline, candidate, seed=seed) if paired >= 2 else None
    if q is None:  # under two rounds, or no baseline median above 0: the pooled steps' bootstrap
        return bootstrap_gain([x for r in baseline for x in r], [x for r in candidate for x in r], seed=seed)
    ratio, low, high = q
    return Gain(1.0 - ratio, 1.0 - high, 1.0 - low)
