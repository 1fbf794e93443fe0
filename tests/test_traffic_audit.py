"""The traffic audit: ``trace`` on a large capture (concurrency in O(n log n)), request ids written by two servers or
runs into one folder, chunks with no payload key in ``trace``, a capture folder given as ``--workload``, and ``ab``'s
interval and its inconsistent counters."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from omni_accum.capture import CaptureWriter, ChunkRecorder
from omni_accum.capture.reader import Capture, read_capture
from omni_accum.capture.records import Request
from omni_accum.capture.summary import summarize
from omni_accum.capture.trace import build_trace
from omni_accum.cli.main import main

D = 8


def _kind(path: str, value) -> tuple[str, str]:
    if isinstance(value, torch.Tensor) and value.dim():
        return "append", "cat"
    return "replace", "replace"


def _write(folder: Path, reqs: list[tuple[str, int, int]], t0: int = 1_000_000_000, gap: int = 20_000,
           empty: tuple[int, ...] = ()) -> None:
    """One writer (this process, stage 0): per ``(request id, decode steps, prompt)``, its chunks one after another
    (``empty``: chunk indexes written with no payload key)."""
    w = CaptureWriter(folder, "0", buffer_bytes=0)
    rec = ChunkRecorder(w, "send", "0->1", _kind, ctx_of=lambda p: p)
    t = t0
    for req, n, prompt in reqs:
        for s in range(n + 1):
            chunk = {} if s in empty else {"emb": torch.zeros(prompt + 1 if s == 0 else 1, D, dtype=torch.bfloat16)}
            rec.record(req, chunk, t, source=prompt if s == 0 else None)
            t += gap
    w.close()


def _quadratic(spans: list[tuple[float, float]]) -> list[int]:
    return [sum(1 for o in spans if o[0] <= a <= o[1]) for a, _ in spans]


# ------------------------------------------------------------------------------------------------ item 1
def test_concurrency_is_the_quadratic_definition_ties_and_all():
    from omni_accum.capture.records import overlaps

    rng = random.Random(5)
    for _ in range(200):
        n = rng.randint(0, 40)
        starts = [float(rng.randint(0, 30)) for _ in range(n)]  # small integers: many ties
        spans = [(a, a + rng.choice([0, 0, 1, 2, rng.randint(0, 20)])) for a in starts]
        spans += [(5.0, 3.0)] if rng.random() < 0.2 else []  # an end before its start: never counted
        spans.sort()
        assert overlaps(spans) == _quadratic(spans)


class _Counted(Request):
    """A request that counts how often its start and end are read."""

    reads = 0

    @property
    def start(self) -> float:
        _Counted.reads += 1
        return self.chunks[0].t

    @property
    def end(self) -> float:
        _Counted.reads += 1
        return self.chunks[-1].t


def test_a_summary_reads_each_requests_times_a_bounded_number_of_times_not_once_per_other_request(tmp_path):
    """``trace`` on a 64 MB capture (10,808 requests) took 9.5 minutes: each request's overlap was counted over every
    other request, twice (the figures, the buckets). The work per request is now bounded: no timing asserted."""
    n = 600
    _write(tmp_path / "c", [(f"r{i}", 1 + i % 3, 50 + i % 7) for i in range(n)], gap=7_000)
    trace = build_trace(read_capture(tmp_path / "c"))
    side = trace.side("0->1")
    assert len(side) == n
    want = _quadratic(sorted((r.start, r.end) for r in side))
    for r in side:
        r.__class__ = _Counted
    _Counted.reads = 0
    data = summarize(read_capture(tmp_path / "c"), trace)
    assert _Counted.reads <= 10 * n, _Counted.reads  # the quadratic count read them n * n times
    conc = data["pairs"]["0->1"]["concurrency"]
    assert conc["max"] == max(want) and trace.concurrency("0->1") == want


# ------------------------------------------------------------------------------------------------ item 2
def _rename(folder: Path, pid: int) -> None:
    """This process's capture file in ``folder`` renamed as if another process (``pid``) had written it."""
    (f,) = [p for p in folder.glob(f"capture-0-{os.getpid()}.*.jsonl")]
    f.rename(folder / f"capture-0-{pid}.0.jsonl")


def test_two_servers_writing_the_same_request_ids_into_one_folder_are_separate_requests(tmp_path, capsys):
    reqs = [(f"audit-{i}", 4, 40) for i in range(4)]
    _write(tmp_path / "c", reqs)
    _rename(tmp_path / "c", 5_000_001)  # beyond any pid (PID_LIMIT): never this process's
    _write(tmp_path / "c", reqs, t0=1_000_050_000)  # overlapping in time, the same ids
    _rename(tmp_path / "c", 5_000_002)
    trace = build_trace(read_capture(tmp_path / "c"))
    side = trace.side("0->1")
    assert len(side) == 8 and all(len(r.chunks) == 5 and [c.seq for c in r.chunks] == list(range(5)) for r in side)
    assert len({r.req for r in side}) == 8
    assert main(["trace", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "8 requests, 40 chunks" in out
    assert "note: stage pair 0->1 (sending side): 4 request id(s) recorded by more than one server or run" in out
    assert "capture-0-5000001.0.jsonl" in out and "taken as 8 separate requests" in out


def test_a_restarted_process_with_the_same_pid_and_ids_is_split_by_its_files_and_a_rotation_is_not(tmp_path):
    reqs = [(f"audit-{i}", 3, 40) for i in range(3)]
    _write(tmp_path / "c", reqs)
    _write(tmp_path / "c", reqs, t0=2_000_000_000)  # the same pid: its next file (.1)
    side = build_trace(read_capture(tmp_path / "c")).side("0->1")
    assert len(side) == 6 and all([c.seq for c in r.chunks] == [0, 1, 2, 3] for r in side)
    w = CaptureWriter(tmp_path / "rot", "0", buffer_bytes=0, max_bytes=1 << 20, keep=16)
    rec = ChunkRecorder(w, "send", "0->1", _kind, ctx_of=lambda p: p)
    for s in range(3000):  # one request over several files of one process: one request
        rows = 41 if s == 0 else 1
        rec.record("x", {"emb": torch.zeros(rows, D)}, 1_000_000 + s * 1000, source=40 if s == 0 else None)
    w.close()
    assert len(list((tmp_path / "rot").glob("capture-*.jsonl"))) > 1
    trace = build_trace(read_capture(tmp_path / "rot"))
    assert len(trace.side("0->1")) == 1 and not trace.notes()


def test_repeated_chunk_indexes_in_records_without_their_file_are_left_out_with_a_warning(tmp_path):
    _write(tmp_path / "c", [("a", 2, 40), ("b", 2, 40)])
    recs = read_capture(tmp_path / "c").records
    again = [{k: v for k, v in r.items() if k != "_file"} for r in recs if r["req"] == recs[0]["req"]]
    twice = [dict(r) for r in recs] + again  # request a again, from records that do not say their file
    trace = build_trace(Capture(records=twice))
    assert len(trace.side("0->1")) == 1
    (warning,) = [w for w in trace.warnings() if "repeat" in w]
    assert "left out 1 request(s) whose chunk indexes repeat" in warning and "capture-0-" in warning


# ------------------------------------------------------------------------------------------------ item 4
def test_trace_leaves_chunks_with_no_payload_key_out_of_its_figures_and_says_so(tmp_path, capsys):
    _write(tmp_path / "c", [(f"r{i}", 3, 40) for i in range(3)], empty=(2,))
    _write(tmp_path / "c", [("only-empty", 2, 40)], t0=5_000_000_000, empty=(0, 1, 2))
    assert main(["trace", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "3 requests, 9 chunks" in out, out
    assert "note: stage pair 0->1: left out 6 captured chunk(s) that carry no payload key" in out
    assert main(["trace", str(tmp_path / "c"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["pairs"]["0->1"]["requests"] == 3 and data["pairs"]["0->1"]["chunks"] == 9


# ------------------------------------------------------------------------------------------------ item 3
def test_ab_says_its_interval_assumes_requests_of_like_sizes_in_help_under_the_verdict_and_in_docs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["ab", "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert "the interval assumes requests of like sizes" in helptext and "more often than 5%" in helptext
    page = tmp_path / "m.prom"
    page.write_bytes(_scrape({"control": [30e-6] * 400, "treatment": [31e-6] * 400}, {"control": 40, "treatment": 40}))
    assert main(["ab", "--metrics", str(page)]) == 0
    out = capsys.readouterr().out
    verdict = out.index("treatment vs control:")
    assert out.index("note: the interval assumes requests of like sizes") > verdict
    docs = " ".join((Path(__file__).parents[1] / "docs" / "monitoring.md").read_text().split())
    assert "For requests of like sizes that is conservative" not in docs
    assert "It does **not** hold when request lengths vary" in docs


def _scrape(arms: dict[str, list[float]], reqs: dict[str, int]) -> bytes:
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from omni_accum.integrations.vllm_omni.prometheus import MERGE_BUCKETS

    reg = CollectorRegistry()
    merge = Histogram("omni_accum_ab_merge_seconds", "m", ["arm"], buckets=MERGE_BUCKETS, registry=reg)
    rq = Counter("omni_accum_ab_requests_total", "r", ["arm", "role"], registry=reg)
    for arm, xs in arms.items():
        for x in xs:
            merge.labels(arm).observe(x)
        rq.labels(arm, "receive").inc(reqs[arm])
    return generate_latest(reg)


# ------------------------------------------------------------------------------------------------ item 5
def test_a_capture_folder_given_as_workload_says_to_give_it_with_trace(tmp_path, capsys):
    _write(tmp_path / "cap", [("a", 2, 40)])
    (tmp_path / "plain").mkdir()
    for argv in (["tune", "--workload", str(tmp_path / "cap"), "--out", str(tmp_path / "t.yaml"), "--quick"],
                 ["bench", "--workload", str(tmp_path / "cap"), "--repeats", "1", "--no-progress"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / 'cap'} is a capture folder: give it with --trace {tmp_path / 'cap'}" in err, err
    assert main(["bench", "--workload", str(tmp_path / "plain"), "--repeats", "1", "--no-progress"]) == 2
    assert "is a folder, not a workload file" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ item 6
def test_ab_warns_of_counters_that_cannot_both_be_right_and_keeps_exit_0(tmp_path, capsys):
    page = tmp_path / "m.prom"
    xs = [30e-6 * (1 + i % 5 / 10) for i in range(2000)]
    page.write_bytes(_scrape({"control": xs, "treatment": xs[:50]}, {"control": 0, "treatment": 100}))
    assert main(["ab", "--metrics", str(page)]) == 0
    err = capsys.readouterr().err
    assert ("warning: " + str(page) + ": arm 'control': 2000 chunk(s) timed (omni_accum_ab_merge_seconds) but 0 "
            "requests received") in err, err
    assert "arm 'treatment': 100 requests received" in err and "but 50 chunk(s) timed" in err
    assert "a counter was reset" in err and "a series is stale" in err
    assert main(["ab", "--metrics", str(page), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["warnings"]) == 2
    page.write_bytes(_scrape({"control": xs, "treatment": xs}, {"control": 100, "treatment": 100}))
    assert main(["ab", "--metrics", str(page)]) == 0
    assert "warning" not in capsys.readouterr().err


def test_split_and_left_out_ids_on_one_side_are_both_said(tmp_path):
    """One total for the ids split and the ids left out: with both on one side, the left-out ones went unsaid (the
    warning only came when nothing was split) and the note counted them among the split."""
    reqs = [("audit-a", 3, 40)]
    _write(tmp_path / "c", reqs)
    _rename(tmp_path / "c", 5_000_003)
    _write(tmp_path / "c", reqs, t0=1_000_050_000)
    _rename(tmp_path / "c", 5_000_004)
    capture = read_capture(tmp_path / "c")
    a = capture.records[0]["req"]  # (hashed with the folder's salt)
    b = [dict(r, req=a + "-b") for r in capture.records if r["req"] == a]
    for r in b:
        r.pop("_file", None)  # records that do not say their file
    capture.records.extend(b)
    trace = build_trace(capture)
    assert sorted(r.req for r in trace.side("0->1")) == [f"{a}~1", f"{a}~2"]
    (note,) = trace.notes()
    assert "1 request id(s) recorded by more than one server or run" in note and "taken as 2 separate" in note
    assert any("left out 1 request(s) whose chunk indexes repeat" in w for w in trace.warnings()), trace.warnings()
