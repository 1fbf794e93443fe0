"""``omni-accum trace``, ``bench --trace`` and ``tune --trace`` on a capture (written with the recorder the hooks
use), including one with a cut and a corrupt line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni_accum.capture import CaptureWriter, ChunkRecorder
from omni_accum.cli.main import main

D = 16


def _kind(path: str, value) -> tuple[str, str]:
    if isinstance(value, torch.Tensor) and value.dim() and path != "embed.tts_bos":
        return "append", "cat"
    return "replace", "replace"


def write_capture(folder: Path, requests: int = 4, decode: int = 5) -> dict:
    """Requests of two prompt lengths, two at a time, thinker -> talker; what was written, counted here."""
    w = CaptureWriter(folder, "0", buffer_bytes=0)
    rec = ChunkRecorder(w, "send", "0->1", _kind, ctx_of=lambda p: p)
    counts = {"chunks": 0, "decode_bytes": 0}
    flag = torch.tensor(False)
    for r in range(requests):
        p = 40 if r % 2 else 200
        t = 1_000_000 + (r // 2) * 10_000_000
        first = {"embed": {"prefill": torch.zeros(p + 1, D, dtype=torch.bfloat16), "tts_bos": torch.zeros(1, 1, D)},
                 "meta": {"finished": flag}}
        rec.record(f"req{r}", first, t, source=p)
        counts["chunks"] += 1
        for s in range(decode + r):
            rec.record(f"req{r}", {"embed": {"decode": torch.zeros(1, D, dtype=torch.bfloat16)},
                                   "meta": {"finished": flag}}, t + (s + 1) * 1000)
            counts["chunks"] += 1
            counts["decode_bytes"] += 2 * D
    w.close()
    return counts


def test_trace_summarises_requests_keys_and_buckets(tmp_path, capsys):
    counts = write_capture(tmp_path / "cap")
    assert main(["trace", str(tmp_path / "cap"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    pair = data["pairs"]["0->1"]
    assert pair["requests"] == 4 and pair["chunks"] == counts["chunks"]
    assert pair["concurrency"]["max"] == 2
    assert pair["buckets"]["context_lens"] == [40, 200]
    dec = pair["keys"]["embed.decode"]
    assert dec["bytes"] == counts["decode_bytes"] and dec["kind"] == "append" and dec["requests"] == 4
    assert pair["keys"]["embed.prefill"]["would_save"]["bytes"] == 0  # one chunk per request
    assert main(["trace", str(tmp_path / "cap")]) == 0
    text = capsys.readouterr().out
    assert "stage pair 0->1" in text and "--context-lens 40,200" in text and "embed.decode" in text


def test_bench_trace_names_a_cut_and_a_corrupt_line_and_uses_the_rest(tmp_path, capsys):
    write_capture(tmp_path / "cap")
    (f,) = (tmp_path / "cap").glob("capture-*.jsonl")
    lines = f.read_bytes().split(b"\n")
    lines[3] = b'{"v": 1, "t": "soon"'  # corrupt in the middle
    f.write_bytes(b"\n".join(lines[:-1]) + b"\n" + b'{"v":1,"t":12.5,"req":"ab')  # and a cut last line
    rc = main(["bench", "--trace", str(tmp_path / "cap"), "--arms", "cat", "--repeats", "1", "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert f"{f}, line 4: not a JSON record" in err
    assert f"{f}, line {len(lines)}: truncated record" in err
    assert "workload trace 0->1" in out


def test_trace_of_a_capture_with_no_complete_record_fails_and_lists_each_skipped_line_once(tmp_path, capsys):
    """It printed "0 records" and exited 0 (bench --trace of the same folder fails), each skipped line twice."""
    cap = tmp_path / "cap"
    cap.mkdir()
    (cap / "capture-1.jsonl").write_text('not json\n{"x": 1}\n')
    assert main(["trace", str(cap)]) == 2
    out, err = capsys.readouterr()
    assert "0 records" in out and out.count("capture-1.jsonl, line 1: not a JSON record") == 1
    assert err.strip() == f"omni-accum trace: error: {cap}: the capture holds no complete record (2 line(s) skipped, "\
        "listed above)"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--trace", "NOPE"], "NOPE: no such capture folder or file"),
        (["bench", "--trace", "EMPTY"], "no capture files in this folder"),
        (["bench", "--trace", "CAP", "--workload", "qwen3-omni-0.30"], "give one"),
        (["bench", "--pair", "0->1"], "--pair 0->1 needs --trace DIR"),
        (["bench", "--trace", "CAP", "--pair", "1->2"], "no requests of that stage pair; it has 0->1"),
        (["tune", "--trace", "NOPE", "--out", "OUT"], "NOPE: no such capture folder or file"),
        (["tune", "--trace", "CAP", "--pair", "5->6", "--out", "OUT"], "it has 0->1"),
        (["tune", "--trace", "CAP", "--pair", "5-6", "--out", "OUT"], "--pair '5->6': the capture has no requests"),
        (["tune", "--trace", "CAP", "--pair", "0-", "--out", "OUT"], "(quote it: --pair '0->1'; the shell took >"),
        (["trace", "NOPE"], "NOPE: no such capture folder or file"),
        (["trace", ""], "an empty capture path: give a capture folder or a capture file (capture-*.jsonl)"),
    ],
)
def test_a_bad_trace_argument_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    write_capture(tmp_path / "CAP")
    (tmp_path / "EMPTY").mkdir()
    subs = {"NOPE": str(tmp_path / "NOPE"), "EMPTY": str(tmp_path / "EMPTY"), "CAP": str(tmp_path / "CAP"),
            "OUT": str(tmp_path / "t.yaml")}
    message = message.replace("NOPE", subs["NOPE"])
    assert main([subs.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert "Traceback" not in err[0]


def test_tune_trace_writes_a_policy_tuned_on_the_capture(tmp_path, capsys):
    write_capture(tmp_path / "cap", requests=4, decode=12)
    out = tmp_path / "t.yaml"
    rc = main(["tune", "--trace", str(tmp_path / "cap"), "--pair", "0-1", "--out", str(out), "--quick",
               "--max-rounds", "1"])
    text, err = capsys.readouterr()
    assert rc == 0, err
    from omni_accum.policy import load_policy

    t = load_policy(out).tuned
    assert t.workload == "trace 0->1" and t.context_len_edges == [40, 200] and t.concurrency_edges == [2]
    assert {c.key for c in t.cells} >= {"embed.decode"}


@pytest.mark.parametrize(
    ("dtype", "shape", "nbytes", "why"),
    [
        ("bfloat16", [1000000000000, D], 4096, "do not match shape [1000000000000, %d] of bfloat16" % D),
        ("bfloat16", [1000000000000, D], 1000000000000 * D * 2, "more than a key of a chunk holds (16 GiB)"),
        ("ids", [1000000000000], 8, "more than a key of a chunk holds (16 GiB)"),  # replayed as a list that long
    ],
)
def test_a_recorded_shape_that_does_not_fit_its_bytes_or_any_chunk_is_a_skipped_line(tmp_path, capsys, dtype, shape,
                                                                                      nbytes, why):
    """A corrupt or hostile shape in a capture was replayed as it was: tune died allocating 8 PB (a traceback)."""
    write_capture(tmp_path / "cap")
    f = next((tmp_path / "cap").glob("capture-*.jsonl"))
    lines = f.read_text().splitlines()
    rec = json.loads(lines[0])
    rec["keys"][0][2], rec["keys"][0][3], rec["keys"][0][4] = dtype, shape, nbytes
    f.write_text("\n".join([json.dumps(rec), *lines[1:]]) + "\n")
    out = tmp_path / "t.yaml"
    rc = main(["tune", "--trace", str(tmp_path / "cap"), "--out", str(out), "--quick", "--max-rounds", "1",
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0 and "line 1" in err and why in err and "Traceback" not in err, err


def test_keys_of_an_older_release_and_re_sent_static_keys_are_read_as_the_preset_that_has_them(tmp_path, capsys):
    """A 0.16 stream (flat keys, the whole thinker_embeddings read every step) read as "nothing to save", and a
    static key re-sent on every chunk under `default` (recorded as the policy's append/cat) was offered only
    append strategies: the kind and read now come from the built-in preset that has the key."""
    w = CaptureWriter(tmp_path / "c016", "0", buffer_bytes=0)
    rec = ChunkRecorder(w, "send", "0->1", lambda path, value: ("append", "cat"), ctx_of=lambda p: p)
    for r in range(2):
        t = 1_000_000 + r * 10_000_000
        static = {"tts_bos_embed": torch.zeros(1, 1, 64)}
        rec.record(f"r{r}", {"thinker_embeddings": torch.zeros(101, D, dtype=torch.bfloat16), **static}, t, source=100)
        for s in range(12):
            rec.record(f"r{r}", {"thinker_embeddings": torch.zeros(1, D, dtype=torch.bfloat16), **static},
                       t + (s + 1) * 1000)
    w.close()
    assert main(["trace", str(tmp_path / "c016"), "--json"]) == 0
    keys = json.loads(capsys.readouterr().out)["pairs"]["0->1"]["keys"]
    emb, bos = keys["thinker_embeddings"], keys["tts_bos_embed"]
    assert emb["read"] == "newest_row" and emb["read_from"] == "qwen3-omni-seed"
    assert emb["would_save"]["strategy"] == "prealloc or token_list" and emb["would_save"]["bytes"] > 0
    assert bos["kind"] == "replace" and bos["would_save"]["strategy"] == "send_once"
    from omni_accum.capture.reader import read_capture
    from omni_accum.capture.trace import build_trace, captured_workload

    wl = captured_workload(build_trace(read_capture(tmp_path / "c016")))
    kinds = {k.path: (k.kind, k.read) for k in wl.keys}
    assert kinds["thinker_embeddings"] == ("append", "newest_row") and kinds["tts_bos_embed"][0] == "replace"


def test_buckets_given_beyond_the_capture_are_warned_about(tmp_path, capsys):
    """A --context-lens whose bucket holds no captured request, or a --concurrency above the capture's, was
    measured on other requests without a word."""
    write_capture(tmp_path / "cap")  # prompts of 40 and 200 tokens, at most 2 at once
    out = tmp_path / "t.yaml"
    rc = main(["tune", "--trace", str(tmp_path / "cap"), "--out", str(out), "--quick", "--max-rounds", "1",
               "--context-lens", "200,32000", "--concurrency", "1,64", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "--context-lens 32000: no captured request falls in that bucket (the capture's prompts are 40-200" in err
    assert "--context-lens 200:" not in err
    assert "--concurrency 64: the capture had at most 2 requests at once" in err and "--concurrency 1:" not in err


def test_a_key_whose_rows_change_width_or_dtype_within_a_capture_is_warned_about(tmp_path, capsys):
    """Two servers (hidden 16 and 8) capturing into one folder were merged into one stream without a word."""
    write_capture(tmp_path / "cap")
    assert main(["trace", str(tmp_path / "cap")]) == 0
    assert "comes as" not in capsys.readouterr().err  # one server's capture: nothing to warn about
    w = CaptureWriter(tmp_path / "cap", "1", buffer_bytes=0)
    rec = ChunkRecorder(w, "send", "0->1", _kind, ctx_of=lambda p: p)
    rec.record("other", {"embed": {"prefill": torch.zeros(41, 8, dtype=torch.bfloat16)}}, 2_000_000, source=40)
    rec.record("other", {"embed": {"decode": torch.zeros(1, 8, dtype=torch.float16)}}, 2_001_000)
    w.close()
    assert main(["trace", str(tmp_path / "cap")]) == 0
    err = capsys.readouterr().err
    assert "key embed.prefill comes as bfloat16 rows [16], bfloat16 rows [8]" in err
    assert "key embed.decode comes as bfloat16 rows [16], float16 rows [8]" in err
    assert main(["trace", str(tmp_path / "cap"), "--json"]) == 0
    assert any("embed.prefill comes as" in w for w in json.loads(capsys.readouterr().out)["warnings"])


def test_a_capture_folder_of_another_user_says_whose_it_is_to_read(tmp_path, capsys, monkeypatch):
    """The usual case (0700, the serving user's) read "error: Permission denied: DIR", exit 1. (As root nothing is
    denied, so the refusal is simulated.)"""
    import pathlib

    write_capture(tmp_path / "cap")
    real = pathlib.Path.iterdir

    def denied(self):
        if self == tmp_path / "cap":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(pathlib.Path, "iterdir", denied)
    assert main(["trace", str(tmp_path / "cap")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot list the folder (permission denied)" in err[0] and "read it as that user" in err[0]
    assert main(["tune", "--trace", str(tmp_path / "cap"), "--out", str(tmp_path / "t.yaml")]) == 2


def test_a_capture_of_another_record_version_is_one_line_and_long_lists_say_how_many_more(tmp_path, capsys):
    write_capture(tmp_path / "cap")
    f = next((tmp_path / "cap").glob("capture-*.jsonl"))
    lines = f.read_text().splitlines()
    f.write_text("\n".join(ln.replace('"v":1,', '"v":2,') for ln in lines) + "\n")
    assert main(["trace", str(tmp_path / "cap")]) == 2
    out = capsys.readouterr().out
    assert f"lines 1-{len(lines)}: record version 2: this omni-accum reads version 1" in out and "0 records" in out
    mixed = [ln.replace('"v":1,', '"v":2,') if i in (0, 1, 3) else ln for i, ln in enumerate(lines)]
    f.write_text("\n".join(mixed) + "\n")
    main(["trace", str(tmp_path / "cap")])
    out = capsys.readouterr().out
    assert "lines 1-2: record version 2" in out and "line 4: record version 2" in out  # runs, not across good lines
    f.write_text("\n".join(["{"] * 12 + lines) + "\n")
    assert main(["trace", str(tmp_path / "cap")]) == 0
    out = capsys.readouterr().out
    assert "... and 2 more (trace --json lists them all)" in out and f"{len(lines)} records" in out


def test_resume_names_the_capture_when_it_changed(tmp_path, capsys):
    """It said "--workload: the content of 'trace 0->1' changed" for a run given no --workload."""
    write_capture(tmp_path / "cap", requests=4, decode=12)
    out = tmp_path / "t.yaml"
    args = ["tune", "--trace", str(tmp_path / "cap"), "--out", str(out), "--quick", "--max-rounds", "1", "--no-progress"]
    assert main(args) == 0
    write_capture(tmp_path / "cap2", requests=6, decode=12)
    for f in (tmp_path / "cap2").glob("capture-*"):
        f.replace(tmp_path / "cap" / f.name.replace("capture-0-", "capture-9-"))
    capsys.readouterr()
    assert main([*args, "--resume"]) == 2  # a complete file this run would not reuse: left untouched
    err = capsys.readouterr().err
    assert "--trace: the capture (trace 0->1) changed since" in err and "--workload" not in err, err


def _cli(*argv: str) -> subprocess.CompletedProcess:
    """The command in a process of its own, bounded: a reader that opens a FIFO blocks for ever."""
    return subprocess.run([sys.executable, "-m", "omni_accum.cli", *argv], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)


def test_a_fifo_named_like_a_capture_file_is_never_opened(tmp_path):
    """`trace FIFO`, `trace DIR` and `bench --trace DIR` with a FIFO named capture-*.jsonl there blocked for ever."""
    only = tmp_path / "only"
    only.mkdir()
    fifo = only / "capture-0-1.0.jsonl"
    os.mkfifo(fifo)
    r = _cli("trace", str(fifo))  # named on the command line: refused
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"omni-accum trace: error: {fifo}: is a FIFO, not a regular file; give a capture " \
        "folder or a capture file (capture-*.jsonl)"
    r = _cli("bench", "--trace", str(fifo))
    assert r.returncode == 2 and f"{fifo}: is a FIFO, not a regular file" in r.stderr and "Traceback" not in r.stderr
    r = _cli("bench", "--trace", str(only), "--arms", "cat", "--repeats", "1", "--no-progress")  # in a folder: skipped
    assert r.returncode == 2 and f"skipped {fifo}: is a FIFO, not a regular file: not read" in r.stderr, r.stderr
    assert "the capture holds no complete record to replay" in r.stderr and "Traceback" not in r.stderr
    write_capture(tmp_path / "cap")
    os.mkfifo(tmp_path / "cap" / fifo.name)
    r = _cli("trace", str(tmp_path / "cap"))  # the other files are read, the FIFO listed with the skipped lines
    assert r.returncode == 0, r.stderr
    assert f"{tmp_path / 'cap' / fifo.name}: is a FIFO, not a regular file: not read" in r.stdout
    assert "capture: 1 file(s)" in r.stdout and "Traceback" not in r.stderr


def test_a_capture_file_named_twice_is_read_once(tmp_path, capsys):
    """`trace cap cap` (or the folder and a file in it) counted every record twice: "2 file(s)", chunks doubled."""
    counts = write_capture(tmp_path / "cap")
    cap = tmp_path / "cap"
    (f,) = cap.glob("capture-*.jsonl")
    assert main(["trace", str(cap), "--json"]) == 0
    once = json.loads(capsys.readouterr().out)
    for argv in ([str(cap), str(cap)], [str(cap), str(f)], [str(f), f"{tmp_path}/./cap/{f.name}"]):
        assert main(["trace", *argv, "--json"]) == 0
        out, err = capsys.readouterr()
        data = json.loads(out)
        assert len(data["files"]) == 1 and data["pairs"]["0->1"]["chunks"] == counts["chunks"]
        assert data["pairs"] == once["pairs"]
        assert err.strip() == f"omni-accum trace: note: {f} named more than once: read once", err


def test_a_record_with_an_infinite_or_nan_number_is_skipped_and_trace_json_prints_only_json(tmp_path, capsys,
                                                                                        monkeypatch):
    """A record with "handoff_s": Infinity (json.loads reads it) was used: trace --json printed "max_s": Infinity,
    which is not JSON. Such a record is skipped with its reason; --json never prints a non-finite number."""
    w = CaptureWriter(tmp_path / "cap", "1", buffer_bytes=0)
    rec = ChunkRecorder(w, "recv", "0->1", _kind)
    for i in range(4):
        rec.record("r", {"embed": {"decode": torch.zeros(1, D)}}, 1_000_000 + i * 1000, handoff_s=0.25)
    w.close()
    lines = w.path.read_text().splitlines()
    lines[1] = lines[1].replace('"handoff_s":0.250000', '"handoff_s":Infinity')
    lines[2] = lines[2].replace('"dt":1000e-6', '"dt":NaN')
    lines[3] = lines[3].replace('"t":1003000e-6', '"t":-1e400')
    w.path.write_text("\n".join(lines) + "\n")
    assert main(["trace", str(tmp_path / "cap"), "--json"]) == 0
    out = capsys.readouterr().out

    def refuse(name):
        raise AssertionError(f"{name} in trace --json")

    data = json.loads(out, parse_constant=refuse)
    assert data["records"] == 1 and data["pairs"]["0->1"]["handoff"]["first_chunk"]["max_s"] == 0.25
    assert data["skipped"] == [f"{w.path}, line 2: field 'handoff_s': invalid value inf",
                               f"{w.path}, line 3: field 'dt': invalid value nan",
                               f"{w.path}, line 4: field 't': invalid value -inf"]
    from omni_accum.capture import summary

    real = summary.summarize
    monkeypatch.setattr(summary, "summarize", lambda *a: {**real(*a), "records": float("inf")})
    assert main(["trace", str(tmp_path / "cap"), "--json"]) == 2  # the guard: an error, never invalid JSON
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"omni-accum trace: error: {tmp_path / 'cap'}: the summary cannot be printed "
                                        "as JSON (Out of range float values are not JSON compliant"), err
