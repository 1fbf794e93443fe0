"""The e2e harness's server processes: ports, ``/proc`` listings, ``/dev/shm`` clean-up, omni-accum's status
files and log lines (who installed / bound), HTTP readiness, the correctness probe's chat request, and
stopping a server by process group. Used by ``run.py``."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

INSTALLED_RE = re.compile(r"omni-accum installed into vllm-omni.*?\bpid=(\d+)")
BOUND_RE = re.compile(r"omni-accum bound to.*?\bpid=(\d+)")
TITLE_RE = re.compile(r"process=([^,)]+)")


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
    """/dev/shm's entries, and those of omni-accum's private folder there (``omni-accum-<euid>/NAME``, where
    the arena's regions live)."""
    try:
        out = set(os.listdir(SHM))
    except OSError:
        return set()
    private = f"omni-accum-{os.geteuid()}"
    with contextlib.suppress(OSError):
        out |= {f"{private}/{n}" for n in os.listdir(SHM / private)}
    return out


def shm_cleanup(before: set[str]) -> dict[str, Any]:
    """/dev/shm entries that appeared during the arm. vllm-omni's SharedMemoryConnector leaves an empty
    ``shm_<request>_..._lockfile.lock`` per chunk key behind; those (empty, new since ``before`` and keyed by
    a chat request id, ``chatcmpl-...``: this server's, as no other vllm-omni server runs beside the harness's
    one) are removed. Other new entries are only reported: /dev/shm is shared with whatever else runs on the
    machine (other test runs' connector keys)."""
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


# --------------------------------------------------------------------------------------------------
# correctness probe


def chat_with_audio(base: str, model: str, max_tokens: int, timeout: float, prompt: str) -> dict[str, Any]:
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
# omni-accum coverage (status files, log lines)


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
        rows.append(_coverage_row(p["pid"], role_of(p, by_pid), p["title"][:80], p.get("rss_mb"), s, lg))
        seen.add(p["pid"])
    # Processes that reported but were not in the listing (e.g. gone before the snapshot).
    for pid in sorted(set(status) | set(logs)):
        if pid in seen or pid < 0:
            continue
        st, lg = status.get(pid), logs.get(pid, {})
        s = summarize_status(st) if st else None
        title = (s or {}).get("process") or lg.get("title") or "?"
        rows.append(_coverage_row(pid, "unlisted", title, None, s, lg))
    return rows


def coverage_problem(result: dict[str, Any]) -> str | None:
    """Why an arm's server did not run with omni-accum as the arm's name says, from its coverage rows: an arm with
    omni-accum on (``OMNI_ACCUM_VLLM_OMNI=1``) whose stages bound it nowhere ran vllm-omni's own code (a policy the
    stages refused, an activation that declined: the server log says which), and an ``off`` arm must install it
    nowhere. None when it did."""
    rows = result.get("coverage") or []
    on = (result.get("env") or {}).get("OMNI_ACCUM_VLLM_OMNI") != "0"
    if on and not any(r.get("bound") for r in rows):
        return "omni-accum is on in this arm, and no server process bound it (see the server log's omni-accum lines)"
    if not on and any(r.get("installed") for r in rows):
        pids = ", ".join(str(r["pid"]) for r in rows if r.get("installed"))
        return f"omni-accum is off in this arm, and it installed in process {pids}"
    return None


def _coverage_row(pid: int, role: str, title: str, rss_mb: Any, s: dict | None, lg: dict) -> dict[str, Any]:
    """One process's coverage: from its status file (``s``, summarised) where it wrote one, else its log lines."""
    return {
        "pid": pid,
        "role": role,
        "title": title,
        "rss_mb": rss_mb,
        "status_file": s is not None,
        "installed": s["installed"] if s else bool(lg.get("installed")),
        "bound": s["bound"] if s else bool(lg.get("bound")),
        "chunks_sent": s["chunks_sent"] if s else None,
        "chunks_received": s["chunks_received"] if s else None,
        "owners": s["owners"] if s else [],
        "log_installed": bool(lg.get("installed")),
        "log_bound": bool(lg.get("bound")),
    }


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
