"""The real-traffic loop (capture -> ``trace`` -> ``bench --trace`` / ``tune --trace``): which captured requests a
bucket replays, bucket edges, a key's kind, requests rotated away, empty chunks, skipped counts, --resume."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omni_accum.capture import CaptureWriter, ChunkRecorder
from omni_accum.capture.reader import read_capture
from omni_accum.capture.trace import build_trace, captured_workload
from omni_accum.cli.main import main

D = 8


def _kind(path: str, value) -> tuple[str, str]:
    if isinstance(value, torch.Tensor) and value.dim():
        return "append", "cat"
    return "replace", "replace"


def _write(folder: Path, steps: list[int], prompt: int = 200, stage: str = "0", **kw) -> None:
    """One request per entry of ``steps`` (its decode steps), one after another, in the order given."""
    w = CaptureWriter(folder, stage, buffer_bytes=0, **kw)
    rec = ChunkRecorder(w, "send", "0->1", _kind, ctx_of=lambda p: p)
    t = 1_000_000_000
    for r, n in enumerate(steps):
        for s in range(n + 1):
            rows = prompt + 1 if s == 0 else 1
            rec.record(f"s{stage}-req-{r}", {"emb": torch.zeros(rows, D, dtype=torch.bfloat16)}, t, source=prompt if s == 0 else None)
            t += 20_000
        t += 100_000
    w.close()


def _workload(folder: Path):
    return captured_workload(build_trace(read_capture(folder)))


# ------------------------------------------------------------------------------------------------ defect 1
def test_a_bucket_replays_all_its_captured_requests_whatever_their_order_in_the_files(tmp_path):
    """A bucket replayed only its first `concurrency` requests: a capture whose short request came first replayed
    that one only, and the same requests in another order tuned another strategy."""
    from omni_accum.bench.replay import measure
    from omni_accum.bench import streams
    from omni_accum.policy import load_policy

    _write(tmp_path / "short", [1, 30, 30, 30])
    _write(tmp_path / "long", [30, 30, 30, 1])
    seen = []
    for name in ("short", "long"):
        wl = _workload(tmp_path / name)
        (cl,) = wl.context_lens
        (res,) = measure(wl, {"default": load_policy("default")}, context_len=cl, concurrency=1, repeats=1)
        assert res.correct and len(res.samples_us[0]) == 2 + 3 * 31  # every request, whole
        assert res.requests == 4 and streams.bucket_steps(wl, cl, 1) == 2 + 3 * 31
        (res,) = measure(wl, {"default": load_policy("default")}, context_len=cl, concurrency=3, repeats=1)
        assert res.correct and len(res.samples_us[0]) == 2 + 3 * 31
        assert len(wl.bucket_requests(cl)) == 4
        assert sorted(wl.replayed_lengths(cl)) == [2, 31, 31, 31]
        assert "all 4 of its captured request(s)" in wl.replay_note(cl)
        seen.append(sorted(wl.replayed_lengths(cl)))
    assert seen[0] == seen[1]
    # concurrency c: c in flight at a time, round-robin, each next one starting as one ends
    assert streams.schedule([2, 3, 1], 2) == [[(0, 0), (1, 0)], [(0, 1), (1, 1)], [(2, 0), (1, 2)]]
    assert streams.schedule([2, 2], 2) == [[(0, 0), (1, 0)], [(0, 1), (1, 1)]]


def test_a_bucket_past_the_bound_replays_a_sample_that_the_files_order_does_not_change(tmp_path):
    from omni_accum.bench.replay import measure
    from omni_accum.capture import trace
    from omni_accum.policy import load_policy

    bound = getattr(trace, "MAX_REPLAYED", 32)
    _write(tmp_path / "a", [2] * (bound + 8))
    wl = _workload(tmp_path / "a")
    (cl,) = wl.context_lens
    (res,) = measure(wl, {"default": load_policy("default")}, context_len=cl, concurrency=2, repeats=1)
    assert res.correct and res.requests == bound and len(res.samples_us[0]) == 3 * bound
    picked = [r.req for r in wl.bucket_requests(cl)]
    assert len(picked) == bound
    assert set(picked) != {f"s0-req-{i}" for i in range(bound)}  # not the first ones of the files
    wl._requests = list(reversed(wl._requests))  # another order of the same requests
    assert [r.req for r in wl.bucket_requests(cl)] == picked
    assert f"{bound} of its {bound + 8} captured requests" in wl.replay_note(cl)


def test_bench_and_tune_trace_say_how_many_captured_requests_each_bucket_replays_and_the_cut(tmp_path, capsys):
    _write(tmp_path / "cap", [1, 30, 30])
    rc = main(["bench", "--trace", str(tmp_path / "cap"), "--arms", "cat", "--repeats", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "bucket context_len=200: replays all 3 of its captured request(s)" in err
    rc = main(["tune", "--trace", str(tmp_path / "cap"), "--out", str(tmp_path / "t.yaml"), "--quick",
               "--max-rounds", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "replays all 3 of its captured request(s); 2 of them cut to their first 13 chunks" in err


# ------------------------------------------------------------------------------------------------ defect 2
def test_auto_edges_are_never_above_the_prompt_lengths_they_stand_for(tmp_path, capsys):
    _write(tmp_path / "a", [2, 2, 2, 2], prompt=64)
    _write(tmp_path / "a", [2, 2, 2, 2, 2, 2, 2, 2], prompt=128, stage="1")
    wl = _workload(tmp_path / "a")
    assert wl.context_lens == [64, 120]
    assert {r.prompt_len() for r in wl.bucket_requests(120)} == {128}
    assert {r.prompt_len() for r in wl.bucket_requests(64)} == {64}
    assert main(["trace", str(tmp_path / "a")]) == 0
    assert "--context-lens 64,120 " in capsys.readouterr().out


def test_edges_given_by_hand_take_the_requests_by_the_run_time_floor_rule_and_an_empty_bucket_is_warned(tmp_path):
    for i, p in enumerate((200, 800, 3000)):
        _write(tmp_path / "c", [2, 2], prompt=p, stage=str(i))
    wl = _workload(tmp_path / "c")
    assert wl.bucket_warnings([200, 3000], None) == []
    assert sorted(r.prompt_len() for r in wl.requests_for(200)) == [200, 200, 800, 800]  # 800 >= 200, < 3000
    assert sorted(r.prompt_len() for r in wl.requests_for(3000)) == [3000, 3000]
    (warn,) = wl.bucket_warnings([200, 1000, 3000], None)
    assert "--context-lens 1000: no captured request falls in that bucket" in warn


# ------------------------------------------------------------------------------------------------ defect 3
def _lang(folder: Path, kind: str, stage: str) -> None:
    w = CaptureWriter(folder, stage, buffer_bytes=0)
    rec = ChunkRecorder(w, "send", "0->1", lambda p, v: (kind, "x") if p == "language" else _kind(p, v),
                        ctx_of=lambda p: p)
    for s in range(4):
        chunk = {"emb": torch.zeros(101 if s == 0 else 1, D), "language": ["en"], "odd": torch.zeros(5 if s == 0 else 1, D)}
        rec.record(f"r{stage}", chunk, 1_000_000 + int(stage) * 100_000 + s * 1000, source=100 if s == 0 else None)
    w.close()


def test_a_key_no_preset_has_gets_its_kind_from_the_captured_data_not_the_capture_time_policy(tmp_path, capsys):
    """`language` read replace under one capture-time policy and append under another; a split capture mixed
    both without a word."""
    _lang(tmp_path / "a", "append", "1")
    _lang(tmp_path / "b", "replace", "1")
    kinds = [{k.path: k.kind for k in _workload(tmp_path / x).keys} for x in ("a", "b")]
    assert kinds[0]["language"] == kinds[1]["language"] == "replace"
    assert kinds[0]["odd"] == "append"  # a prefill, then a row a step
    _lang(tmp_path / "b", "append", "2")  # one capture, two policies
    assert main(["trace", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "key language is recorded as append in 4 record(s) and as replace in 4" in err and "taken as replace" in err


# ------------------------------------------------------------------------------------------------ defect 4
def test_requests_whose_first_chunk_was_rotated_away_are_left_out_and_said(tmp_path, capsys):
    w = CaptureWriter(tmp_path / "r", "0", max_bytes=8192, buffer_bytes=0)
    rec = ChunkRecorder(w, "send", "0->1", _kind, ctx_of=lambda p: p)
    t = 1_000_000
    for r in range(12):
        for s in range(12):
            rec.record(f"q{r}", {"emb": torch.zeros(51 if s == 0 else 1, D)}, t, source=50 if s == 0 else None)
            t += 1000
    w.close()
    trace = build_trace(read_capture(tmp_path / "r"))
    ((side, n),) = trace.dropped.items()
    assert n >= 1 and all(r.chunks[0].seq == 0 for r in trace.side("0->1"))
    assert main(["trace", str(tmp_path / "r"), "--json"]) == 0
    out, err = capsys.readouterr()
    assert f"left out {n} request(s) whose first chunk" in err
    assert json.loads(out)["pairs"]["0->1"]["requests"] == len(trace.side("0->1"))


# ------------------------------------------------------------------------------------------------ defect 5
def test_chunks_with_no_payload_key_are_left_out_and_a_pair_of_only_those_is_one_line(tmp_path, capsys):
    w = CaptureWriter(tmp_path / "e", "1")
    rec = ChunkRecorder(w, "send", "1->2", _kind, ctx_of=lambda p: p)
    for r in range(3):
        for s in range(3):
            rec.record(f"r{r}", {"codes": {}}, 1_000_000 + r * 10_000 + s * 1000, source=100 if s == 0 else None)
    w.close()
    for argv in (["bench", "--trace", str(tmp_path / "e"), "--repeats", "1", "--no-progress"],
                 ["tune", "--trace", str(tmp_path / "e"), "--out", str(tmp_path / "t.yaml"), "--quick"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "its 9 captured chunk(s) carry no payload key" in err[0], err
    w = CaptureWriter(tmp_path / "e", "2")  # and chunks with keys beside them: replayed, the empty ones said
    rec = ChunkRecorder(w, "send", "1->2", _kind, ctx_of=lambda p: p)
    for s in range(3):
        rec.record("x", {"emb": torch.zeros(1, D)} if s != 1 else {}, 2_000_000 + s * 1000, source=100 if s == 0 else None)
    w.close()
    assert main(["bench", "--trace", str(tmp_path / "e"), "--arms", "cat", "--repeats", "1", "--no-progress"]) == 0
    assert "left out 10 captured chunk(s) that carry no payload key" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ defect 8
def test_skipped_lines_are_counted_as_lines_and_files_as_files(tmp_path, capsys):
    _write(tmp_path / "v", [3, 3])
    f = next((tmp_path / "v").glob("capture-*.jsonl"))
    n = len(f.read_text().splitlines())
    f.write_text(f.read_text().replace('"v":1,', '"v":2,'))
    assert main(["trace", str(tmp_path / "v")]) == 2
    out, err = capsys.readouterr()
    assert f"skipped {n} line(s) (" in out and f"({n} line(s) skipped, listed above)" in err
    _write(tmp_path / "m", [3, 3])
    (tmp_path / "m" / "capture-9-1.0.jsonl").symlink_to(f)
    (tmp_path / "m" / "capture-9-2.0.jsonl").mkdir()
    assert main(["trace", str(tmp_path / "m")]) == 0
    assert "skipped 2 file(s) (" in capsys.readouterr().out


def test_a_symlinked_capture_file_named_on_the_command_line_is_said_to_be_a_link_not_read(tmp_path, capsys):
    _write(tmp_path / "cap", [2])
    link = tmp_path / "link.jsonl"
    link.symlink_to(next((tmp_path / "cap").glob("capture-*.jsonl")))
    assert main(["trace", str(link)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{link}: is a symlink: not read" in err[0] and "same-host" in err[0], err
    assert "no complete record" not in err[0]


# ------------------------------------------------------------------------------------------------ defect 9
def test_resume_on_another_stage_pair_names_the_pair_not_a_changed_capture(tmp_path, capsys):
    from omni_accum.tuner.files import settings_mismatches

    old = {"workload": "trace 0->1", "workload_sha256": "a"}
    (why,) = settings_mismatches(old, {"workload": "trace 1->2", "workload_sha256": "b"})
    assert why == "--pair: tuned on stage pair 0->1 of the capture, now 1->2"
    (why,) = settings_mismatches(old, {"workload": "trace 0->1", "workload_sha256": "b"})
    assert why.startswith("--trace: the capture (trace 0->1) changed since")


def test_a_table_tuned_on_a_capture_before_whole_buckets_were_replayed_is_not_resumed(tmp_path):
    """A bucket of a capture replayed only its first C requests, with a cut that followed C; a partial table measured
    so was reused by --resume as if measured now. Its recorded decode steps differ now, so --resume names them."""
    from omni_accum.tuner.files import settings_mismatches
    from omni_accum.tuner.run import TuneOptions, tune_settings
    from omni_accum.policy import load_policy

    _write(tmp_path / "cap", [3, 3])
    wl = _workload(tmp_path / "cap")
    now = tune_settings(TuneOptions(out=str(tmp_path / "t.yaml")), wl, load_policy("default"), decode_steps=8,
                        step_samples=24, rounds=5)  # fmt: skip
    assert now["decode_steps"] == "auto (a bucket's captured requests, each cut to 1 + 24 chunks)"
    before = {**now, "decode_steps": "auto (at least 8, >= 24 step samples per round)"}
    assert any(w.startswith("--decode-steps") for w in settings_mismatches(before, now))


# ---------------------------------------------------------------------------- a review of the fixes above
def test_a_run_holds_the_built_streams_of_one_bucket_only(tmp_path):
    """A bucket builds up to 32 requests; every bucket's stayed built for the whole run, past what the memory
    check counts (one bucket at a time)."""
    from omni_accum.bench.streams import bucket_streams

    w = CaptureWriter(tmp_path / "two", "0", buffer_bytes=0)
    rec = ChunkRecorder(w, "send", "0->1", _kind, ctx_of=lambda p: p)
    for r, prompt in enumerate([100, 100, 4000, 4000]):
        for s in range(3):
            rows = prompt + 1 if s == 0 else 1
            rec.record(f"q{r}", {"emb": torch.zeros(rows, D)}, 1_000_000 + r * 100_000 + s * 1000,
                       source=prompt if s == 0 else None)  # fmt: skip
    w.close()
    wl = _workload(tmp_path / "two")
    lo, hi = wl.context_lens[0], wl.context_lens[-1]
    assert lo < hi
    bucket_streams(wl, lo, 1)
    assert list(wl._built) == [lo] and wl._built[lo]
    bucket_streams(wl.model_copy(update={"decode_steps": 1}), hi, 1)  # a copy (tune's) shares and drops them
    assert list(wl._built) == [hi]


def test_the_replay_note_says_requests_are_replayed_again_to_fill_the_concurrency(tmp_path):
    _write(tmp_path / "c", [3, 3])
    wl = _workload(tmp_path / "c")
    (cl,) = wl.context_lens
    assert "each replayed up to" not in wl.replay_note(cl, 2)
    assert wl.replay_note(cl, 8).endswith("each replayed up to 4 times, with other data, to keep 8 in flight")


def test_a_capture_does_not_replay_over_the_two_process_wires(tmp_path, capsys):
    """They replay C streams of the length of the first: a bucket's other requests were never replayed (and one
    longer than the first was cut, shorter ones an IndexError over mooncake)."""
    _write(tmp_path / "c", [3, 3])
    for wire in ("arena", "mooncake"):
        assert main(["bench", "--trace", str(tmp_path / "c"), "--wire", wire, "--no-progress"]) == 2
        assert f"--trace with --wire {wire}: a capture replays over the inproc, serializer or shm" in capsys.readouterr().err


def test_edges_come_from_the_chunks_replayed_not_the_empty_ones(tmp_path):
    """A request whose chunk 0 carries no key (and no recorded prompt length) counted as a prompt of 1 token in the
    edges: a bucket of 1 that replays nothing of its own."""
    w = CaptureWriter(tmp_path / "e", "0", buffer_bytes=0)
    rec = ChunkRecorder(w, "send", "0->1", _kind, ctx_of=lambda p: p)
    for r in range(3):
        rec.record(f"e{r}", {}, 1_000_000 + r * 100_000)  # no key, no prompt length
        for s in range(1, 4):
            rec.record(f"e{r}", {"emb": torch.zeros(201 if s == 1 else 1, D)}, 1_000_000 + r * 100_000 + s * 1000)
    w.close()
    wl = _workload(tmp_path / "e")
    assert wl.context_lens == [200], wl.context_lens


def test_a_workload_named_with_trace_in_it_is_not_taken_for_a_capture():
    from omni_accum.tuner.files import settings_mismatches

    (why,) = settings_mismatches({"workload": "my trace run", "workload_sha256": "a"},
                                 {"workload": "my trace run", "workload_sha256": "b"})  # fmt: skip
    assert not why.startswith(("--trace", "--pair")), why


def test_the_bench_progress_total_counts_every_replayed_request(tmp_path, monkeypatch):
    """The bar's total was concurrency x chunks of one request: with 20 captured requests it read 100 % after 5 %."""
    import io

    from omni_accum.bench import runner

    _write(tmp_path / "c", [5] * 6)
    wl = _workload(tmp_path / "c")
    made = []

    class Seen(runner.Progress):
        def __init__(self, total, *a, **k):
            made.append(self)
            super().__init__(total, *a, **k)

    monkeypatch.setattr(runner, "Progress", Seen)
    runner.run_bench(wl, {"upstream": "upstream"}, context_lens=wl.context_lens, concurrency=[1], repeats=1,
                     progress=io.StringIO())  # fmt: skip
    (bar,) = made
    (cl,) = wl.context_lens
    assert bar.total == 6 * 6 * runner.step_weight(cl), bar.total  # 6 requests of 6 chunks, one at a time


def test_the_memory_check_counts_the_streams_a_bucket_replays_again(tmp_path):
    """With concurrency above a bucket's captured requests each is built again (other data) to fill it: the check
    counted each once."""
    from omni_accum.bench.streams import stream_nbytes

    _write(tmp_path / "c", [3])
    wl = _workload(tmp_path / "c")
    (cl,) = wl.context_lens
    s = stream_nbytes(wl, cl)
    assert s.pool == 1 and s.lap > 0
    assert s.total(16) - s.total(1) == 15 * (s.lap + s.per_request())
