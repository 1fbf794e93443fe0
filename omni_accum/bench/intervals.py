"""The 95 % intervals of a bench table, from every step sample (nothing thinned), each holding its point estimate.

* :func:`median_interval`: a distribution-free interval of a median, two order statistics of the samples around the
  middle (the binomial rule, normal approximation). It always holds the sample median, and costs a sort.
* :func:`ratio_interval`: a bootstrap of the ratio of two medians over the samples of both arms (seeded, so the
  same samples give the same interval), resampled with torch in batches; an arm of more than
  :data:`BOOTSTRAP_MAX` samples is bootstrapped from that many drawn at random (seeded, not every n-th: see below),
  so a table of millions of steps costs what one of ~10^4 does (the interval is then a little wider). The point
  ratio is the ratio of all the samples' own medians; an interval the resampling left beside it (a few
  pathological sample sets) is widened to it, so a printed ratio never lies outside its own interval.

* :func:`ratio_interval_rounds`: the same ratio with its interval from a paired two-level bootstrap over the rounds
  (repeats) both arms ran, then over the steps inside each round drawn: a bench or a tune interleaves its arms round
  by round, and what moves a whole round (the machine's load, its caches, its clock) is noise the steps inside a
  round do not show. An interval over the pooled steps called two arms of one policy different in 15-63 % of
  runs (95 % intervals: 5 % expected); over the rounds it counts that drift. Fewer than two such rounds: the pooled
  interval (:func:`ratio_interval`).

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
    interval from a paired two-level bootstrap: each resample draws, with replacement, as many rounds as the arms
    share (the same rounds for both arms: round ``i`` of one ran beside round ``i`` of the other), then the steps of
    each drawn round with replacement, and takes the ratio of the two pooled medians. ``base`` / ``other``: the
    samples of each round (:attr:`~omni_accum.bench.replay.ArmResult.samples_us`); rounds pair by index, up to
    the shorter list, skipping a round empty in either arm. Under two such rounds: :func:`ratio_interval` over the
    pooled samples. Seeded; at most :data:`BOOTSTRAP_MAX` samples of an arm (drawn at random, evenly over its
    rounds); the interval is widened to hold the point ratio. None without samples or with a base median of 0."""
    pairs = [(b, o) for b, o in zip(base, other) if len(b) and len(o)]
    pooled_b = [x for rnd in base for x in rnd]
    pooled_o = [x for rnd in other for x in rnd]
    if len(pairs) < 2:
        return ratio_interval(pooled_b, pooled_o, resamples=resamples, seed=seed)
    if not pooled_b or not pooled_o:
        return None
    mb = median(pooled_b)
    if not mb > 0:
        return None
    ratio = median(pooled_o) / mb
    gen = torch.Generator().manual_seed(seed)
    k = len(pairs)
    per = max(1, BOOTSTRAP_MAX // k)
    rb = [_drawn_n(b, per, gen) for b, _ in pairs]
    ro = [_drawn_n(o, per, gen) for _, o in pairs]
    chosen = torch.randint(0, k, (resamples, k), generator=gen)  # the same rounds for both arms
    a = _two_level_medians(rb, chosen, gen)
    b = _two_level_medians(ro, chosen, gen)
    ratios = torch.where(a > 0, b / a.clamp_min(1e-300), torch.full_like(a, ratio)).sort().values.tolist()
    low = ratios[int(0.025 * (resamples - 1))]
    high = ratios[int(0.975 * (resamples - 1))]
    return ratio, min(low, ratio), max(high, ratio)


def _drawn_n(xs: Sequence[float], n: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.tensor(list(xs), dtype=torch.float64)
    return x if x.numel() <= n else x[torch.randperm(x.numel(), generator=gen)[:n]]


def _two_level_medians(rounds: list[torch.Tensor], chosen: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The median of each two-level resample: row ``b`` of ``chosen`` names the rounds drawn, and each drawn round's
    steps are drawn with replacement (batched; rounds of one length at once, as a bench's and a tune's are)."""
    resamples, k = chosen.shape
    if len({r.numel() for r in rounds}) == 1:
        m = torch.stack(rounds)  # [rounds, steps]
        n = m.shape[1]
        per = max(1, _BATCH_ELEMENTS // (k * n))
        out = []
        for start in range(0, resamples, per):
            rows = chosen[start : start + per]
            steps = torch.randint(0, n, (rows.shape[0], k, n), generator=gen)
            vals = m[rows.unsqueeze(-1).expand(-1, -1, n), steps].reshape(rows.shape[0], -1)
            out.append(torch.quantile(vals, 0.5, dim=1) if vals.shape[1] <= 1 << 24 else vals.median(dim=1).values)
        return torch.cat(out)
    offsets, at = [], 0
    for r in rounds:
        offsets.append(at)
        at += r.numel()
    cat = torch.cat(rounds)
    meds = []
    for row in chosen.tolist():
        idx = torch.cat([offsets[i] + torch.randint(0, rounds[i].numel(), (rounds[i].numel(),), generator=gen)
                         for i in row])  # fmt: skip
        meds.append(float(torch.quantile(cat[idx], 0.5)) if idx.numel() <= 1 << 24 else float(cat[idx].median()))
    return torch.tensor(meds, dtype=torch.float64)
