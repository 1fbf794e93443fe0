"""``omni-accum bench --wire arena``'s two processes: one receiving process for a run's buckets, an arm that
fails given up with its error while the other arms and buckets go on, a receiver that died replaced at the next
bucket. Without vllm-omni: the ``arena`` arm needs none, and the ``shm`` arm fails on the sending side before
the receiver is asked for it."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import re
import textwrap
import threading

import pytest

from omni_accum.arena import pairbench, pairrecv, path_for, sweep_stale
from omni_accum.arena.region import PREFIX
from omni_accum.bench.workloads import load_workload

WL = load_workload("qwen3-omni-seed")


def _regions(prefix: str) -> list[str]:
    """The arena regions whose names start with ``prefix`` (in the per-user private folder)."""
    folder = path_for("x").parent
    return sorted(p.name[len(PREFIX) :] for p in folder.glob(f"{PREFIX}{prefix}*"))


def _no_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    real = pairbench.connector

    def connector(arm, *a):
        if arm == "shm":
            raise ImportError("No module named 'vllm_omni' (this test's stand-in)")
        return real(arm, *a)

    monkeypatch.setattr(pairbench, "connector", connector)


def test_one_receiver_for_every_bucket_and_a_failed_arm_is_given_up_alone(monkeypatch):
    _no_shm(monkeypatch)
    rxp = pairrecv.ReceiverProcess(spin=False)
    try:
        buckets = [pairbench.run_pair(WL, 64, c, repeats=1, arms=("arena", "shm"), receiver=rxp) for c in (1, 2)]
        assert rxp.started == 1  # the second bucket went to the same process
        pid = rxp.proc.pid
        for rows, c in zip(buckets, (1, 2)):
            arena, shm = rows
            assert (arena.arm, arena.concurrency, arena.error, arena.mismatch) == ("arena", c, None, None)
            assert len(arena.totals_us) == c and arena.prefill_us and all(x > 0 for x in arena.totals_us)
            assert shm.error == "ImportError: No module named 'vllm_omni' (this test's stand-in)"
            assert not shm.prefill_us and not shm.totals_us
            table = pairbench.format_pair_table(rows)
            (arena_line,) = [x for x in table.splitlines() if " arena " in x]
            assert arena_line.rstrip().endswith("yes") and not re.search(r"\d\.\d{3}x", arena_line)  # no ratio to a failed row
            assert "ERROR ImportError: No module named 'vllm_omni'" in table
        assert _regions(f"bench_{os.getpid()}_") == [f"bench_{os.getpid()}_64_2"]  # the last bucket's, held
        # a receiver that died is replaced at the next bucket, and a step asked of a dead one fails that arm
        rxp.proc.kill()
        rxp.proc.join(10)
        with pytest.raises(pairrecv.ArmFailed, match=r"the receiver process ended \(exit status -9\)"):
            rxp.ask("begin", "arena")
        (arena,) = pairbench.run_pair(WL, 64, 1, repeats=1, arms=("arena",), receiver=rxp)
        assert arena.error is None and arena.mismatch is None and arena.totals_us
        assert rxp.started == 2 and rxp.proc.pid != pid
    finally:
        rxp.close()
    assert rxp.proc is None
    assert not _regions(f"bench_{os.getpid()}_")  # this run's regions (named after its pid)


def test_the_receiver_answers_an_error_and_goes_on():
    """An error in a step or before any bucket is answered ``("error", message)`` and the process serves the
    next command; ``quit`` closes the bucket's arena."""
    here, there = mp.Pipe()
    t = threading.Thread(target=pairrecv.receiver_main, args=(there,), daemon=True)
    t.start()
    assert here.recv() == "ready"
    here.send(("begin", "arena"))
    assert here.recv() == ("error", "RuntimeError: 'begin' before any bucket")
    name = f"bench_{os.getpid()}_thread"
    here.send(("bucket", WL, 64, 1, name, 8 << 20))
    assert here.recv() == "ok"
    assert _regions(name) == [name]
    here.send(("step", "shm", "r", 0, False, "r_0_0"))  # an arm never begun: its connector is missing
    assert here.recv() == ("error", "KeyError: 'shm'")
    here.send(("begin", "arena"))
    assert here.recv() == "ok"
    here.send(("bucket", WL, 64, 2, name + "_2", 8 << 20))  # the next bucket: the last one let go first
    assert here.recv() == "ok"
    assert _regions(name) == [name + "_2"]
    gc.collect()
    assert [b.name for b in gc.get_objects() if isinstance(b, pairrecv._Bucket)] == [name + "_2"]
    here.send(("quit",))
    t.join(30)
    assert not t.is_alive()
    assert not _regions(name)


def test_a_step_that_fails_on_the_receiving_side_gives_that_arm_up_and_the_next_bucket_reads_right(monkeypatch):
    """The receiver answers a step with an error (here: a chunk index past the stream's end): the arm is given
    up with the receiver's message and no times, and the same process serves the next bucket with every reply
    matched to its command."""
    _no_shm(monkeypatch)
    rxp = pairrecv.ReceiverProcess(spin=False)
    real_ask = rxp.ask
    steps = []

    def ask(*cmd):
        if cmd[0] == "step" and cmd[1] == "arena":
            steps.append(cmd)
            if len(steps) == 3 * len(pairbench.chunk_plans(WL, 64)):  # round 2 (timed), its first step
                cmd = (*cmd[:5], cmd[5].rsplit("_", 1)[0] + "_99999")
        return real_ask(*cmd)

    monkeypatch.setattr(rxp, "ask", ask)
    try:
        arena, shm = pairbench.run_pair(WL, 64, 1, repeats=3, arms=("arena", "shm"), receiver=rxp)
        assert arena.error == "receiver: IndexError: list index out of range"
        assert (arena.prefill_us, arena.decode_us, arena.totals_us) == ([], [], [])
        assert shm.error.startswith("ImportError")
        table = pairbench.format_pair_table([arena, shm])
        assert [line.split()[3:5] for line in table.splitlines()[1:]] == [["arena", "-"], ["shm", "-"]]
        monkeypatch.setattr(rxp, "ask", real_ask)
        (again,) = pairbench.run_pair(WL, 64, 2, repeats=1, arms=("arena",), receiver=rxp)
        assert again.error is None and again.mismatch is None and len(again.totals_us) == 2
        assert rxp.started == 1
    finally:
        rxp.close()


def test_a_receiver_that_cannot_start_is_every_arms_error_and_the_run_still_writes_its_json(monkeypatch, tmp_path, capsys):
    """The receiving process dies before it is ready (here its entry point exits at once): every arm of every
    bucket says so, the run exits 1 and ``--json`` holds the buckets, each start tried again at the next one."""
    import json
    import sys

    from omni_accum.cli.main import main

    monkeypatch.setattr(pairrecv, "receiver_main", sys.exit)  # spawned by reference: the child calls sys.exit
    out_json = tmp_path / "arena.json"
    rc = main(["bench", "--wire", "arena", "--workload", "qwen3-omni-seed", "--context-lens", "64",
               "--concurrency", "1", "2", "--repeats", "1", "--json", str(out_json)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 1, out
    doc = json.loads(out_json.read_text())
    assert [(b["context_len"], b["concurrency"]) for b in doc["buckets"]] == [(64, 1), (64, 2)]
    errors = {a["error"] for b in doc["buckets"] for a in b["arms"]}
    assert errors == {"the receiver process did not start (exit status 1)"}, errors
    assert out.count("ERROR the receiver process did not start") == 6, out
    assert not _regions(f"bench_{os.getpid()}_")


def test_without_vllm_omni_the_connector_arms_say_what_they_need_and_the_arena_arm_is_measured(monkeypatch):
    """vllm-omni not importable in the sending process: the two connector arms are given up there, each naming
    what it needs and how to install it; the arena arm runs."""
    import sys

    for name in [m for m in sys.modules if m == "vllm_omni" or m.startswith("vllm_omni.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm_omni", None)  # an import of it raises ImportError
    for name in [m for m in sys.modules if m.startswith("omni_accum.integrations.vllm_omni.arena_connector")]:
        monkeypatch.delitem(sys.modules, name)
    arena, conn, shm = pairbench.run_pair(WL, 64, 1, repeats=1)
    assert arena.error is None and arena.mismatch is None and arena.totals_us
    assert conn.error.startswith("VllmOmniUnavailable: the connector arm (OmniAccumArenaConnector) needs vllm-omni")
    assert shm.error.startswith("VllmOmniUnavailable: the shm wire needs vllm-omni")
    assert all("pip install 'omni-accum[vllm]'" in r.error for r in (conn, shm))


def _children(pid: int) -> set[int]:
    out = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out.update(int(x) for x in f.read().split())
    return out


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended
    except FileNotFoundError:
        return True


def test_ctrl_c_keeps_the_finished_buckets_and_ends_the_receiver_without_a_traceback(tmp_path):
    """Ctrl-C in a terminal (SIGINT to the whole process group) during the second bucket: exit 130, the first
    bucket written to ``--json`` with ``complete: false``, no traceback from either process, and the receiving
    process gone (it ignores the SIGINT; the sender ends it)."""
    import json
    import signal
    import subprocess
    import sys
    import time

    out_json = tmp_path / "arena.json"
    # the second bucket's first round waits (until the interrupt) once the bucket is set up on both sides, and
    # says so: the signal lands there whatever the machine's speed
    # and SIGINT is Python's own, as under a user's shell: a script's background job (the suite's lanes) starts
    # with it ignored, and a process that inherits that never sees the interrupt
    code = textwrap.dedent("""
        import signal, sys, time
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.modules["vllm_omni"] = None  # the connector arms fail at once: no vllm-omni import
        from omni_accum.arena import pairbench
        real = pairbench._round
        def waiting(rxp, b, *a):
            if b.context_len == 128:
                print("second bucket set up", flush=True)
                time.sleep(600)
            return real(rxp, b, *a)
        pairbench._round = waiting
        from omni_accum.cli.main import main
        sys.exit(main(sys.argv[1:]))
    """)
    proc = subprocess.Popen(
        [sys.executable, "-u", "-c", code, "bench", "--wire", "arena", "--workload", "qwen3-omni-seed",
         "--context-lens", "64", "128", "--concurrency", "1", "--repeats", "1", "--json", str(out_json)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("second bucket set up"):
                break
        else:
            pytest.fail("".join(seen) + proc.stderr.read())
        assert any(x.startswith("64 x c1") and " arena " in x for x in seen), seen  # the first bucket's table
        kids = _children(proc.pid)
        assert kids, "no receiving process"
        os.killpg(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # a failure: the group killed, and the regions its processes held removed
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            time.sleep(0.5)  # the receiver's exit after its parent's
            sweep_stale()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "omni-accum bench: wrote" in err and "with the 1 bucket(s) finished before the interrupt" in err, err
    assert "128 x c1" not in rest  # the second bucket did not finish
    doc = json.loads(out_json.read_text())
    assert (doc["complete"], doc["stopped"]) == (False, "interrupted")
    assert [(b["context_len"], b["concurrency"]) for b in doc["buckets"]] == [(64, 1)]
    for _ in range(300):  # up to ~30 s for the receiver and multiprocessing's resource tracker to end
        if all(_gone(k) for k in kids):
            break
        time.sleep(0.1)
    assert all(_gone(k) for k in kids), [k for k in kids if not _gone(k)]
    assert not _regions(f"bench_{proc.pid}_")
