"""The tuning loop: per bucket, time every applicable candidate per key against the baseline.

For each bucket (context length x concurrency) the workload's trace is replayed end to end
(encode, wire, merge, read as the workload reads) through one arm per candidate: the baseline
policy with one key switched to that candidate. Arms are interleaved round by round (rotated
order). After the first round a candidate is excluded when its views differ from the cat
reference or it raised (correctness gate) or its state for the key exceeds the memory budget
(default 2x the accumulated bytes, i.e. what ``cat`` holds). A key leaves the baseline only for
a win beyond the noise: the whole interval of its gain above 5 % (Student's t over the rounds' ratios, so the drift
between rounds counts: :func:`~omni_accum.tuner.stats.round_gain`; one round: a bootstrap over its steps) and its
low end saving at least ``min_gain_us`` per step; among candidates within 5 % of the fastest that pass those gates too, the one
holding the fewest bytes wins (then default params, then name), so noise does not flip winners. Every
kept baseline records why (:attr:`KeyDecision.reason`). A baseline that raises on a key (``cat`` of the
0-d ``meta.is_segment_finished`` flag vllm-omni 0.30.0 sends) is left like one whose views are wrong:
the fastest correct candidate wins. Clear decisions stop early; arms more than 2x slower than the best
are dropped. Round 0 of every key replays each arm once untimed first (cold, the first arm of a bucket faulted
fresh pages and read as a false win for the others).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from omni_accum.errors import OmniAccumError
from omni_accum.policy.loader import load_policy
from omni_accum.manager import get_manager
from omni_accum.policy.model import PROTOCOL_REPLACE_KEYS, Policy
from omni_accum.policy.tuned import TunedCell
from omni_accum.bench.replay import UPSTREAM, WIRE_FLOOR, ArmResult, measure
from omni_accum.tuner.candidates import Candidate, candidates_for, same_choice
from omni_accum.tuner.stats import MIN_GAIN, MIN_GAIN_US, Gain, bootstrap_gain, median, round_gain
from omni_accum.bench.streams import _carries, chunk_plans
from omni_accum.bench.workloads import Workload

BASE = "baseline"
#: A win this large after one round is decided without more rounds.
CLEAR_WIN = 0.5
#: Rounds of the verification (:func:`verify_bucket`), one in each order of the two arms.
VERIFY_ROUNDS = 2


class TuneError(OmniAccumError):
    """The tuner cannot run as asked (bad option, nothing to tune, missing device)."""


def with_rule(base: Policy, key: str, cand: Candidate) -> Policy:
    """``base`` with ``key`` switched to ``cand`` by an exact rule in front."""
    data = base.model_dump(mode="json", exclude={"tuned"})
    data["rules"] = [{"match": key, "strategy": cand.strategy, "params": dict(cand.params)}] + [
        r for r in data["rules"] if r["match"] != key
    ]
    data["description"] = f"{key} -> {cand.label}"
    return load_policy(data)


def tunable_keys(wl: Workload, base: Policy, context_lens: list[int]) -> tuple[list[str], dict[str, str]]:
    """Keys worth tuning, and the reason each other key is not tuned."""
    keys: list[str] = []
    skipped: dict[str, str] = {}
    for spec in wl.keys:
        hit = base.match_rule(spec.path)
        if hit is not None:
            skipped[spec.path] = f"decided by the baseline's rules[{hit[0]}] (explicit rules beat the table)"
            continue
        if spec.path in PROTOCOL_REPLACE_KEYS:
            skipped[spec.path] = "a protocol key: always replace (vllm-omni's rule), which beats the table"
            continue
        carried = max(sum(1 for p in chunk_plans(wl, cl) if _carries(spec, p)) for cl in context_lens)
        if carried <= 1:
            skipped[spec.path] = "carried in one chunk only: nothing accumulates, every strategy is the same"
            continue
        keys.append(spec.path)
    return keys, skipped


@dataclass
class KeyDecision:
    """What the tuner decided for one key in one bucket (becomes a :class:`TunedCell`)."""

    key: str
    winner: Candidate
    baseline: str
    margin: float | None
    ci: tuple[float, float] | None
    timings_us: dict[str, float]
    excluded: dict[str, str]
    peak_bytes: dict[str, int]
    reason: str | None = None
    """Why the baseline was kept, or why it was left without a win; None for a win."""


@dataclass
class BucketOutcome:
    context_len: int
    concurrency: int
    decisions: dict[str, KeyDecision] = field(default_factory=dict)
    rounds: int = 0
    seconds: float = 0.0
    reused: bool = False
    verify: dict[str, float] | None = None

    def cells(self) -> list[TunedCell]:
        return [
            TunedCell(
                key=d.key,
                context_len=self.context_len,
                concurrency=self.concurrency,
                strategy=d.winner.strategy,
                params=d.winner.params,
                baseline=d.baseline,
                margin=None if d.margin is None else round(d.margin, 4),
                ci=None if d.ci is None else (round(d.ci[0], 4), round(d.ci[1], 4)),
                timings_us={k: round(v, 2) for k, v in d.timings_us.items()},
                excluded=d.excluded,
                peak_bytes=d.peak_bytes,
                reason=d.reason,
            )
            for d in self.decisions.values()
        ]


def tune_bucket(
    wl: Workload,
    base: Policy,
    keys: list[str],
    cands: dict[str, list[Candidate]],
    *,
    context_len: int,
    concurrency: int,
    wire: str,
    max_rounds: int,
    memory_factor: float,
    device: str = "cpu",
    min_gain_us: float = MIN_GAIN_US,
    progress: Callable[[int], None] | None = None,
) -> BucketOutcome:
    """Measure and decide every key of one bucket.

    Each key is timed on the workload's trace reduced to that key (the other keys' cost is the
    same in every arm and would only add time and noise): encode, wire, merge and the key's read.
    """
    t0 = time.monotonic()
    out = BucketOutcome(context_len, concurrency)
    for k in keys:
        wl_k = wl.model_copy(update={"keys": [wl.key(k)]})
        out.decisions[k], rounds = _tune_key(
            wl_k,
            base,
            k,
            cands[k],
            context_len=context_len,
            concurrency=concurrency,
            wire=wire,
            max_rounds=max_rounds,
            memory_factor=memory_factor,
            device=device,
            min_gain_us=min_gain_us,
            progress=progress,
        )
        out.rounds = max(out.rounds, rounds)
    out.seconds = time.monotonic() - t0
    return out


def _tune_key(
    wl: Workload,
    base: Policy,
    key: str,
    cands: list[Candidate],
    *,
    context_len: int,
    concurrency: int,
    wire: str,
    max_rounds: int,
    memory_factor: float,
    device: str,
    progress: Callable[[int], None] | None,
    min_gain_us: float = MIN_GAIN_US,
) -> tuple[KeyDecision, int]:
    choice = base.resolve(key)
    base_label = Candidate(choice.strategy, dict(choice.params)).label
    arms: dict[str, Policy] = {BASE: base}
    owner: dict[str, Candidate] = {}
    for cand in cands:
        if not same_choice(cand.strategy, cand.params, base_label):  # the baseline arm times that one
            arms[cand.label] = with_rule(base, key, cand)
            owner[cand.label] = cand
    samples: dict[str, list[float]] = {lab: [] for lab in arms}
    rounds_of: dict[str, list[list[float]]] = {lab: [] for lab in arms}  # the gains' intervals pair the rounds
    excluded: dict[str, str] = {}
    peak: dict[str, int] = {}
    active = list(arms)
    rounds = 0
    base_wrong: str | None = None
    for rnd in range(max_rounds):
        k = (rnd + 1) % len(active)  # rotated, starting one arm in: the baseline is not first in round 0 either
        order = active[k:] + active[:k]
        results: list[ArmResult] = measure(
            wl,
            {lab: arms[lab] for lab in order},
            context_len=context_len,
            concurrency=concurrency,
            wire=wire,
            repeats=1,
            check=rnd == 0,
            per_key=rnd == 0,
            length_hints=False,
            device=device,
            progress=progress,
            # round 0 is timed warm: cold, the first arm of a bucket (the baseline) faults fresh pages (a null
            # test read +94 % for an arm identical to it, and the clear-win stop below ended the key there)
            warmup=rnd == 0,
        )
        rounds = rnd + 1
        for r in results:
            if r.arm == BASE and r.error is not None:
                # e.g. cat of a 0-d flag (meta.is_segment_finished): the baseline cannot be kept; no timing
                base_wrong = f"raised {_short(r.error)}"
                continue
            if r.arm == BASE and not r.correct:
                # e.g. upstream concatenating a static tensor that is re-sent: timed as the reference,
                # but it cannot be kept; the fastest correct candidate wins.
                base_wrong = f"views differ from the workload's declared semantics: {r.mismatch}"
            elif r.error is not None or not r.correct:
                excluded[r.arm] = (
                    f"views differ from the cat reference: {r.mismatch}" if r.error is None else f"raised {r.error}"
                )
                continue
            samples[r.arm] += r.pooled()
            rounds_of[r.arm].append(r.pooled())
            if rnd == 0:
                peak[base_label if r.arm == BASE else r.arm] = r.per_key[key].peak_bytes if key in r.per_key else 0
        if rnd == 0:
            budget = memory_factor * peak.get(base_label, 0)
            for lab in owner:
                if lab not in excluded and budget > 0 and peak.get(lab, 0) > budget:
                    excluded[lab] = (
                        f"holds {peak[lab]} bytes, over the memory budget {int(budget)} "
                        f"({memory_factor:g}x the accumulated bytes)"
                    )
        mine = [lab for lab in owner if lab not in excluded and samples[lab]]
        if not mine:
            break
        if not samples[BASE]:
            break  # the baseline raised: the fastest correct candidate wins after one round
        best = min(mine, key=lambda lab: median(samples[lab]))
        g = round_gain(rounds_of[BASE], rounds_of[best])
        # a clear win stops after one round; "no win" only from two rounds on (one round's pooled-step bootstrap
        # called an arm identical to the baseline slower beyond the noise in 10-20 % of runs)
        if g.low > CLEAR_WIN or (rnd >= 1 and g.high < MIN_GAIN and base_wrong is None):
            break
        cut = 2.0 * median(samples[best])  # successive halving: arms that cannot win leave
        active = [lab for lab in active if lab == BASE or (lab in mine and median(samples[lab]) <= cut)]
    decision = _decide(key, base_label, choice, owner, samples, excluded, peak, base_wrong, min_gain_us, rounds_of)
    return decision, rounds


def _decide(
    key, base_label, base_choice, owner, samples, excluded, peak, base_wrong=None, min_gain_us=MIN_GAIN_US,
    rounds_of=None,
) -> KeyDecision:
    """The winner: leave the baseline only for a win beyond the noise (the whole interval above 5 %, and its low
    end saving at least ``min_gain_us`` per step) or when the baseline's views are wrong or it raised. Among
    candidates the fastest is not significantly faster than (or within 5 % of it), the one holding the fewest
    bytes, then default params; the candidate picked must itself pass every gate against the baseline. A kept
    baseline says why (``reason``). ``rounds_of``: each arm's samples per round, which the intervals pair
    (:func:`~omni_accum.tuner.stats.round_gain`); None: each arm's ``samples`` as one round."""
    rounds_of = rounds_of or {lab: [xs] for lab, xs in samples.items()}

    def gain(base: str, other: str) -> Gain:
        return round_gain(rounds_of[base], rounds_of[other])

    mine = [lab for lab in owner if lab not in excluded and samples[lab]]
    timings = {base_label: median(samples[BASE])} if samples[BASE] else {}
    timings.update({lab: median(samples[lab]) for lab in mine})
    excl = {lab: why for lab, why in excluded.items()}
    if base_wrong is not None:
        excl[base_label] = f"baseline kept out: {base_wrong}"
    base_cand = Candidate(base_choice.strategy, dict(base_choice.params))
    if not mine:
        why = "no candidate to time" if not owner else f"every candidate was excluded ({len(excluded)}: see excluded)"
        if base_wrong is not None:
            why += f"; kept although the baseline {base_wrong}"
        return KeyDecision(key, base_cand, base_label, None, None, timings, excl, peak, why)
    if not samples[BASE]:  # the baseline raised: the fastest correct candidate, the leanest among equals
        best = min(mine, key=lambda lab: timings[lab])
        limit = timings[best] * (1.0 + MIN_GAIN)
        order = {lab: i for i, lab in enumerate(mine)}
        pick = min(
            (lab for lab in mine if timings[lab] <= limit),
            key=lambda lab: (peak.get(lab, 0), bool(owner[lab].params), order[lab]),
        )
        why = f"baseline left: it {base_wrong}"
        return KeyDecision(key, owner[pick], base_label, None, None, timings, excl, peak, why)
    gains: dict[str, Gain] = {}

    def gate(lab: str) -> str | None:
        """None when ``lab`` beats the baseline beyond the noise; else why not."""
        if lab not in gains:
            gains[lab] = gain(BASE, lab)
        return keep_reason(gains[lab], timings[base_label], min_gain_us)

    best = min(mine, key=lambda lab: timings[lab])
    why = gate(best)
    if why is not None and base_wrong is None:
        g = gains[best]
        return KeyDecision(key, base_cand, base_label, g.gain, (g.low, g.high), timings, excl, peak, f"{best}: {why}")
    limit = timings[best] * (1.0 + MIN_GAIN)
    equivalent = [
        lab
        for lab in mine
        # among candidates a tighter test is the safe side (it keeps the faster one): the pooled steps' bootstrap,
        # not the rounds' t, which at 2 rounds (--quick, or an arm halving dropped) holds a 2x slower arm level
        if (timings[lab] <= limit or bootstrap_gain(samples[lab], samples[best], resamples=200).low <= 0.0)
        and (base_wrong is not None or gate(lab) is None)
    ]
    order = {lab: i for i, lab in enumerate(mine)}
    pick = min(equivalent, key=lambda lab: (peak.get(lab, 0), bool(owner[lab].params), order[lab]))
    gp = gains[pick] if pick in gains else gain(BASE, pick)
    why = None if base_wrong is None else f"baseline left: its {base_wrong}"
    return KeyDecision(key, owner[pick], base_label, gp.gain, (gp.low, gp.high), timings, excl, peak, why)


def _short(error: str, limit: int = 160) -> str:
    """An arm's error for a reason line: up to its first parenthesised detail, at most ``limit`` characters."""
    head = error.split(" (expected", 1)[0]
    return head if len(head) <= limit else head[: limit - 3] + "..."


def keep_reason(g: Gain, base_us: float, min_gain_us: float) -> str | None:
    """Why a candidate with gain ``g`` over a baseline step of ``base_us`` does not leave the baseline (None: it
    does). It must win beyond the noise: the whole interval above :data:`MIN_GAIN`, and the interval's low end
    saving at least ``min_gain_us`` per step."""
    pct = f"{100 * g.gain:+.1f}% [{100 * g.low:+.1f}%, {100 * g.high:+.1f}%]"
    if g.high < 0.0:  # the whole interval below 0: it did not cross it
        return f"{pct}: slower than the baseline beyond the noise"
    if g.low <= 0.0:
        return f"{pct}: the interval crosses 0 (no win beyond the noise)"
    if g.low <= MIN_GAIN:
        return f"{pct}: the interval reaches below +{100 * MIN_GAIN:g}% (within the noise)"
    if base_us * g.low < min_gain_us:
        return f"{pct}: saves under --min-gain-us {min_gain_us:g} us per step (at least {base_us * g.low:.2f} us)"
    return None


def verify_bucket(
    wl: Workload,
    tuned: Policy,
    baseline: Policy | str,
    *,
    context_len: int,
    concurrency: int,
    wire: str,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Two interleaved rounds of the tuned policy against ``baseline`` (upstream when available), the reference
    first in one and the tuned policy first in the other; the gain's interval is the tuner's own over the rounds
    (:func:`~omni_accum.tuner.stats.round_gain`: Student's t over the two rounds' ratios of medians).

    Where upstream's ``_accumulate_payload`` raises on the workload (vllm-omni 0.30.0's thinker -> talker
    stream: ``torch.cat`` of the 0-d ``meta.is_segment_finished``), the reference is what 0.30.0's receiving
    adapter does with that stream instead: it hands each chunk over as it came (the wire-floor arm);
    ``reference`` in the result says which."""

    def once(reference: Policy | str) -> list[ArmResult]:
        return measure(
            wl,
            {"reference": reference, "tuned": tuned},
            context_len=context_len,
            concurrency=concurrency,
            wire=wire,
            repeats=VERIFY_ROUNDS,  # measure rotates the order: reference first, then tuned first
            check=False,
            length_hints=False,
            device=device,
            progress=progress,
            warmup=True,
        )

    ref, new = once(baseline)
    used = "upstream" if baseline == UPSTREAM else "default"
    if ref.error and baseline == UPSTREAM and not new.error:
        ref, new = once(WIRE_FLOOR)
        used = WIRE_FLOOR
    if new.error or ref.error:
        return {}
    g = round_gain(ref.samples_us, new.samples_us)
    return {
        "reference": used,
        "reference_p50_us": round(ref.step_us_p50, 2),
        "tuned_p50_us": round(new.step_us_p50, 2),
        "reference_total_us": round(median(ref.total_us_per_request), 1),
        "tuned_total_us": round(median(new.total_us_per_request), 1),
        "gain": round(g.gain, 4),
        "gain_low": round(g.low, 4),
        "gain_high": round(g.high, 4),
    }


def reference_arm() -> Policy | str:
    """``upstream`` (vllm-omni 0.30.0's own code) when importable, else the ``default`` preset."""
    from omni_accum.bench.arms import upstream_available

    return UPSTREAM if upstream_available() else load_policy("default")


def all_candidates(wl: Workload, keys: list[str], *, grid: bool = True) -> dict[str, list[Candidate]]:
    mgr = get_manager()
    return {k: candidates_for(wl.key(k).kind, mgr, grid=grid) for k in keys}
