"""The 95 % intervals of a bench table, from every step sample (nothing thinned), each holding its point estimate.

* :func:`median_interval`: a distribution-free interval of a median, two order statistics of the samples around the
  middle (the binomial rule, normal approximation). It always holds the sample median, and costs a sort.
* :func:`ratio_interval`: a bootstrap of the ratio of two medians over the samples of both arms (seeded, so the
  same samples give the same interval), resampled with torch in batches; an arm of more than
  :data:`BOOTSTRAP_MAX` samples is bootstrapped from that many drawn at random (seeded, not every n-th: see below),
  so a table of millions of steps costs what one of ~10^4 does (the interval is then a little wider). The point
  ratio is the ratio of all the samples' own medians; an interval the resampling left beside it (a few
  pathological sample sets) is widened to it, so a printed ratio never lies outside its own interval.

* :func:`ratio_interval_rounds`: the same ratio with its interval over the rounds (repeats) both arms ran: a bench
  or a tune interleaves its arms round by round, and what moves a whole round (the machine's load, its caches, the
  arms' order in it) is noise the steps inside a round do not show. An interval over the pooled steps called two
  arms of one policy different in 37-54 % of runs (95 % intervals: 5 % expected); Student's t over the rounds'
  ratios did in 5 %. Fewer than two such rounds: the pooled interval (:func:`ratio_interval`).

Earlier, both were bootstrapped from every n-th pooled sample (at most 1000): samples are pooled in replay order,
request after request, so at concurrency 4 and every 2nd sample the interval saw requests 0 and 2 only, and a p50
of all four fell outside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: The fewest samples a median's interval is given for (:func:`median_interval`).
MEDIAN_MIN = 6
#: Bootstrap resamples of a ratio.
RESAMPLES = 200
#: The most samples of one arm a ratio's bootstrap resamples (a random draw of them beyond: ~0.05 s per arm).
BOOTSTRAP_MAX = 16384
#: Elements drawn per batch of resamples (bounds the memory of a bench with millions of steps).
_BATCH_ELEMENTS = 1 << 22


def median(xs: Sequence[float]) -> float:
    """The sample median (the mean of the two middle values for an even count), as ``statistics.median``."""
    s = sorted(xs)
    n = len(s)
    if not n:
        return float("nan")
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def median_interval(xs: Sequence[float], z: float = 1.96) -> tuple[float, float] | None:
    """``(low, high)``: the ``j``-th and ``k``-th smallest samples, ``j, k = n/2 -/+ z * sqrt(n) / 2`` (1-based,
    clipped to the samples), a 95 % interval of the median for independent samples; None under :data:`MEDIAN_MIN`
    samples (no two order statistics of fewer hold the median 95 % of the time: the smallest and largest of 5 do
    94 %, of 3 75 %).

    ``j <= n/2`` and ``k >= n/2 + 1`` (``n/2 + 1/2`` for odd ``n``), so the interval holds the sample median."""
    s = sorted(xs)
    n = len(s)
    if n < MEDIAN_MIN:
        return None
    half = z * math.sqrt(n) / 2
    j = max(1, math.floor(n / 2 - half))
    k = min(n, math.ceil(n / 2 + half))
    return s[j - 1], s[k - 1]


def _resampled_medians(x: torch.Tensor, resamples: int, gen: torch.Generator) -> torch.Tensor:
    n = x.numel()
    per = max(1, _BATCH_ELEMENTS // n)
    out = []
    for start in range(0, resamples, per):
        idx = torch.randint(0, n, (min(per, resamples - start), n), generator=gen)
        out.append(torch.quantile(x[idx], 0.5, dim=1) if n <= 1 << 24 else x[idx].median(dim=1).values)
    return torch.cat(out)


def _drawn(xs: Sequence[float], gen: torch.Generator) -> torch.Tensor:
    """``xs`` as a tensor, or :data:`BOOTSTRAP_MAX` of them drawn at random without replacement."""
    x = torch.tensor(xs, dtype=torch.float64)
    if x.numel() <= BOOTSTRAP_MAX:
        return x
    return x[torch.randperm(x.numel(), generator=gen)[:BOOTSTRAP_MAX]]


def ratio_interval(
    base: Sequence[float], other: Sequence[float], *, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float, float] | None:
    """``(ratio, low, high)``: ``median(other) / median(base)`` with a bootstrap 95 % interval over every sample of
    both (seeded; at most :data:`BOOTSTRAP_MAX` of each, drawn at random); None without samples or with a base median
    of 0 or less."""
    if not base or not other:
        return None
    mb = median(base)
    if not mb > 0:
        return None
    ratio = median(other) / mb
    gen = torch.Generator().manual_seed(seed)
    a = _resampled_medians(_drawn(base, gen), resamples, gen)
    b = _resampled_medians(_drawn(other, gen), resamples, gen)
    ratios = torch.where(a > 0, b / a.clamp_min(1e-300), torch.full_like(a, ratio)).sort().values.tolist()
    low = ratios[int(0.025 * (resamples - 1))]
    high = ratios[int(0.975 * (resamples - 1))]
    return ratio, min(low, ratio), max(high, ratio)


def ratio_interval_rounds(
    base: Sequence[Sequence[float]],
    other: Sequence[Sequence[float]],
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, float, float] | None:
    """``(ratio, low, high)``: ``median(other) / median(base)`` over every sample of both (pooled), with a 95 %
    interval over the rounds both arms ran: round ``i`` of one ran beside round ``i`` of the other, so each round
    gives one ratio of the two arms' medians, and the interval is Student's t over the logs of those ratios (paired
    rounds as the units: the drift between rounds and the steps' own noise both move a round's ratio; widened to
    hold the point ratio). Measured on the real bench with two arms of one policy, 100 runs each: it left out 1x in
    5 % of runs at 3 and at 5 rounds, where the pooled steps' bootstrap did in 37-54 % (a two-level bootstrap over
    rounds then steps: 7-15 %). ``base`` / ``other``: the samples of each round
    (:attr:`~omni_accum.bench.replay.ArmResult.samples_us`); rounds pair by index, up to the shorter list,
    skipping a round empty in either arm or with a median of 0 or less. Under two such rounds:
    :func:`ratio_interval` over the pooled samples (``resamples``, ``seed``), which leaves the drift out. None
    without samples or with a base median of 0 or less."""
    pooled_b = [x for rnd in base for x in rnd]
    pooled_o = [x for rnd in other for x in rnd]
    logs = []
    for b, o in zip(base, other):
        if len(b) and len(o):
            mb_, mo_ = median(b), median(o)
            if mb_ > 0 and mo_ > 0:
                logs.append(math.log(mo_ / mb_))
    if len(logs) < 2:
        return ratio_interval(pooled_b, pooled_o, resamples=resamples, seed=seed)
    mb = median(pooled_b)
    if not mb > 0:
        return None
    ratio = median(pooled_o) / mb
    k = len(logs)
    mean = math.fsum(logs) / k
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in logs) / (k - 1))
    half = t975(k - 1) * sd / math.sqrt(k)
    return ratio, min(math.exp(mean - half), ratio), max(math.exp(mean + half), ratio)


#: Student's t, 97.5 % quantile, for 1-30 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """Student's t 97.5 % quantile for ``df`` degrees of freedom (a table to 30; beyond, the Cornish-Fisher
    expansion around the normal's 1.96, within 1e-4 there)."""
    if df < 1:
        raise ValueError(f"degrees of freedom {df}: at least 1")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963984540054
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
