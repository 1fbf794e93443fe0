"""The e2e harness's watch tools without a server (benchmarks/e2e/e2e_watch.py): the memory sampler on processes
this test starts, the flatness verdict, the data files and the plot's optional extra, the stage killer and its
report, omni-accum's leftovers, the held-load rounds and the new options' usage errors (run.py)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from waiting import poll

from tests.test_e2e_arms import RUN_PY, run, serving_venv  # noqa: F401 - the run.py module fixture

sys.path.insert(0, str(RUN_PY.parent))
import e2e_procs  # noqa: E402
import e2e_watch  # noqa: E402

# a parent (the "server", a session leader) with a child that holds 64 MiB and says so, then both sleep; the
# child's title names stage 1's engine core, as vllm-omni's does
_TREE = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c",
        "import sys, time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); print('held', flush=True); "
        "time.sleep(600)", "VLLM::StageEngineCoreProc_stage" + "1_replica0"], stdout=sys.stdout)
    time.sleep(600)
    """
)


@pytest.fixture
def tree():
    """The process tree of _TREE (its root is a session leader, as run.py starts the server); both killed at
    the end by pid."""
    p = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "held"
        yield p
    finally:
        for i in e2e_procs.server_processes(p.pid):
            try:
                os.kill(i["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def _stage1(root: int) -> dict:
    procs = e2e_procs.server_processes(root)
    hit = e2e_watch.stage_process(procs, 1)
    assert hit is not None, procs
    return hit


def test_the_sampler_records_each_server_process_rss_and_the_folders_bytes(tree, tmp_path):
    private = tmp_path / "omni-accum-x"
    private.mkdir()
    (private / "region").write_bytes(b"\1" * (1 << 20))  # 1 MiB written
    with open(private / "sparse", "wb") as f:
        f.truncate(64 << 20)  # 64 MiB long, nothing written: takes no blocks
    s = e2e_watch.Sampler(tree.pid, 1.0, shm=tmp_path, private=private)
    s.sample()
    s.sample()
    rss = [r for r in s.rows if r["kind"] == "rss"]
    child = _stage1(tree.pid)
    by_pid = {r["pid"]: r for r in rss}
    assert set(by_pid) == {tree.pid, child["pid"]}  # the server's processes: found under its pid
    assert by_pid[child["pid"]]["role"] == "stage1 engine-core"
    assert by_pid[child["pid"]]["bytes"] >= 64 << 20 > by_pid[tree.pid]["bytes"]  # what the child holds
    priv = [r["bytes"] for r in s.rows if r["kind"] == "private_dir"]
    assert priv == [priv[0]] * 2 and 1 << 20 <= priv[0] < 2 << 20  # allocated blocks, not apparent sizes
    assert len([r for r in s.rows if r["kind"] == "dev_shm"]) == 2
    assert e2e_watch.dir_bytes(tmp_path / "none") == 0
    # /dev/shm by group of entries: the private folder is "omni" (its 1 MiB), nothing else is there
    groups = {r["role"]: r["bytes"] for r in s.rows if r["kind"] == "shm_group"}
    assert set(groups) == {"omni"} and groups["omni"] >= 1 << 20
    (tmp_path / "psm_1a2b").write_bytes(b"\2" * (256 << 10))
    (tmp_path / "psm_9f").write_bytes(b"\3" * (256 << 10))
    g = e2e_watch.shm_groups(tmp_path)
    assert set(g) == {"omni", "psm"} and (512 << 10) <= g["psm"] < (1 << 20)
    assert "shm:psm" not in e2e_watch.series(s.rows)
    s.sample()
    assert e2e_watch.series(s.rows)["shm:psm"][0][1] == g["psm"]
    # a fixed-size ring (vLLM's message queues are such files): its size is the most it can take
    with open(tmp_path / "psm_ring", "wb") as f:
        f.truncate(8 << 20)
        f.write(b"\4" * (256 << 10))  # the pages written so far
    used, size = e2e_watch.shm_groups(tmp_path), e2e_watch.shm_groups(tmp_path, apparent=True)
    assert (768 << 10) <= used["psm"] < (2 << 20) and size["psm"] == (8 << 20) + (512 << 10)
    for _ in range(3):
        s.sample()
    flat = e2e_watch.flatness(s.rows)
    assert flat["shm:psm"]["size"] == size["psm"] and flat["shm:psm"]["fill"] == round(used["psm"] / size["psm"], 3)
    assert "size" not in flat["shm:omni"] or flat["shm:omni"]["fill"] <= 1


def test_the_sampler_thread_writes_csv_json_and_says_when_it_cannot_plot(tree, tmp_path, monkeypatch):
    s = e2e_watch.Sampler(tree.pid, 0.05, shm=tmp_path, private=tmp_path / "p").start()
    s.mark("SIGKILL stage1", pid=1)
    assert poll(lambda: len({r["t_s"] for r in s.rows}) >= 3, 120), "the sampler thread took no 3 samples"
    s.stop()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    summary = e2e_watch.Sampler.write(s, tmp_path / "arm")
    assert "matplotlib is not installed" in summary["plot"] and not (tmp_path / "arm" / "memory.png").exists()
    with open(tmp_path / "arm" / "memory.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and set(rows[0]) == set(e2e_watch.Sampler.FIELDS)
    assert {r["kind"] for r in rows} == {"rss", "private_dir", "dev_shm"}
    data = json.loads((tmp_path / "arm" / "memory.json").read_text())
    assert data["events"][0]["event"] == "SIGKILL stage1" and len(data["rows"]) == len(rows)
    assert summary["samples"] >= 3 and set(data["summary"]["flat"]) >= {"private_dir", "dev_shm"}


def test_the_plot_is_drawn_when_matplotlib_is_there(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the plot's optional extra; the data files need none")
    rows = [{"t_s": t, "kind": k, "pid": 7 if k == "rss" else "", "role": "stage1 engine-core" if k == "rss" else "",
             "bytes": 1 << 20} for t in range(5) for k in ("rss", "dev_shm", "private_dir")]  # fmt: skip
    out = e2e_watch.plot({"qwen3-omni@arena": rows}, {"qwen3-omni@arena": [{"t_s": 2, "event": "kill"}]},
                         tmp_path / "m.png")  # fmt: skip
    assert out == str(tmp_path / "m.png") and (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def _rows(values: list[int], kind: str = "dev_shm") -> list[dict]:
    return [{"t_s": 10 * i, "kind": kind, "pid": "", "role": "", "bytes": v} for i, v in enumerate(values)]


def test_flatness_after_the_warm_up():
    mb = 1 << 20
    warm = [0, 500 * mb]  # the warm-up's growth is left out
    flat = e2e_watch.flatness(_rows(warm + [1000 * mb, 1010 * mb, 990 * mb, 1005 * mb, 1000 * mb, 1020 * mb]), 20)
    assert flat["dev_shm"]["flat"] is True and flat["dev_shm"]["samples"] == 6
    grows = e2e_watch.flatness(_rows(warm + [1000 * mb + i * 40 * mb for i in range(8)]), 20)["dev_shm"]
    assert grows["flat"] is False and grows["growth"] == 240 * mb  # medians of the first and last quarter
    assert e2e_watch.flatness(_rows(warm + [1, 2]), 20)["dev_shm"]["flat"] is None  # too few samples to tell
    assert e2e_watch.flatness(_rows(warm + [500 * mb] * 6), 0)["dev_shm"]["flat"] is False  # warm-up counted: grows


def test_the_killer_sigkills_the_stage_and_the_report_says_what_followed(tree, tmp_path):
    log = tmp_path / "server.log"
    log.write_text("ERROR before the kill: not reported\n")
    target = _stage1(tree.pid)
    marks = []
    k = e2e_watch.StageKiller(e2e_watch.stage_number("talker"), 0.0, lambda: e2e_procs.server_processes(tree.pid),
                              on_kill=marks.append, log_path=log)  # fmt: skip
    rec = k.kill()
    assert rec["killed"] and rec["pid"] == target["pid"] and marks == [rec]
    with open(log, "a") as f:
        f.write("INFO all fine\nERROR stage 1 died unexpectedly\nINFO restarting stage 1\n")
    rep = e2e_watch.fault_report(rec, e2e_procs.server_processes(tree.pid), True, 200, log, [
        {"num_prompts": 8, "raw": {"completed": 6, "failed": 2}, "errors": {"ClientPayloadError": 2}}])  # fmt: skip
    assert rep["killed_process_gone"] and not rep["restarted"] and rep["new_processes"] == []
    assert rep["server_running"] and rep["health"] == 200 and "before" not in rep
    assert rep["log_lines"] == ["ERROR stage 1 died unexpectedly", "INFO restarting stage 1"]
    assert rep["client"] == {"sent": 8, "completed": 6, "failed": 2, "errors": {"ClientPayloadError": 2},
                             "every_request_answered": False}  # fmt: skip
    again = e2e_watch.StageKiller(1, 0.0, lambda: e2e_procs.server_processes(tree.pid)).kill()
    assert not again["killed"] and "no stage1 engine-core process" in again["note"]
    with pytest.raises(ValueError, match="thinker, talker, code2wav"):
        e2e_watch.stage_number("vocoder")
    assert e2e_watch.stage_number("thinker") == 0 and e2e_watch.stage_number("2") == 2


def test_omni_accums_leftovers_are_its_new_entries_only():
    now = {"a", "omni-accum-0", "omni-accum-0/omni_accum_arena_e2e_0_1.live", "shm_chatcmpl-1_lockfile.lock"}
    before = {"a", "omni-accum-0"}
    assert e2e_watch.omni_accum_left(before, lambda: now, wait_s=0) == ["omni-accum-0/omni_accum_arena_e2e_0_1.live"]
    assert e2e_watch.omni_accum_left(now, lambda: now, wait_s=0) == []


def test_fallbacks_and_client_totals():
    before = {"fallbacks": {"arena_full": 2.0, "bind_error": 1.0}}
    after = {"fallbacks": {"arena_full": 5.0, "bind_error": 1.0, "arena_no_space": 1.0}}
    assert e2e_watch.fallbacks_delta(before, after) == {"arena_full": 3.0, "arena_no_space": 1.0}
    assert e2e_watch.fallbacks_delta({"error": "URLError: refused"}, after) == "URLError: refused"
    ok = e2e_watch.client_errors([{"num_prompts": 4, "raw": {"completed": 4, "failed": 0}}] * 3)
    assert ok == {"sent": 12, "completed": 12, "failed": 0, "errors": {}, "every_request_answered": True}


def test_bench_errors_counts_distinct_texts(tmp_path):
    f = tmp_path / "bench.json"
    f.write_text(json.dumps({"errors": ["", "Traceback ...\naiohttp.ClientPayloadError: x", "",
                                       "aiohttp.ClientPayloadError: x", "timeout"]}))  # fmt: skip
    assert e2e_watch.bench_errors(f) == {"aiohttp.ClientPayloadError: x": 2, "timeout": 1}
    assert e2e_watch.bench_errors(tmp_path / "none.json") == {}


def test_duration_holds_the_load_in_rounds_until_the_time_is_up(run, monkeypatch, tmp_path):  # noqa: F811
    clock = iter(range(0, 10_000, 100))  # each look at the clock: 100 s later
    monkeypatch.setattr(run.time, "monotonic", lambda: next(clock))
    calls = []

    def fake_bench(base, model, args, n, c, out_dir, env, logf, round_=0):
        calls.append(round_)
        return {"num_prompts": 8 * c, "rc": 0, "raw": {"completed": 8 * c, "failed": 0}, "errors": {}}

    monkeypatch.setattr(run, "run_bench", fake_bench)
    args = type("A", (), {"duration_s": 250.0})()
    out = run.run_bench_held("b", "m", args, 100, 16, tmp_path, {}, None)
    assert calls == [1, 2, 3] and out["sent"] == out["completed"] == 3 * 128 and out["every_request_answered"]
    args.duration_s = 0.0
    calls.clear()
    run.run_bench_held("b", "m", args, 100, 16, tmp_path, {}, None)
    assert calls == [0]  # one plain run


def test_the_new_options_usage_errors_exit_2(run, capsys, tmp_path, monkeypatch):  # noqa: F811
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(run, "INTERPRETER_BIN", serving_venv(tmp_path / "venv") / "bin")
    model = ["--model", str(tmp_path)]
    for argv, needle in [
        ([*model, "--kill-stage", "vocoder"], "'vocoder': use thinker, talker, code2wav or a stage number"),
        ([*model, "--kill-stage", "talker", "--smoke"], "drop --smoke"),
        ([*model, "--duration-s", "-1"], "--duration-s: -1 is negative"),
        ([*model, "--sample-every-s", "-5"], "--sample-every-s"),
        ([*model, "--idle-spin-s", "-0.5"], "--idle-spin-s: -0.5 is negative"),
    ]:
        with pytest.raises(SystemExit) as e:
            run.main(argv)
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (argv, err)
    with pytest.raises(ValueError, match="more than 0 seconds"):
        e2e_watch.Sampler(1, 0)
    assert Path(e2e_watch.private_dir()).name == f"omni-accum-{os.geteuid()}"


def test_the_sampler_lists_the_processes_again_only_every_relist_s_or_when_one_has_gone(tmp_path):
    """The listing (every process's cmdline and smaps_rollup: slow while a big worker is busy) runs once per
    ``relist_s``; the samples between read the listed processes' RSS only, and a listed process that has
    ended makes the next sample list again."""
    me = {"pid": os.getpid(), "ppid": 0, "title": "me", "comm": "python"}
    dead = {"pid": 2**22 + 7, "ppid": 0, "title": "gone", "comm": "x"}  # above pid_max's default: never alive
    calls = []

    def listing():
        calls.append(1)
        return [me, dead] if len(calls) == 1 else [me]

    s = e2e_watch.Sampler(os.getpid(), 1.0, shm=tmp_path, private=tmp_path / "p", processes=listing, relist_s=3600)
    s.sample()  # lists, finds the dead one gone, lists again once
    assert len(calls) == 2
    for _ in range(3):
        s.sample()
    assert len(calls) == 2 and s.listings == 2
    assert {r["pid"] for r in s.rows if r["kind"] == "rss"} == {os.getpid()}
    s.relist_s = 0.0
    s.sample()
    assert len(calls) == 3
