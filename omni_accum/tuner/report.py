"""Human-readable tables of a tuned policy: decisions with margins, and the gain over upstream."""

from __future__ import annotations

from omni_accum.policy.environment import table_mismatches
from omni_accum.policy.model import PROTOCOL_REPLACE_KEYS, Policy
from omni_accum.policy.tuned import TunedTable
from omni_accum.tuner.candidates import same_choice
from omni_accum.tuner.core import VERIFY_ROUNDS, WIRE_FLOOR, BucketOutcome


def _us(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1000:.2f} ms" if x >= 1000 else f"{x:.1f} us"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*r) for r in rows]
    return "\n".join(out)


def decision_table(table: TunedTable) -> str:
    """One row per bucket and key: winner, margin over the baseline with its interval, timings."""
    rows = []
    for c in sorted(table.cells, key=lambda c: (c.context_len, c.concurrency, c.key)):
        label = c.strategy + (f" {c.params}" if c.params else "")
        base_t = c.timings_us.get(c.baseline)
        win_label = c.strategy if not c.params else None
        win_t = min(c.timings_us.values()) if win_label is None else c.timings_us.get(c.strategy)
        if c.params:
            inner = ",".join(f"{k}={v}" for k, v in sorted(c.params.items()))
            win_t = c.timings_us.get(f"{c.strategy}{{{inner}}}", win_t)
        kept = same_choice(c.strategy, c.params, c.baseline)
        changed = "" if kept else " *"
        ci = "-" if c.ci is None or kept else f"[{_pct(c.ci[0])}, {_pct(c.ci[1])}]"
        rows.append(
            [
                f">={c.context_len}",
                f">={c.concurrency}",
                c.key,
                label + changed,
                "-" if kept else _pct(c.margin),  # a kept baseline has no margin: its best challenger's is under why
                ci,
                _us(base_t),
                _us(base_t if kept else win_t),
                str(len(c.timings_us)),
                str(len(c.excluded)),
            ]
        )
    head = ["context", "conc", "key", "strategy", "margin", "95% CI", "baseline", "winner", "timed", "excluded"]
    out = _table(rows, head) + (
        "\n(* = leaves the baseline; margin = step-time gain of the strategy over the baseline, '-' where the baseline "
        "is kept: its best challenger is under why)"
    )
    why = reasons(table)
    return out + ("\n\nwhy:\n" + "\n".join(why) if why else "")


def reasons(table: TunedTable) -> list[str]:
    """One line per cell that keeps its baseline (or left it without a win): why."""
    lines = []
    for c in sorted(table.cells, key=lambda c: (c.context_len, c.concurrency, c.key)):
        kept = same_choice(c.strategy, c.params, c.baseline)
        if c.reason is None and not kept:
            continue
        why = c.reason or "no reason recorded (a table from an older omni-accum)"
        what = "kept the baseline" if kept else f"left the baseline for {c.strategy}"
        lines.append(f"  >={c.context_len} x >={c.concurrency} {c.key}: {what}: {why}")
    return lines


def show(policy: Policy, source: str = "") -> str:
    """What ``omni-accum tune --show`` prints."""
    t = policy.tuned
    if t is None:
        return f"{source}: no tuned table (it is a plain policy; `omni-accum show` prints it)"
    lines = [
        f"{source}: tuned on workload {t.workload!r}, wire {t.wire!r}"
        + ("" if t.complete else " — PARTIAL: some buckets were not measured (tune --resume finishes it)"),
        f"buckets: context_len edges {t.context_len_edges} x concurrency edges {t.concurrency_edges} "
        "(floor: a value uses the largest edge <= it; values outside the edges clamp to the end buckets)",
    ]
    diffs = table_mismatches(t)
    lines.append(
        "fingerprint: matches this environment"
        if not diffs
        else "fingerprint: DOES NOT match this environment, the table would be ignored here: " + "; ".join(diffs)
    )
    for k, why in t.skipped.items():
        lines.append(f"not tuned: {k}: {why}")
    lines.append("")
    lines.append(decision_table(t))
    shadowed = {c.key: _decided_before(policy, c.key) for c in t.cells}
    for key, why in shadowed.items():
        if why:
            lines.append(f"never applies: {key}: decided by {why}, before the table")
    excluded = [(c, lab, why) for c in t.cells for lab, why in c.excluded.items()]
    if excluded:
        lines.append("")
        lines.append("excluded candidates:")
        for c, lab, why in excluded:
            lines.append(f"  context>={c.context_len} conc>={c.concurrency} {c.key} {lab}: {why}")
    return "\n".join(lines)


def _decided_before(policy: Policy, key: str) -> str | None:
    """What decides ``key`` ahead of the tuned table (an explicit rule, a protocol key), else None."""
    hit = policy.match_rule(key)
    if hit is not None:
        return f"rules[{hit[0]}] (match {policy.rules[hit[0]].match!r})"
    return "the protocol (vllm-omni always replaces it)" if key in PROTOCOL_REPLACE_KEYS else None


def _keeps_baseline(o: BucketOutcome) -> bool:
    """Every key of the bucket kept the baseline's strategy: the tuned policy runs there as the baseline does."""
    return all(same_choice(d.winner.strategy, d.winner.params, d.baseline) for d in o.decisions.values())


def gain_table(outcomes: list[BucketOutcome], reference: str, base: str = "default") -> str:
    """Per bucket: the reference's and the tuned policy's step p50 and per-request total, and the gain.

    ``reference`` names the arm the tuned policy was timed against (``upstream`` or ``default``); where upstream's
    code raised on the stream the round used ``wire-floor`` instead, and the columns say so. ``base`` is the
    baseline policy (``--base``): when every cell kept it, the file runs as it does, whatever the round measured.
    """
    refs = {(o.verify or {}).get("reference") for o in outcomes if o.verify}
    floor = refs == {WIRE_FLOOR}
    ref = WIRE_FLOOR if floor else reference if len(refs) <= 1 else "reference"
    rows = []
    for o in outcomes:
        v = o.verify or {}
        if not v:
            rows.append([str(o.context_len), str(o.concurrency), "-", "-", "-", "-", "reused" if o.reused else "-"])
            continue
        ratio = v["tuned_total_us"] / v["reference_total_us"] if v.get("reference_total_us") else float("nan")
        rows.append(
            [
                str(o.context_len),
                str(o.concurrency),
                _us(v["reference_p50_us"]),
                _us(v["tuned_p50_us"]),
                f"{_pct(v['gain'])} [{_pct(v['gain_low'])}, {_pct(v['gain_high'])}]",
                f"{v['reference_total_us'] / 1000:.1f} ms",
                f"{v['tuned_total_us'] / 1000:.1f} ms ({ratio:.2f}x)",
            ]
        )
    head = ["context", "conc", f"{ref} step p50", "tuned step p50", "step gain [95% CI]", f"{ref} /req", "tuned /req"]
    out = _table(rows, head)
    verified = [o for o in outcomes if o.verify]
    changed = [o.verify for o in verified if not _keeps_baseline(o)]
    if verified and not changed:
        out += (
            f"\nevery cell keeps the baseline ({base}): this file runs as {base} does, so deploying it or {base} is "
            "the same; the step gain above is "
            + (
                "what accumulating at all costs against handing each chunk over as it came (wire-floor), which any "
                "policy pays in this replay"
                if floor
                else f"{base} against {ref}"
            )
        )
    elif changed and all(g["gain_high"] < 0 for g in changed):
        what = "what vllm-omni 0.30.0 does with this stream" if floor else f"{ref}'s behaviour"
        out += (
            f"\nthe tuned policy is slower per step than {ref} in every bucket where it leaves the baseline (the whole "
            f"interval below 0): deploy {what} (no policy, or the default preset), not this file"
        )
    elif verified and all(g["gain_low"] <= 0 <= g["gain_high"] for g in (o.verify for o in verified)):
        out += f"\nno bucket differs from {ref} beyond the noise (every interval holds 0)"
    out += (f"\n(step gain: the tuned policy's step p50 against the reference's over the {VERIFY_ROUNDS} verification "
            "rounds (the reference first in one, the tuned policy in the other), positive when faster; its 95% "
            f"interval is Student's t over the {VERIFY_ROUNDS} rounds' ratios of medians, as the tuner's own (wide "
            f"with so few rounds); /req: the median over the {VERIFY_ROUNDS} rounds of the mean request total, no "
            "interval)")
    if any((o.verify or {}).get("reference") == WIRE_FLOOR for o in outcomes):
        out += (
            f"\n(reference: {reference}'s _accumulate_payload raises on this stream (torch.cat of a 0-d flag such as "
            "meta.is_segment_finished), so the reference is wire-floor, what vllm-omni 0.30.0's receiving adapter "
            "does with it: each chunk handed over as it came, nothing accumulated)"
        )
    return out
