"""End-to-end harness: a real three-stage Qwen3-Omni vllm-omni server on CPU, arm by arm.

    bash benchmarks/e2e/setup_env.sh
    benchmarks/e2e/.work/venv/bin/python benchmarks/e2e/build_model.py
    benchmarks/e2e/.work/venv/bin/python benchmarks/e2e/run.py --smoke
    benchmarks/e2e/.work/venv/bin/python benchmarks/e2e/run.py --arms off,default,qwen3-omni \\
        --input-len 8000 --output-len 100 --concurrency 1 --json out/e2e.json

For each arm (``off``: ``OMNI_ACCUM_VLLM_OMNI=0``; ``default`` / ``qwen3-omni`` / any policy file:
``OMNI_ACCUM_POLICY=<arm>``) it starts ``vllm-omni serve`` on 127.0.0.1 (a free port, its own
process group), waits for readiness, sends two temperature-0 chat requests with audio output
(the correctness probes, on the fresh server), runs vLLM's benchmark client (``vllm bench serve
--omni``, random dataset) once per concurrency, lists the server's processes, reads omni-accum's per-process status
files (``OMNI_ACCUM_STATUS_DIR``, a fresh folder per arm) and its log lines, scrapes ``/metrics``
(``PROMETHEUS_MULTIPROC_DIR``, a fresh folder per arm, so the stage processes' counters are there)
for what omni-accum counted (chunks, wire bytes, bytes kept off the wire, fallbacks), stops the server by
process group and checks nothing is left (no process, port free). Then it prints one table
(E2EL, TTFT, TPOT, ITL p50/p99, audio TTFP, audio RTF per arm, ratio to ``off``), compares the
correctness outputs (``default`` must equal ``off`` byte for byte) and writes ``--json``.

Only one server runs at a time. Exit status: 0 when every arm started, answered with text and
audio, and was cleaned up, and ``default`` equals ``off`` when both ran; 1 otherwise.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORK = HERE / ".work"
DEFAULT_MODEL = WORK / "model"
DEFAULT_DEPLOY = HERE / "configs" / "qwen3_omni_cpu.yaml"
VENV_BIN = Path(sys.executable).parent
PERCENTILE_METRICS = "ttft,tpot,itl,e2el,audio_ttfp,audio_rtf"
SMOKE_PROMPT = "Say hello to the world."
# The correctness probes: a short prompt and a longer one (a few hundred tokens of prefill payload).
PROBE_PROMPTS = (
    SMOKE_PROMPT,
    "Summarise the following, then read it aloud. " + " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(24)),
)

INSTALLED_RE = re.compile(r"omni-accum installed into vllm-omni.*?\bpid=(\d+)")
BOUND_RE = re.compile(r"omni-accum bound to.*?\bpid=(\d+)")
TITLE_RE = re.compile(r"process=([^,)]+)")


def log(msg: str) -> None:
    print(f"[e2e] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def proc_info(pid: int) -> dict[str, Any] | None:
    """pid, ppid, sid, state, start ticks, comm and title (``/proc/PID/cmdline``) of one process."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    rp = stat.rfind(")")
    comm = stat[stat.find("(") + 1 : rp]
    rest = stat[rp + 2 :].split()
    cmdline = (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ").strip()
    status = _read(f"/proc/{pid}/status") or ""
    m = re.search(r"VmRSS:\s+(\d+) kB", status)
    pss = re.search(r"^Pss:\s+(\d+) kB", _read(f"/proc/{pid}/smaps_rollup") or "", re.M)
    return {
        "pid": pid,
        "ppid": int(rest[1]),
        "pgid": int(rest[2]),
        "sid": int(rest[3]),
        "state": rest[0],
        "start": int(rest[19]),
        "comm": comm,
        "title": cmdline,
        "rss_mb": round(int(m.group(1)) / 1024, 1) if m else None,
        "pss_mb": round(int(pss.group(1)) / 1024, 1) if pss else None,
    }


SHM = Path("/dev/shm")
# The OpenAI chat endpoint names its requests chatcmpl-<hex>; the connector keys start with the request id.
OUR_LOCKFILE_PREFIX = "shm_chatcmpl-"


def shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def shm_cleanup(before: set[str]) -> dict[str, Any]:
    """/dev/shm entries that appeared during the arm. vllm-omni's SharedMemoryConnector leaves an empty
    ``shm_<request>_..._lockfile.lock`` per chunk key behind; those (empty, new, and keyed by one of
    this server's request ids, ``chatcmpl-...``) are removed. Other new entries are only reported:
    /dev/shm is shared with whatever else runs on the machine (other test runs' connector keys)."""
    new = sorted(shm_entries() - before)
    removed, left = 0, []
    for name in new:
        f = SHM / name
        try:
            if name.startswith(OUR_LOCKFILE_PREFIX) and name.endswith("_lockfile.lock") and f.stat().st_size == 0:
                f.unlink()
                removed += 1
                continue
        except OSError:
            pass
        left.append(name)
    return {"new": len(new), "removed_empty_lockfiles": removed, "left": left[:50], "left_count": len(left)}


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def server_processes(root: int) -> list[dict[str, Any]]:
    """Every live process of the server: its session / process group (it is a session leader) and
    any descendant that left it."""
    infos = {pid: i for pid in all_pids() if (i := proc_info(pid)) is not None}
    members = {pid for pid, i in infos.items() if i["sid"] == root or i["pgid"] == root or pid == root}
    grew = True
    while grew:
        grew = False
        for pid, i in infos.items():
            if pid not in members and i["ppid"] in members:
                members.add(pid)
                grew = True
    return sorted((infos[p] for p in members if infos[p]["state"] != "Z"), key=lambda i: i["pid"])


def alive(info: dict[str, Any]) -> bool:
    """The very process recorded (same pid and start time) still exists and is not a zombie."""
    now = proc_info(info["pid"])
    return now is not None and now["start"] == info["start"] and now["state"] != "Z"


def role_of(info: dict[str, Any], by_pid: dict[int, dict[str, Any]] | None = None) -> str:
    t = info["title"]
    m = re.search(r"StageEngineCoreProc_stage(\d+)", t)
    if m:
        return f"stage{m.group(1)} engine-core"
    if "Worker" in t or "Worker" in info["comm"]:
        parent = (by_pid or {}).get(info["ppid"])
        pm = re.search(r"StageEngineCoreProc_stage(\d+)", parent["title"]) if parent else None
        return f"stage{pm.group(1)} worker" if pm else "worker"
    if "vllm-omni serve" in t or "vllm serve" in t:
        return "api-server"
    if "resource_tracker" in t:
        return "mp resource tracker"
    return "other"


# --------------------------------------------------------------------------------------------------
# http


def http_json(method: str, url: str, body: Any = None, timeout: float = 600) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before it was ready")
        with contextlib.suppress(OSError, ValueError):
            code, _ = http_json("GET", base + "/health", timeout=5)
            if code == 200:
                code, models = http_json("GET", base + "/v1/models", timeout=10)
                if code == 200:
                    return time.monotonic() - t0
        time.sleep(2)
    raise TimeoutError(f"server not ready after {timeout:.0f} s")


_SAMPLE_RE = re.compile(r'^(omni_accum_[a-z_]+?)(?:\{(.*)\})?\s+([-+0-9.eEinfNa]+)$')
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# metric -> (report field, the label it is summed by)
_BY_LABEL = {
    "omni_accum_chunks_total": ("chunks", "role"),
    "omni_accum_wire_bytes_total": ("wire_bytes", "role"),
    "omni_accum_fallbacks_total": ("fallbacks", "reason"),
    "omni_accum_requests_total": ("requests", "role"),
}


def scrape_metrics(base: str, timeout: float = 30) -> dict[str, Any]:
    """omni-accum's samples on the server's ``/metrics`` (Prometheus text format), summed by what an
    operator reads: chunks and wire bytes per role, bytes kept off the wire, fallbacks per reason,
    requests per role, the policy-info label sets, and the raw ``omni_accum_*`` lines."""
    req = urllib.request.Request(base + "/metrics", method="GET")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode(errors="replace")
    out: dict[str, Any] = {
        "chunks": {}, "wire_bytes": {}, "bytes_saved": 0.0, "fallbacks": {}, "requests": {},
        "merge_count": 0.0, "policy_info": [], "lines": [],
    }  # fmt: skip
    for line in text.splitlines():
        m = _SAMPLE_RE.match(line.strip())
        if not m:
            continue
        out["lines"].append(line.strip())
        name, labels, value = m.group(1), dict(_LABEL_RE.findall(m.group(2) or "")), float(m.group(3))
        if name in _BY_LABEL:  # summed per one label
            field_, label = _BY_LABEL[name]
            by = out[field_]
            by[labels.get(label, "?")] = by.get(labels.get(label, "?"), 0.0) + value
        elif name == "omni_accum_wire_bytes_saved_total":
            out["bytes_saved"] += value
        elif name == "omni_accum_merge_seconds_count":
            out["merge_count"] += value
        elif name == "omni_accum_policy_info" and value:
            out["policy_info"].append(labels)
    return out


def print_metrics(arm: str, m: dict[str, Any] | None) -> None:
    if not m:
        return
    if "error" in m:
        print(f"[{arm}] /metrics: {m['error']}")
        return
    fmt = lambda d: ", ".join(f"{k} {v:.0f}" for k, v in sorted(d.items())) or "none"  # noqa: E731
    print(
        f"[{arm}] /metrics (omni-accum, every server process): chunks {fmt(m['chunks'])}; "
        f"wire bytes {fmt(m['wire_bytes'])}; bytes kept off the wire {m['bytes_saved']:.0f}; "
        f"requests {fmt(m['requests'])}; fallbacks {fmt(m['fallbacks'])}; merges timed {m['merge_count']:.0f}; "
        f"policies {sorted({(p.get('source'), p.get('fingerprint')) for p in m['policy_info']})}"
    )


# --------------------------------------------------------------------------------------------------
# correctness probe


def chat_with_audio(base: str, model: str, max_tokens: int, timeout: float, prompt: str = SMOKE_PROMPT) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "modalities": ["text", "audio"],
        "return_token_ids": True,
        "stream": False,
    }
    t0 = time.monotonic()
    code, resp = http_json("POST", base + "/v1/chat/completions", body, timeout=timeout)
    out: dict[str, Any] = {"http_status": code, "latency_s": round(time.monotonic() - t0, 3)}
    if code != 200 or not isinstance(resp, dict):
        out["error"] = resp if isinstance(resp, str) else json.dumps(resp)[:2000]
        return out
    texts, token_ids, audio = [], [], b""
    for ch in resp.get("choices") or []:
        msg = ch.get("message") or {}
        a = msg.get("audio")
        if isinstance(a, dict) and a.get("data"):
            audio += base64.b64decode(a["data"])
        if isinstance(msg.get("content"), str) and not (isinstance(a, dict) and msg["content"] == a.get("data")):
            texts.append(msg["content"])
            if isinstance(ch.get("token_ids"), list):
                token_ids.extend(ch["token_ids"])
    text = "".join(texts)
    out.update(
        {
            "text": text,
            "text_token_ids": token_ids or None,
            "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "audio_bytes": len(audio),
            "audio_sha256": hashlib.sha256(audio).hexdigest() if audio else None,
            "usage": resp.get("usage"),
        }
    )
    return out


# --------------------------------------------------------------------------------------------------
# omni-accum coverage


def read_status_dir(path: Path) -> dict[int, dict[str, Any]]:
    """``<pid>.json`` files omni-accum writes when ``OMNI_ACCUM_STATUS_DIR`` is set; {} when none."""
    out: dict[int, dict[str, Any]] = {}
    if not path.is_dir():
        return out
    for f in sorted(path.glob("*.json")):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            out[-len(out) - 1] = {"file": f.name, "error": f"unreadable: {e}"}
            continue
        if not isinstance(data, dict):
            continue
        try:
            pid = int(data.get("pid", f.stem))
        except (TypeError, ValueError):
            continue
        out[pid] = data
    return out


def summarize_status(data: dict[str, Any]) -> dict[str, Any]:
    bindings = data.get("bindings") if isinstance(data.get("bindings"), list) else []
    sent = sum(int(b.get("chunks_sent") or 0) for b in bindings if isinstance(b, dict))
    received = sum(int(b.get("chunks_received") or 0) for b in bindings if isinstance(b, dict))
    return {
        "process": data.get("process"),
        "installed": bool(data.get("installed")),
        "bound": bool(bindings),
        "owners": sorted({str(b.get("owner")) for b in bindings if isinstance(b, dict)}),
        "chunks_sent": sent,
        "chunks_received": received,
        "policy_source": data.get("policy_source"),
    }


def scan_log(path: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return out
    with open(path, errors="replace") as f:
        for line in f:
            for rx, key in ((INSTALLED_RE, "installed"), (BOUND_RE, "bound")):
                m = rx.search(line)
                if m:
                    e = out.setdefault(int(m.group(1)), {"installed": False, "bound": False, "title": None})
                    e[key] = True
                    t = TITLE_RE.search(line)
                    if t and not e["title"]:
                        e["title"] = t.group(1).strip()
    return out


def coverage(procs: list[dict[str, Any]], status: dict[int, dict[str, Any]], logs: dict[int, dict[str, Any]]):
    """One row per server process: role, title, and what omni-accum reported for it."""
    rows = []
    seen = set()
    by_pid = {p["pid"]: p for p in procs}
    for p in procs:
        st = status.get(p["pid"])
        lg = logs.get(p["pid"], {})
        s = summarize_status(st) if st and "error" not in st else None
        rows.append(
            {
                "pid": p["pid"],
                "role": role_of(p, by_pid),
                "title": p["title"][:80],
                "rss_mb": p.get("rss_mb"),
                "status_file": s is not None,
                "installed": s["installed"] if s else bool(lg.get("installed")),
                "bound": s["bound"] if s else bool(lg.get("bound")),
                "chunks_sent": s["chunks_sent"] if s else None,
                "chunks_received": s["chunks_received"] if s else None,
                "owners": s["owners"] if s else [],
                "log_installed": bool(lg.get("installed")),
                "log_bound": bool(lg.get("bound")),
            }
        )
        seen.add(p["pid"])
    # Processes that reported but were not in the listing (e.g. gone before the snapshot).
    for pid in sorted(set(status) | set(logs)):
        if pid in seen or pid < 0:
            continue
        st, lg = status.get(pid), logs.get(pid, {})
        s = summarize_status(st) if st else None
        rows.append(
            {
                "pid": pid,
                "role": "unlisted",
                "title": (s or {}).get("process") or lg.get("title") or "?",
                "rss_mb": None,
                "status_file": s is not None,
                "installed": s["installed"] if s else bool(lg.get("installed")),
                "bound": s["bound"] if s else bool(lg.get("bound")),
                "chunks_sent": s["chunks_sent"] if s else None,
                "chunks_received": s["chunks_received"] if s else None,
                "owners": s["owners"] if s else [],
                "log_installed": bool(lg.get("installed")),
                "log_bound": bool(lg.get("bound")),
            }
        )
    return rows


def print_coverage(arm: str, rows: list[dict[str, Any]], status_files: int, disabled: bool = False) -> None:
    print(f"\n[{arm}] server processes and omni-accum (status files: {status_files})")
    if disabled:
        print("  omni-accum disabled in this arm (OMNI_ACCUM_VLLM_OMNI=0): nothing should install")
    elif not status_files:
        print("  no omni-accum status files were written (OMNI_ACCUM_STATUS_DIR unsupported by this omni-accum,")
        print("  or nothing installed); installed/bound below come from the server log lines only")
    print(f"  {'pid':>7} {'role':<20} {'rss MB':>7} {'inst':>5} {'bound':>5} {'sent':>6} {'recv':>6}  title")
    for r in rows:
        yn = lambda b: "yes" if b else "no"  # noqa: E731
        cnt = lambda v: "-" if v is None else str(v)  # noqa: E731
        print(
            f"  {r['pid']:>7} {r['role']:<20} {cnt(r['rss_mb']):>7} {yn(r['installed']):>5} {yn(r['bound']):>5} "
            f"{cnt(r['chunks_sent']):>6} {cnt(r['chunks_received']):>6}  {r['title']}"
        )


# --------------------------------------------------------------------------------------------------
# benchmark client


def run_bench(base: str, model: str, args, concurrency: int, out_dir: Path, env: dict[str, str], logf) -> dict:
    num = args.num_prompts if args.num_prompts else max(4, 2 * concurrency)
    fname = f"bench-c{concurrency}.json"
    cmd = [
        str(VENV_BIN / "vllm"), "bench", "serve", "--omni",
        "--backend", "openai-chat-omni", "--endpoint", "/v1/chat/completions",
        "--base-url", base, "--model", model, "--tokenizer", model,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(num), "--max-concurrency", str(concurrency), "--seed", str(args.seed),
        "--percentile-metrics", PERCENTILE_METRICS, "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", fname, "--disable-tqdm",
    ]  # fmt: skip
    log(f"benchmark: {' '.join(cmd[1:])}")
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=args.bench_timeout)
    res: dict[str, Any] = {"concurrency": concurrency, "num_prompts": num, "rc": r.returncode,
                           "wall_s": round(time.monotonic() - t0, 1)}  # fmt: skip
    f = out_dir / fname
    if f.exists():
        raw = json.loads(f.read_text())
        res["raw"] = {k: v for k, v in raw.items() if not isinstance(v, list)}
    return res


METRICS = [  # (label, key in vllm bench's result json, unit)
    ("E2EL p50", "p50_e2el_ms", "ms"),
    ("E2EL p99", "p99_e2el_ms", "ms"),
    ("TTFT p50", "p50_ttft_ms", "ms"),
    ("TTFT p99", "p99_ttft_ms", "ms"),
    ("TPOT p50", "p50_tpot_ms", "ms"),
    ("TPOT p99", "p99_tpot_ms", "ms"),
    ("ITL p50", "p50_itl_ms", "ms"),
    ("ITL p99", "p99_itl_ms", "ms"),
    ("audio TTFP p50", "p50_audio_ttfp_ms", "ms"),
    ("audio TTFP p99", "p99_audio_ttfp_ms", "ms"),
    ("audio RTF p50", "p50_audio_rtf", ""),
    ("audio RTF p99", "p99_audio_rtf", ""),
]


def metric(raw: dict[str, Any], key: str) -> float | None:
    v = raw.get(key)
    if v is None and key.startswith("p50_"):
        v = raw.get("median_" + key[4:])
    return float(v) if isinstance(v, (int, float)) else None


def print_table(results: list[dict[str, Any]]) -> None:
    by_c: dict[int, dict[str, dict]] = {}
    for arm in results:
        for b in arm.get("bench") or []:
            by_c.setdefault(b["concurrency"], {})[arm["arm"]] = b.get("raw") or {}
    if not by_c:
        return
    arms = [a["arm"] for a in results]
    for c, per_arm in sorted(by_c.items()):
        print(f"\nconcurrency {c} (ratio: arm / off)")
        head = f"  {'metric':<16}" + "".join(f"{a[:24]:>26}" for a in arms)
        print(head)
        for label, key, unit in METRICS:
            base = metric(per_arm.get("off", {}), key)
            cells = []
            for a in arms:
                v = metric(per_arm.get(a, {}), key)
                if v is None:
                    cells.append(f"{'-':>26}")
                    continue
                s = f"{v:.1f} {unit}".strip() if unit else f"{v:.3f}"
                if base and a != "off":
                    s += f" ({v / base:.2f}x)"
                cells.append(f"{s:>26}")
            print(f"  {label:<16}" + "".join(cells))


# --------------------------------------------------------------------------------------------------
# one arm


@dataclass
class Arm:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    deploy: Path | None = None  # this arm's deploy config (None: --deploy-config)


def make_arm(spec: str) -> Arm:
    """``SPEC`` or ``SPEC@CONFIG``: CONFIG is a deploy YAML path, or NAME for ``configs/qwen3_omni_cpu_NAME.yaml``."""
    if "@" in spec:
        base, _, cfg = spec.partition("@")
        path = Path(cfg) if Path(cfg).exists() else HERE / "configs" / f"qwen3_omni_cpu_{cfg}.yaml"
        if not path.exists():
            raise SystemExit(f"arm {spec!r}: no deploy config {cfg!r} (a path, or NAME of configs/qwen3_omni_cpu_NAME.yaml)")
        arm = make_arm(base)
        arm.name, arm.deploy = spec, path.resolve()
        return arm
    if spec == "off":
        return Arm("off", {"OMNI_ACCUM_VLLM_OMNI": "0"}, ("OMNI_ACCUM_POLICY",))
    if spec in ("default", "qwen3-omni", "qwen3-omni-flat"):
        return Arm(spec, {"OMNI_ACCUM_VLLM_OMNI": "1", "OMNI_ACCUM_POLICY": spec})
    p = Path(spec)
    if p.exists():
        return Arm(spec, {"OMNI_ACCUM_VLLM_OMNI": "1", "OMNI_ACCUM_POLICY": str(p.resolve())})
    # Let omni-accum resolve any other preset name (or refuse it in the server log).
    return Arm(spec, {"OMNI_ACCUM_VLLM_OMNI": "1", "OMNI_ACCUM_POLICY": spec})


def stop_server(proc: subprocess.Popen, known: list[dict[str, Any]], port: int, grace: float) -> dict[str, Any]:
    """SIGTERM the server's process group, wait, SIGKILL what is left (group, then recorded pids)."""
    pgid = proc.pid
    report: dict[str, Any] = {"signals": []}
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
        report["signals"].append("SIGTERM group")
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()
        left = [i for i in known + server_processes(pgid) if alive(i)]
        if proc.returncode is not None and not left:
            break
        time.sleep(1)
    left = {i["pid"]: i for i in known + server_processes(pgid) if alive(i)}
    if left:
        report["signals"].append(f"SIGKILL {sorted(left)}")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        for i in left.values():
            if alive(i):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(i["pid"], signal.SIGKILL)
        time.sleep(2)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    remaining = [i for i in known + server_processes(pgid) if alive(i)]
    for _ in range(20):  # the port may linger a moment after the last process exits
        if port_free(port):
            break
        time.sleep(0.5)
    report.update(
        {
            "exit_status": proc.returncode,
            "left_running": [{"pid": i["pid"], "title": i["title"][:80]} for i in remaining],
            "port_free": port_free(port),
        }
    )
    report["clean"] = not remaining and report["port_free"]
    return report


def run_arm(arm: Arm, args, run_dir: Path) -> dict[str, Any]:
    arm_dir = run_dir / re.sub(r"[^A-Za-z0-9._-]+", "_", arm.name)
    arm_dir.mkdir(parents=True, exist_ok=True)
    status_dir = arm_dir / "omni-accum-status"
    if status_dir.exists():
        for f in status_dir.glob("*"):
            f.unlink()
    status_dir.mkdir(exist_ok=True)
    prom_dir = arm_dir / "prometheus"
    if prom_dir.exists():
        for f in prom_dir.glob("*"):
            f.unlink()
    prom_dir.mkdir(exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k not in arm.unset}
    env.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
            "OMNI_ACCUM_STATUS_DIR": str(status_dir),
            # One folder per arm for every server process's Prometheus values, so that the API server's
            # /metrics shows the stage processes' (vllm-omni with one API server does not set one).
            "PROMETHEUS_MULTIPROC_DIR": str(prom_dir),
            "PATH": f"{VENV_BIN}:{env.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }
    )
    env.update(arm.env)
    # The benchmark client loads vllm-omni's plugins too: keep omni-accum out of it (and out of the
    # status folder, which is for the server's processes).
    server_only = ("OMNI_ACCUM_STATUS_DIR", "OMNI_ACCUM_POLICY", "PROMETHEUS_MULTIPROC_DIR")
    client_env = {k: v for k, v in env.items() if k not in server_only}
    client_env["OMNI_ACCUM_VLLM_OMNI"] = "0"
    server_log = arm_dir / "server.log"
    client_log = arm_dir / "client.log"
    cmd = [
        str(VENV_BIN / "vllm-omni"), "serve", str(args.model), "--omni",
        "--host", "127.0.0.1", "--port", str(port),
        "--deploy-config", str(arm.deploy or args.deploy_config),
        "--stage-init-timeout", str(int(args.start_timeout)),
    ]  # fmt: skip
    result: dict[str, Any] = {
        "arm": arm.name,
        "env": arm.env,
        "port": port,
        "server_cmd": cmd,
        "server_log": str(server_log),
        "status_dir": str(status_dir),
    }
    shm_before = shm_entries()
    log(f"[{arm.name}] starting: {' '.join(cmd)} (env {arm.env}; log {server_log})")
    t0 = time.monotonic()
    known: list[dict[str, Any]] = []
    with open(server_log, "wb") as slog, open(client_log, "ab") as clog:
        proc = subprocess.Popen(cmd, env=env, stdout=slog, stderr=subprocess.STDOUT, start_new_session=True)
        result["server_pid"] = proc.pid
        try:
            result["start_s"] = round(wait_ready(base, proc, args.start_timeout), 1)
            result["started"] = True
            known = server_processes(proc.pid)
            log(f"[{arm.name}] ready in {result['start_s']} s on port {port}, {len(known)} processes")
            probes = []
            for prompt in PROBE_PROMPTS[:1] if args.smoke else PROBE_PROMPTS:
                c = chat_with_audio(base, str(args.model), args.smoke_max_tokens, args.request_timeout, prompt)
                c["prompt_sha256"] = hashlib.sha256(prompt.encode()).hexdigest()[:16]
                probes.append(c)
                log(
                    f"[{arm.name}] chat: HTTP {c.get('http_status')}, prompt {len(prompt)} chars, "
                    f"{(c.get('usage') or {}).get('prompt_tokens')} tokens, text {c.get('text', '')[:40]!r}, "
                    f"audio {c.get('audio_bytes', 0)} bytes sha {str(c.get('audio_sha256'))[:12]}, {c.get('latency_s')} s"
                )
            result["correctness"] = dict(probes[0], probes=probes)
            # The benchmark after the probes: the talker samples (temperature 0.9, seed 42 in the deploy
            # config) and its audio depends on the traffic the server saw before, so the probes run on
            # a fresh server in every arm.
            if not args.smoke:
                result["bench"] = []
                for c in args.concurrency:
                    result["bench"].append(run_bench(base, str(args.model), args, c, arm_dir, client_env, clog))
            time.sleep(1)
            try:  # what omni-accum counted, as an operator's scrape sees it
                result["metrics"] = scrape_metrics(base)
            except Exception as e:  # noqa: BLE001 - a report, not a reason to fail the arm
                result["metrics"] = {"error": f"{type(e).__name__}: {e}"}
            print_metrics(arm.name, result["metrics"])
            snap = {i["pid"]: i for i in known}
            snap.update({i["pid"]: i for i in server_processes(proc.pid)})
            known = sorted(snap.values(), key=lambda i: i["pid"])
            live = [proc_info(i["pid"]) for i in known if alive(i)]
            result["rss_total_mb"] = round(sum(i["rss_mb"] or 0 for i in live if i), 1)
            result["pss_total_mb"] = round(sum(i["pss_mb"] or 0 for i in live if i), 1)
            log(f"[{arm.name}] memory: PSS {result['pss_total_mb']:.0f} MB (RSS sum {result['rss_total_mb']:.0f} MB)")
        except Exception as e:  # noqa: BLE001 - report, then always clean up
            result.setdefault("started", False)
            result["error"] = f"{type(e).__name__}: {e}"
            log(f"[{arm.name}] {result['error']}")
            snap = {i["pid"]: i for i in known}
            snap.update({i["pid"]: i for i in server_processes(proc.pid)})
            known = sorted(snap.values(), key=lambda i: i["pid"])
        finally:
            status_before = read_status_dir(status_dir)
            result["stop"] = stop_server(proc, known, port, args.stop_grace)
            result["stop"]["shm"] = shm_cleanup(shm_before)
            log(f"[{arm.name}] stopped: {result['stop']}")
    result["wall_s"] = round(time.monotonic() - t0, 1)
    status = read_status_dir(status_dir) or status_before  # refreshed at exit; else the last refresh
    logs = scan_log(server_log)
    result["processes"] = [
        {"pid": i["pid"], "ppid": i["ppid"], "comm": i["comm"], "title": i["title"], "rss_mb": i["rss_mb"],
         "pss_mb": i.get("pss_mb"),
         "role": role_of(i, {k["pid"]: k for k in known})}
        for i in known
    ]
    result["status_files"] = len([p for p in status if p > 0])
    result["status_raw"] = {str(k): v for k, v in status.items()}
    result["coverage"] = coverage(known, status, logs)
    print_coverage(arm.name, result["coverage"], result["status_files"], arm.env.get("OMNI_ACCUM_VLLM_OMNI") == "0")
    if args.keep_logs:
        keep = Path(args.keep_logs) / arm_dir.name
        keep.mkdir(parents=True, exist_ok=True)
        for f in (server_log, client_log):
            if f.exists():
                (keep / f.name).write_bytes(f.read_bytes())
    return result


def compare(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each arm's probes against the off arm's: text, text token ids and audio bytes (SHA-256)."""
    by = {r["arm"]: (r.get("correctness") or {}).get("probes") or [] for r in results}
    out: dict[str, Any] = {}
    if "off" not in by or not by["off"]:
        return out
    ref = by["off"]
    for arm, probes in by.items():
        if arm == "off":
            continue
        text_eq = len(probes) == len(ref) and all(
            (a.get("text"), a.get("text_token_ids")) == (b.get("text"), b.get("text_token_ids")) for a, b in zip(probes, ref)
        )
        audio_eq = len(probes) == len(ref) and all(
            a.get("audio_sha256") == b.get("audio_sha256") and b.get("audio_sha256") for a, b in zip(probes, ref)
        )
        out[arm] = {"equals_off": bool(text_eq and audio_eq), "text_equal": text_eq, "audio_equal": bool(audio_eq)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="off,default,qwen3-omni",
                    help="comma-separated: off, default, qwen3-omni, or policy file paths; ARM@CONFIG runs ARM with "
                         "another deploy config (a path, or NAME of configs/qwen3_omni_cpu_NAME.yaml, e.g. off@arena) "
                         "(default %(default)s)")
    ap.add_argument("--input-len", type=int, default=8000)
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--concurrency", default="1", help="comma-separated list (default %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=0, help="per concurrency (default: max(4, 2 x concurrency))")
    ap.add_argument("--seed", type=int, default=0, help="benchmark dataset seed")
    ap.add_argument("--json", dest="json_out", type=Path, help="write every result here")
    ap.add_argument("--keep-logs", type=Path, help="copy each arm's server / client logs here")
    ap.add_argument("--smoke", action="store_true", help="one short chat request with audio per arm (the first probe only), no benchmark client")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--deploy-config", type=Path, default=DEFAULT_DEPLOY)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--bench-timeout", type=float, default=3600.0)
    ap.add_argument("--stop-grace", type=float, default=60.0, help="seconds after SIGTERM before SIGKILL")
    ap.add_argument("--smoke-max-tokens", type=int, default=16, help="thinker max_tokens of the correctness request")
    ap.add_argument("--work-dir", type=Path, default=WORK / "runs", help="per-run folders (logs, status files)")
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    args.model = args.model.resolve()
    args.deploy_config = args.deploy_config.resolve()
    if not (args.model / "config.json").exists():
        ap.error(f"no model at {args.model}: run build_model.py first")
    arms = [make_arm(a.strip()) for a in args.arms.split(",") if a.strip()]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=args.work_dir))
    log(f"run folder {run_dir}")

    results = []
    for arm in arms:
        results.append(run_arm(arm, args, run_dir))
    print_table(results)
    cmp_ = compare(results)
    print("\ncorrectness (temperature-0 chat with audio)")
    for r in results:
        for i, c in enumerate((r.get("correctness") or {}).get("probes") or [{}]):
            print(
                f"  {r['arm'] if i == 0 else '':<24} probe {i}: HTTP {c.get('http_status', '-')}, "
                f"text {c.get('text', '')[:30]!r}, audio {c.get('audio_bytes', 0)} B sha {str(c.get('audio_sha256'))[:12]}"
            )
        if r["arm"] in cmp_:
            print(f"  {'':<24} equals off: {cmp_[r['arm']]}")
    ok = True
    for r in results:
        probes = (r.get("correctness") or {}).get("probes") or [{}]
        if not r.get("started") or any(
            c.get("http_status") != 200 or not c.get("text") or not c.get("audio_bytes") for c in probes
        ):
            ok = False
        if not (r.get("stop") or {}).get("clean"):
            ok = False
    if "default" in cmp_ and not cmp_["default"]["equals_off"]:
        log("FAIL: the default arm differs from off")
        ok = False
    summary = {"ok": ok, "run_dir": str(run_dir), "args": {k: str(v) for k, v in vars(args).items()},
               "arms": results, "comparison": cmp_}  # fmt: skip
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(summary, indent=1, default=str))
        log(f"wrote {args.json_out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
