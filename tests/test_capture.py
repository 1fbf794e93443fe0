"""Capture: what the hooks record through vllm-omni's real adapters, replayed as it came; the files' bounds,
modes and crash safety."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from omni_accum.capture import CaptureError, CaptureWriter, ChunkRecorder
from omni_accum.capture.reader import read_capture
from omni_accum.capture.trace import build_trace, captured_workload
from waiting import poll  # tests/ is on sys.path (the rootdir conftest's folder), in stage processes too


def _kind(path: str, value: Any) -> tuple[str, str]:
    return ("append", "cat") if isinstance(value, torch.Tensor) and value.dim() else ("replace", "replace")


def _layout(chunk: dict) -> list[tuple[str, str, tuple]]:
    """``(path, dtype, shape)`` of every payload key of a chunk, in order (tensors; other values: type, len)."""
    out = []
    for top, v in chunk.items():
        if str(top).startswith("__omni_accum"):
            continue
        for qual, x in v.items() if isinstance(v, dict) else ((None, v),):
            path = str(top) if qual is None else f"{top}.{qual}"
            if isinstance(x, torch.Tensor):
                out.append((path, str(x.dtype), tuple(x.shape)))
            else:
                out.append((path, type(x).__name__, (len(x),) if isinstance(x, (list, str)) else ()))
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("policy", ["default", "qwen3-omni"])
def test_a_stream_through_the_real_adapters_is_captured_and_replayed_as_it_came(
    monkeypatch, tmp_path, vo, adapters, policy
):
    """Thinker adapter -> SHM -> talker adapter (vllm-omni 0.30.0's own classes and stage input processor), with
    OMNI_ACCUM_CAPTURE set: the capture holds a send and a receive record per chunk, joined by request; rebuilt
    from it, the replayed stream has the chunks the adapter built, in their order, with the same keys, shapes and
    dtypes; and it replays correctly (views equal the cat reference)."""
    from omni_accum.bench.replay import measure
    from omni_accum.integrations.vllm_omni import capture, send
    from omni_accum.policy import load_policy
    from tests.test_integration_vllm_omni_handoff import _pair, _run

    folder = tmp_path / "cap"
    monkeypatch.setenv("OMNI_ACCUM_CAPTURE", str(folder))
    monkeypatch.setenv("OMNI_ACCUM_HANDOFF_SAMPLE", "2")
    built: list[list[tuple[str, str, tuple]]] = []
    orig = send.encode_payload

    def encode(b, req_id, data, task=None):
        from vllm_omni.data_entry_keys import OmniPayloadStruct, to_dict

        built.append(_layout(to_dict(data) if isinstance(data, OmniPayloadStruct) else data))
        return orig(b, req_id, data, task)

    monkeypatch.setattr(send, "encode_payload", encode)
    vo.install(None)
    try:
        tx, rx = _pair(adapters, {"omni_accum_policy": policy})
        rid = f"oa-cap-{policy}-{os.getpid()}"
        handed = _run(tx, rx, rid)
        capture.flush_all()
    finally:
        capture.close_all()
    assert len(built) == len(handed) == 6

    cap = read_capture(folder)
    assert cap.problems == []
    roles = [r["role"] for r in cap.records]
    assert roles.count("send") == roles.count("recv") == 6
    assert {r["pair"] for r in cap.records} == {"0->1"}
    assert len({r["req"] for r in cap.records}) == 1  # the talker records the thinker's id: one request
    assert rid not in json.dumps(cap.records)  # hashed, never the id itself
    sends = [r for r in cap.records if r["role"] == "send"]
    assert [r["seq"] for r in sends] == list(range(6))
    assert sends[0]["ctx"] is not None and sends[0]["ctx"] > 0
    recvs = [r for r in cap.records if r["role"] == "recv"]
    assert recvs[0]["handoff_s"] is not None and recvs[0]["handoff_s"] >= 0  # the prefill hand-off was timed

    wl = captured_workload(build_trace(cap), "0->1")
    (req,) = wl._requests
    replayed = wl.recorded_stream(req.prompt_len(), 0)
    assert [_layout(c) for c in replayed] == built
    # the default preset's cat raises on the 0-d flag in the library (the integration hands such a chunk to
    # 0.30.0's code): the replay is checked under the policy made for this stream
    (res,) = measure(wl, {"qwen3-omni": load_policy("qwen3-omni")}, context_len=req.prompt_len(), repeats=1)
    assert res.steps == 6 and res.correct, res.mismatch


def test_records_say_what_went_through_and_values_only_when_asked(tmp_path):
    w = CaptureWriter(tmp_path / "c", "0", buffer_bytes=0)
    plain = ChunkRecorder(w, "send", "0->1", _kind, ctx_of=lambda task: task["P"])
    sampled = ChunkRecorder(w, "recv", "0->1", _kind, values="sample")
    rows = torch.arange(12, dtype=torch.float32).reshape(3, 4).bfloat16()
    chunk = {"embed": {"prefill": rows}, "meta": {"finished": torch.tensor(False), "override_keys": [["embed", "x"]]},
             "ids": {"all": [5, 6, 7]}, "speaker": "Ethan"}
    plain.record("r1", chunk, 5_000_000, source={"P": 3})
    plain.record("r1", chunk, 5_250_000)
    sampled.record("int-r1", chunk, 5_500_000, handoff_s=0.25, name="r1")
    w.close()
    first, second, third = read_capture(tmp_path / "c").records
    assert first["t"] == 5.0 and second["dt"] == 0.25 and second["seq"] == 1 and first["ctx"] == second["ctx"] == 3
    assert first["req"] == third["req"]  # the receiving side names the sender's id: both sides join
    keys = {k[0]: k for k in first["keys"]}
    assert keys["embed.prefill"][:6] == ["embed.prefill", "append", "bfloat16", [3, 4], 24, "cat"]
    assert keys["meta.override_keys"][6] == {"value": [["embed", "x"]]}
    assert keys["ids.all"][2:4] == ["ids", [3]] and keys["speaker"][2:4] == ["str", [5]]
    text = json.dumps([first, second])
    assert "Ethan" not in text and "sample" not in text  # no contents unless asked for
    got = {k[0]: k for k in third["keys"]}["embed.prefill"][6]
    assert got["sample_shape"] == [2, 4] and third["handoff_s"] == 0.25
    from omni_accum.capture.trace import _from_sample

    assert torch.equal(_from_sample(got, torch.bfloat16, (2, 4)), rows[:2])


def test_a_process_keeps_at_most_max_bytes_over_its_newest_files(tmp_path):
    w = CaptureWriter(tmp_path, "1", max_bytes=8192, keep=2, buffer_bytes=1024)
    line = '{"v":1}' + " " * 90 + "\n"
    for _ in range(1000):
        w.write(line)
    w.close()
    files = sorted(tmp_path.glob("capture-1-*.jsonl"))
    assert [f.name for f in files] == [f"capture-1-{os.getpid()}.{n}.jsonl" for n in (w._n - 1, w._n)]
    assert w._n > 5  # it rotated, removing the oldest each time
    assert all(f.stat().st_size <= 4096 for f in files)
    assert sum(f.stat().st_size for f in files) <= 8192
    assert all(f.read_bytes().endswith(b"\n") and f.read_bytes().count(b"\n") * len(line.encode()) == f.stat().st_size
               for f in files)  # whole lines only, never one cut at a bound


def test_the_folder_is_private_the_files_too_and_a_symlink_is_refused(tmp_path):
    folder = tmp_path / "new" / "cap"
    w = CaptureWriter(folder, "0")
    w.write("{}\n")
    w.close()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(w.path.stat().st_mode) == 0o600
    assert stat.S_IMODE((folder / "salt").stat().st_mode) == 0o600
    target = tmp_path / "elsewhere"
    target.write_text("keep me\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / f"capture-0-{os.getpid()}.0.jsonl").symlink_to(target)
    with pytest.raises(CaptureError, match="symlink"):
        CaptureWriter(other, "0")
    assert target.read_text() == "keep me\n"
    assert any("symlink" in str(p) for p in read_capture(other).problems)  # the reader does not follow it either


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from omni_accum.capture import CaptureWriter, ChunkRecorder
    w = CaptureWriter(sys.argv[1], "0", buffer_bytes=int(sys.argv[2]))
    rec = ChunkRecorder(w, "send", "0->1", lambda p, v: ("append", "cat"))
    row = torch.zeros(1, 64)
    print("ready", flush=True)
    i = 0
    while True:
        rec.record(f"r{i % 7}", {"embed": {"decode": row}}, 1_000_000 + i)
        i += 1
    """
)


@pytest.mark.parametrize("buffer_bytes", [0, 16 << 10])
def test_a_writer_killed_mid_stream_leaves_a_readable_file(tmp_path, buffer_bytes):
    """kill -9 while records stream in: every line up to the last complete one reads back (a cut last line, if the
    kill fell inside a write, is reported and skipped)."""
    folder = tmp_path / "cap"
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(folder), str(buffer_bytes)], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"ready"
        assert poll(lambda: sum(f.stat().st_size for f in folder.glob("capture-*")) >= 200_000, 120)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    cap = read_capture(folder)
    assert len(cap.records) > 100
    assert all("truncated" in pr.reason for pr in cap.problems) and len(cap.problems) <= 1
    seqs: dict[str, list[int]] = {}
    for r in cap.records:
        seqs.setdefault(r["req"], []).append(r["seq"])
    assert all(s == list(range(len(s))) for s in seqs.values())  # nothing lost in the middle, in order


@pytest.mark.parametrize("word", ["1", "yes", "TRUE", "on"])
def test_an_on_word_is_not_a_capture_folder_and_a_bad_setting_refuses_at_install(vo, monkeypatch, tmp_path, word):
    """``OMNI_ACCUM_CAPTURE=1`` wrote the capture into ``./1`` of each stage's working folder (and ``no`` into
    ``./no``); a bad capture setting was found at a binding's first chunk only (logged; capture off), even with
    OMNI_ACCUM_REQUIRED=1. Refused where the other settings are: at install, and for a connector extra when the
    adapter is built."""
    from omni_accum.integrations.vllm_omni import binding_settings, capture
    from omni_accum.switches import SettingError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMNI_ACCUM_CAPTURE", word)
    with pytest.raises(SettingError, match=f"OMNI_ACCUM_CAPTURE='{word}': give the capture folder as a path"):
        capture.settings()
    with pytest.raises(SettingError, match=f"OMNI_ACCUM_CAPTURE='{word}'"):
        vo.install("qwen3-omni")
    assert not vo.is_installed()
    monkeypatch.setenv("OMNI_ACCUM_CAPTURE", "no")
    assert capture.settings() is None
    monkeypatch.delenv("OMNI_ACCUM_CAPTURE")
    with pytest.raises(SettingError, match="omni_accum_capture_values='all'"):
        binding_settings.check_extra({"omni_accum_policy": "qwen3-omni", "omni_accum_capture": str(tmp_path),
                                      "omni_accum_capture_values": "all"})  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_every_bad_capture_setting_is_named_at_once(monkeypatch):
    """An on-word folder with two bad other settings named only the folder: fixed, the next start named the next."""
    from omni_accum.integrations.vllm_omni import capture
    from omni_accum.switches import SettingError

    monkeypatch.setenv("OMNI_ACCUM_CAPTURE", "yes")
    monkeypatch.setenv("OMNI_ACCUM_CAPTURE_MAX_BYTES", "100")
    monkeypatch.setenv("OMNI_ACCUM_CAPTURE_VALUES", "all")
    with pytest.raises(SettingError) as e:
        capture.settings({})
    for named in ("OMNI_ACCUM_CAPTURE='yes'", "OMNI_ACCUM_CAPTURE_VALUES='all'", "OMNI_ACCUM_CAPTURE_MAX_BYTES='100'"):
        assert named in str(e.value), str(e.value)


def test_bad_capture_settings_are_named(monkeypatch):
    from omni_accum.integrations.vllm_omni import capture
    from omni_accum.switches import SettingError

    assert capture.settings({"omni_accum_capture": "off"}) is None
    monkeypatch.delenv("OMNI_ACCUM_CAPTURE", raising=False)
    assert capture.settings({}) is None
    assert capture.settings({"omni_accum_capture": "/tmp/x", "omni_accum_capture_values": "sample"})[1] == "sample"
    with pytest.raises(SettingError, match="omni_accum_capture_values='all'.*none or sample"):
        capture.settings({"omni_accum_capture": "/tmp/x", "omni_accum_capture_values": "all"})
    # a size as the connectors' size keys take it; under a page, or not a size, is named with what it takes
    assert capture.settings({"omni_accum_capture": "/tmp/x", "omni_accum_capture_max_bytes": "64MiB"})[2] == 64 << 20
    assert capture.settings({"omni_accum_capture": "/tmp/x", "omni_accum_capture_max_bytes": 8192})[2] == 8192
    with pytest.raises(SettingError, match="omni_accum_capture_max_bytes='64MiX'.*a size such as 64MiB"):
        capture.settings({"omni_accum_capture": "/tmp/x", "omni_accum_capture_max_bytes": "64MiX"})
    with pytest.raises(SettingError, match="omni_accum_capture_max_bytes=True"):
        capture.settings({"omni_accum_capture": "/tmp/x", "omni_accum_capture_max_bytes": True})
    with pytest.raises(SettingError, match="OMNI_ACCUM_CAPTURE_MAX_BYTES='1k'"):
        monkeypatch.setenv("OMNI_ACCUM_CAPTURE_MAX_BYTES", "1k")
        capture.settings({"omni_accum_capture": "/tmp/x"})
    with pytest.raises(SettingError, match="omni_accum_capture=5"):
        capture.settings({"omni_accum_capture": 5})
    # both bad values in one message (doctor named only the first)
    both = "omni_accum_capture_values='all'.*; environment variable OMNI_ACCUM_CAPTURE_MAX_BYTES='1k'"
    with pytest.raises(SettingError, match=both):
        capture.settings({"omni_accum_capture": "/tmp/x", "omni_accum_capture_values": "all"})


def test_times_are_written_as_microseconds_and_read_as_seconds_and_older_files_read_the_same(tmp_path):
    w = CaptureWriter(tmp_path, "0", buffer_bytes=0)
    rec = ChunkRecorder(w, "send", "0->1", lambda path, value: ("append", "cat"))
    rec.record("r", {"embed": {"x": torch.zeros(1, 2)}}, 1_500_823_244)
    rec.record("r", {"embed": {"x": torch.zeros(1, 2)}}, 1_500_823_300)
    w.close()
    text = w.path.read_text()
    assert '"t":1500823244e-6' in text and '"dt":56e-6' in text  # no float formatting on the hot path
    first, second = read_capture(tmp_path).records
    assert first["t"] == 1500.823244 and first["dt"] == 0 and second["dt"] == 56e-6
    # a line as the recorder wrote it before (decimal seconds) reads as the same record
    older = text.splitlines()[0].replace("1500823244e-6", "1500.823244").replace('"dt":0e-6', '"dt":0.0')
    w.path.write_text(older + "\n")
    assert read_capture(tmp_path).records == [first]


def test_a_key_whose_shape_or_dtype_changes_is_described_again(tmp_path):
    w = CaptureWriter(tmp_path, "0", buffer_bytes=0)
    rec = ChunkRecorder(w, "send", "0->1", _kind)
    values = [torch.tensor(True), torch.tensor(False), torch.zeros(2, dtype=torch.bool), torch.tensor(1.5),
              torch.zeros(0), torch.tensor(True), torch.zeros(1, 3, dtype=torch.bfloat16),
              torch.zeros(2, 3, dtype=torch.bfloat16), "text", torch.tensor(False)]
    for i, v in enumerate(values):
        rec.record("r", {"meta": {"flag": v}}, 1_000_000 + i)
    w.close()
    got = [r["keys"][0][2:4] for r in read_capture(tmp_path).records]
    assert got == [["bool", []], ["bool", []], ["bool", [2]], ["float32", []], ["float32", [0]], ["bool", []],
                   ["bfloat16", [1, 3]], ["bfloat16", [2, 3]], ["str", [4]], ["bool", []]]


def test_a_stream_of_ever_new_keys_keeps_at_most_max_key_parts_and_records_the_same(tmp_path, monkeypatch):
    from omni_accum.capture import recorder

    def run(folder, cap):
        monkeypatch.setattr(recorder, "MAX_KEY_PARTS", cap)
        w = CaptureWriter(folder, "0", buffer_bytes=0)
        rec = ChunkRecorder(w, "send", "0->1", _kind)
        for i in range(40):  # new top-level keys and new keys under one, each seen twice (the cached path too)
            chunk = {f"top{i // 2}": torch.zeros(i % 3 + 1, 2), "meta": {f"k{i // 2}": torch.tensor(i % 2 == 0)}}
            rec.record("r", chunk, 1_000_000 + i)
        w.close()
        parts = sum(len(sub) for sub in rec._keys.values())
        return [r["keys"] for r in read_capture(folder).records], parts, len(rec._keys)

    kept, n_kept, tops_kept = run(tmp_path / "a", 10_000)
    capped, n_capped, tops_capped = run(tmp_path / "b", 5)
    assert capped == kept and len(kept) == 40
    assert n_kept == 40 and tops_kept == 21
    assert n_capped == 5 and tops_capped == 5


def test_a_capture_whose_files_are_cleared_goes_on_and_one_whose_folder_is_removed_says_so(tmp_path):
    import shutil

    errors: list[str] = []
    w = CaptureWriter(tmp_path / "cap", "0", buffer_bytes=0, on_error=errors.append)
    rec = ChunkRecorder(w, "send", "0->1", lambda path, value: ("append", "cat"))
    rec.record("r", {"embed": {"x": torch.zeros(1, 2)}}, 1_000_000)
    for f in (tmp_path / "cap").glob("capture-*"):
        f.unlink()  # the operator clears the files between two experiments; the folder and its salt stay
    rec.record("r", {"embed": {"x": torch.zeros(1, 2)}}, 1_000_100)
    assert errors == [] and not w.closed
    assert len(read_capture(tmp_path / "cap").records) == 1  # the second record went to a new file
    shutil.rmtree(tmp_path / "cap")
    rec.record("r", {"embed": {"x": torch.zeros(1, 2)}}, 1_000_200)
    assert w.closed and len(errors) == 1 and "was removed with its folder or salt; capture stopped" in errors[0]
    rec.record("r", {"embed": {"x": torch.zeros(1, 2)}}, 1_000_300)
    assert len(errors) == 1  # reported once


def test_folders_made_for_a_capture_are_0700_and_a_file_planted_in_its_place_is_refused(tmp_path):
    old = os.umask(0)
    try:
        w = CaptureWriter(tmp_path / "a" / "b" / "cap", "0")
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "cap"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    w.close()
    planted = tmp_path / "a" / "b" / "cap" / f"capture-1-{os.getpid()}.0.jsonl"
    planted.write_text("")
    os.chmod(planted, 0o666)  # made before the server by someone who then reads what it appends
    with pytest.raises(CaptureError, match="not this user's private file"):
        CaptureWriter(tmp_path / "a" / "b" / "cap", "1")


def test_an_infinite_capture_bound_is_a_named_setting_error_never_an_overflow(monkeypatch):
    """omni_accum_capture_max_bytes: .inf raised OverflowError out of the send hook (the request failed)."""
    from omni_accum.integrations.vllm_omni import capture
    from omni_accum.switches import SettingError

    with pytest.raises(SettingError, match="omni_accum_capture_max_bytes=inf: give the bytes a process may write"):
        capture.settings({"omni_accum_capture": "/tmp/x", "omni_accum_capture_max_bytes": float("inf")})


def test_a_failing_record_is_said_once_per_kind_not_once_per_message(caplog):
    """The said-once set was keyed by the message: a failure whose text names the request was said (and kept) once
    per request."""
    import logging
    from types import SimpleNamespace

    from omni_accum.integrations.vllm_omni import capture

    class Failing:
        n = 0

        def record(self, req_id, *args, **kwargs):
            Failing.n += 1
            raise ValueError(f"request {req_id} has no prompt ({Failing.n})")

    cap = SimpleNamespace(send=Failing(), recv=None)
    capture._reported.clear()
    caplog.set_level(logging.ERROR, "omni_accum")
    for i in range(50):
        capture.sent(cap, f"r{i}", {"k": torch.ones(1)}, None)
    said = [r.getMessage() for r in caplog.records if "a send record failed" in r.getMessage()]
    assert Failing.n == 50 and len(said) == 1 and "request r0 has no prompt (1)" in said[0]
    assert len(capture._reported) == 1
    capture._reported.clear()


def _run_records(folder, run: int, n: int, **kw) -> CaptureWriter:
    """``n`` records of request ``run<run>`` (times going on from run to run), written by a writer of stage 0."""
    w = CaptureWriter(folder, "0", max_bytes=4096, keep=2, buffer_bytes=0, **kw)
    rec = ChunkRecorder(w, "send", "0->1", lambda path, value: ("append", "cat"))
    for i in range(n):
        rec.record(f"run{run}", {"embed": {"x": torch.zeros(1, 2)}}, run * 10_000_000 + i * 1000)
    w.close()
    return w


def test_a_restarted_process_with_the_same_pid_never_appends_to_or_rotates_away_the_previous_runs_files(tmp_path):
    """A process restarted with the pid of the previous run (pid 1 in a container, every time) opened file 0 of that
    pid again: it appended to the previous run's files and removed them when it rotated. Two writers of one stage in
    one process have one pid, as the two runs had."""
    folder = tmp_path / "cap"
    first = _run_records(folder, 1, 40)
    kept = {f.name: f.read_bytes() for f in first.files()}
    assert len(kept) == 2 and first._n >= 3  # it rotated: files 0 and 1 are gone, its newest two stay
    second = _run_records(folder, 2, 120)
    assert {f.name: f.read_bytes() for f in folder.glob("capture-*") if f.name in kept} == kept  # untouched, there
    assert second._mine[0] > first._n  # numbered on after the previous run's files
    assert not set(kept) & {f.name for f in second.files()} and len(second.files()) == 2
    assert second._n >= 10  # past 9: .10 is read after .9, not before .2
    cap = read_capture(folder)
    assert cap.problems == [] and len(cap.files) == 4
    assert cap.files == first.files() + second.files()  # the previous run's files first, then this run's
    runs = [r["t"] for r in cap.records]
    assert runs == sorted(runs)  # every file read, in the order written
    reqs = [{r["req"] for r in cap.records if r["_file"] in (str(f) for f in files)}
            for files in (cap.files[:2], cap.files[2:])]
    assert len(reqs[0]) == len(reqs[1]) == 1 and reqs[0] != reqs[1]  # each run's records in its own files


def test_a_short_write_goes_on_with_the_rest_and_a_full_disk_cuts_the_file_back_to_its_last_whole_line(
    tmp_path, monkeypatch
):
    """os.write's count was not checked: on a nearly full disk a cut line stayed mid-file with the next record glued
    to it, and nothing was said. The rest is written; an error part-way (ENOSPC) cuts the file back to its last whole
    line, stops the capture and is reported once."""
    import errno

    from omni_accum.capture import writer

    real = os.write
    room = {"left": None}  # bytes the disk still takes (None: any); each write takes at most 7 of them

    def short_write(fd, data):
        if fd != w._fd:
            return real(fd, data)
        if room["left"] == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = min(7, len(data), 7 if room["left"] is None else room["left"])
        if room["left"] is not None:
            room["left"] -= n
        return real(fd, bytes(data[:n]))

    errors: list[str] = []
    w = CaptureWriter(tmp_path, "0", buffer_bytes=1 << 20, on_error=errors.append)
    monkeypatch.setattr(writer.os, "write", short_write)
    line = '{"v":1}' + " " * 40 + "\n"
    for _ in range(3):
        w.write(line)
    w.flush()
    assert w.path.read_bytes() == line.encode() * 3 and errors == [] and w.lines == 3
    room["left"] = len(line) + 20  # one more line and part of the next fit
    for _ in range(3):
        w.write(line)
    w.flush()
    assert w.path.read_bytes() == line.encode() * 4  # the cut line is gone, nothing glued to it
    assert w.closed and w.lines == 4 and len(errors) == 1
    assert f"capture file {w.path}: write failed after {len(line) + 20} of {3 * len(line)} bytes" in errors[0]
    assert "No space left on device" in errors[0] and "capture stopped" in errors[0]
    w.write(line)
    w.close()
    assert w.path.read_bytes() == line.encode() * 4 and len(errors) == 1  # dropped after, said once
