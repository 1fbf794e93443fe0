"""The statistics of tune and bench (an audit): bookkeeping off the clock, the verification round's interval, and
the tuner's "no win" stop."""

from __future__ import annotations

import time

from omni_accum.bench import replay as replay_mod
from omni_accum.bench import wires as wires_mod
from omni_accum.bench.replay import WIRE_FLOOR, ArmResult, KeyStats, measure
from omni_accum.bench.workloads import load_workload
from omni_accum.policy.loader import load_policy
from omni_accum.tuner import core as tuner_core
from omni_accum.tuner.candidates import Candidate


def test_inproc_byte_counting_is_not_timed(monkeypatch):
    """Over ``--wire inproc`` the byte count (a recursive walk, about as long as the wire-floor step itself) ran
    inside the timed step. On a fake clock (1 us a reading) a walk that takes 2 s of it must leave the step far under
    1 s, and every byte figure as it was (no wall-clock time is asserted)."""
    wl = load_workload("qwen3-omni-seed")
    arms = {"wire-floor": WIRE_FLOOR, "default": load_policy("default")}

    def run() -> list[ArmResult]:
        return measure(wl, arms, context_len=1000, concurrency=1, repeats=1, check=False, per_key=True)

    before = run()
    real = wires_mod.payload_nbytes

    depth: list[int] = []

    now = [0]

    def fake_clock() -> int:  # nanoseconds: 1 us per reading
        now[0] += 1000
        return now[0]

    def slow(obj):  # 2 s of the fake clock once per walk (the walk recurses through the module's name)
        if not depth:
            now[0] += 2_000_000_000
        depth.append(1)
        try:
            return real(obj)
        finally:
            depth.pop()

    monkeypatch.setattr(wires_mod, "payload_nbytes", slow)
    if hasattr(replay_mod, "payload_nbytes"):
        monkeypatch.setattr(replay_mod, "payload_nbytes", slow)
    monkeypatch.setattr(time, "perf_counter_ns", fake_clock)
    after = run()
    monkeypatch.undo()
    floor = after[0]
    assert floor.error is None, floor.error
    assert floor.step_us_p50 < 1_000_000, f"wire-floor step p50 {floor.step_us_p50:.0f} us: the byte walk is timed"
    for a, b in zip(before, after):
        assert b.wire_bytes_per_step == a.wire_bytes_per_step > 0, (a.arm, a.wire_bytes_per_step, b.wire_bytes_per_step)
        assert {k: v.wire_bytes_per_step for k, v in b.per_key.items()} == {
            k: v.wire_bytes_per_step for k, v in a.per_key.items()
        }


def _arm(label: str, rounds: list[list[float]], key: str | None = None) -> ArmResult:
    res = ArmResult(label, 1000, 1, "inproc", requests=1, steps=len(rounds[0]))
    res.samples_us = [list(r) for r in rounds]
    res.total_us_per_request = [sum(r) for r in rounds]
    if key is not None:
        res.per_key = {key: KeyStats(peak_bytes=100)}
    return res


def _tight(level: float, n: int) -> list[float]:
    return [level * (1.0 + 0.001 * (i % 5)) for i in range(n)]


def test_verify_runs_two_rounds_in_both_orders_with_the_tuners_interval(monkeypatch):
    """The verification timed one round, the reference always first, and printed that round's pooled-step
    bootstrap (which called two arms of one policy different in about a third of runs) as the tuner's interval.
    It runs two rounds, one in each order, and the interval is over the rounds: rounds that disagree (the tuned
    policy 10 % faster in one, 10 % slower in the other) give an interval holding 0."""
    per_round = {"reference": [_tight(100.0, 100), _tight(100.0, 100)],
                 "tuned": [_tight(90.0, 100), _tight(110.0, 100)]}
    orders: list[list[str]] = []

    def stub(wl, arms, *, repeats=3, **kw):
        labels = list(arms)
        for rep in range(repeats):  # as measure rotates its arms
            k = rep % len(labels)
            orders.append(labels[k:] + labels[:k])
        return [_arm(lab, per_round[lab][:repeats]) for lab in labels]

    monkeypatch.setattr(tuner_core, "measure", stub)
    v = tuner_core.verify_bucket(load_workload("qwen3-omni-seed"), load_policy("default"), load_policy("default"),
                                 context_len=1000, concurrency=1, wire="inproc")
    assert len(orders) >= 2 and orders[0][0] != orders[1][0], orders
    assert v["gain_low"] <= 0.0 <= v["gain_high"], v


def test_no_win_stop_waits_for_two_rounds(monkeypatch):
    """After round 0 the "no win" stop ended a key on one round's pooled-step bootstrap, the baseline always timed
    first: a candidate reading 30 % slower in round 0 only was recorded "slower than the baseline beyond the
    noise" after 1 round. The stop waits for two rounds; round 0 does not time the baseline first."""
    wl = load_workload("qwen3-omni-seed")
    key = wl.keys[0].path
    rounds_seen: list[list[str]] = []

    def stub(wl_, arms, **kw):
        rnd = len(rounds_seen)
        rounds_seen.append(list(arms))
        return [_arm(lab, [_tight(130.0 if rnd == 0 and lab != tuner_core.BASE else 100.0, 13)], key) for lab in arms]

    monkeypatch.setattr(tuner_core, "measure", stub)
    base = load_policy("default")
    cand = Candidate("prealloc") if base.resolve(key).strategy != "prealloc" else Candidate("cat")
    decision, rounds = tuner_core._tune_key(
        wl.model_copy(update={"keys": [wl.key(key)]}), base, key, [cand], context_len=1000, concurrency=1,
        wire="inproc", max_rounds=3, memory_factor=2.0, device="cpu", progress=None,
    )
    assert rounds == 3, (rounds, decision.reason)
    assert decision.reason is not None and "crosses 0" in decision.reason, decision.reason
    assert rounds_seen[0][0] != tuner_core.BASE, rounds_seen
