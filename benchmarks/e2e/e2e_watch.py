"""While an arm runs: the server's memory over time, a stage process killed on purpose, omni-accum's leftovers.

* :class:`Sampler` records every ``every_s`` seconds the RSS of each process of the server (``VmRSS`` of
  ``/proc/PID/status``; the processes are found under the server's pid: its session, process group and
  descendants, :func:`e2e_procs.server_processes`), the bytes omni-accum's private directory
  (``/dev/shm/omni-accum-<euid>/``) takes and the bytes used in ``/dev/shm`` (what its file system says is in
  use: any user's files). It writes ``memory.csv`` and ``memory.json`` beside the arm's results, and
  :func:`plot` draws ``memory.png`` (matplotlib, optional: without it the data files are written and the
  report says so). :func:`flatness` tells whether each series stays flat after a warm-up.
* :class:`StageKiller` sends SIGKILL to one stage's engine-core process (``thinker``: stage 0, ``talker``: 1,
  ``code2wav``: 2) a given time after the benchmark started, and :func:`fault_report` records what the
  server did afterwards: whether it still runs and answers ``/health``, whether the stage came back (a new
  process in its role), the server's log lines after the kill that name an error, a death or a restart.
* :func:`omni_accum_left` lists what omni-accum left in ``/dev/shm`` and its private directory once the
  server has stopped (waiting a few seconds for the reaper processes, which remove the files of killed
  processes).

No server is needed to use any of it on a process of one's own (tests/test_e2e_sampler.py). Used by ``run.py``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2e_procs import SHM, http_json, proc_info, role_of, server_processes

#: ``--kill-stage`` names: Qwen3-Omni's stages in vllm-omni's deploy (a stage number is taken too).
STAGES = {"thinker": 0, "talker": 1, "code2wav": 2}
#: server log lines worth reading after a kill (matched case-insensitively)
EVENT_RE = re.compile(
    r"error|exception|traceback|died|dead|killed|sigkill|exit(ed)? (code|status)|restart|respawn|shutdown|"
    r"terminat|timeout|timed out|fail",
    re.I,
)


def private_dir(base: Path = SHM) -> Path:
    """omni-accum's private directory under ``base`` (``OMNI_ACCUM_ARENA_DIR`` in the server's environment
    replaces ``/dev/shm``)."""
    return base / f"omni-accum-{os.geteuid()}"


def rss_bytes(pid: int) -> int | None:
    """``VmRSS`` of ``pid`` in bytes; None when it has ended (or is a zombie: no VmRSS line)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            m = re.search(rb"^VmRSS:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def dir_bytes(path: Path, apparent: bool = False) -> int:
    """Bytes the files in ``path`` take on their file system (allocated blocks: sparse arena regions count what
    was touched, not their size); with ``apparent``, their sizes instead (what they can take at most once every
    page is touched). 0 when ``path`` does not exist. Symlinks are not followed."""
    total = 0
    try:
        entries = list(os.scandir(path))
    except OSError:
        return 0
    for e in entries:
        with contextlib.suppress(OSError):
            st = e.stat(follow_symlinks=False)
            if e.is_dir(follow_symlinks=False):
                total += (0 if apparent else st.st_blocks * 512) + dir_bytes(Path(e.path), apparent)
            else:
                total += st.st_size if apparent else st.st_blocks * 512
    return total


def fs_used_bytes(path: Path) -> int | None:
    """Bytes in use on the file system of ``path`` (``statvfs``: every user's files); None when unreadable."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return (st.f_blocks - st.f_bfree) * st.f_frsize


_GROUP_RE = re.compile(r"[A-Za-z]+")


def shm_groups(path: Path, apparent: bool = False) -> dict[str, int]:
    """Bytes the top-level entries of ``path`` take (allocated blocks, folders whole), grouped by the leading
    letters of their names (``psm_1a2b`` -> ``psm``, ``omni-accum-0`` -> ``omni``, ``chatcmpl-...`` ->
    ``chatcmpl``): which component's files grow when ``/dev/shm`` does. With ``apparent``, the entries' sizes
    (the most they can take: a fixed-size ring whose pages are touched as it wraps grows up to it, no further)."""
    out: dict[str, int] = {}
    try:
        entries = list(os.scandir(path))
    except OSError:
        return out
    for e in entries:
        m = _GROUP_RE.match(e.name)
        group = m.group(0) if m else "other"
        with contextlib.suppress(OSError):
            st = e.stat(follow_symlinks=False)
            if e.is_dir(follow_symlinks=False):
                n = (0 if apparent else st.st_blocks * 512) + dir_bytes(Path(e.path), apparent)
            else:
                n = st.st_size if apparent else st.st_blocks * 512
            out[group] = out.get(group, 0) + n
    return out


class Sampler:
    """Samples the processes ``processes()`` returns (default: the server under ``root``) every ``every_s``
    seconds on a thread, from :meth:`start` to :meth:`stop`. Rows (``t_s`` from the start):
    ``kind=rss`` one per process (pid, role, bytes), ``kind=private_dir`` and ``kind=dev_shm`` one each, and
    ``kind=shm_group`` one per group of ``/dev/shm`` entries (role: the group, :func:`shm_groups`), and
    ``kind=shm_size`` the same groups' sizes (the most their files can take).
    :meth:`mark` records an event (a kill, a benchmark's start) on the same clock."""

    FIELDS = ("t_s", "kind", "pid", "role", "bytes")

    def __init__(
        self,
        root: int,
        every_s: float,
        *,
        processes: Callable[[], list[dict[str, Any]]] | None = None,
        shm: Path = SHM,
        private: Path | None = None,
        relist_s: float = 60.0,
    ) -> None:
        if every_s <= 0:
            raise ValueError(f"sampling interval {every_s!r}: must be more than 0 seconds")
        self.root, self.every_s, self.shm = root, every_s, shm
        self.private = private if private is not None else private_dir(shm)
        self._processes = processes or (lambda: server_processes(root))
        # The listing reads every process's cmdline and smaps_rollup, which wait for a busy process's memory
        # map lock (a 13 GB worker in its prefill held one sample up for minutes on a 2-core VM): it is taken
        # again only every ``relist_s`` seconds, or when a listed process has gone; each sample between reads
        # only ``/proc/PID/status`` of the listed processes.
        self.relist_s = relist_s
        self._listed: list[dict[str, Any]] | None = None
        self._listed_at = float("-inf")
        self.listings = 0
        self.rows: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def now(self) -> float:
        return round(time.monotonic() - self._t0, 3)

    def sample(self) -> None:
        """Take one sample now."""
        t = self.now()
        rows = []
        for attempt in (0, 1):
            if self._listed is None or t - self._listed_at >= self.relist_s:
                self._listed, self._listed_at = self._processes(), t
                self.listings += 1
            procs = self._listed
            by_pid = {i["pid"]: i for i in procs}
            rows = []
            gone = False
            for i in procs:
                rss = rss_bytes(i["pid"])
                if rss is not None:
                    rows.append({"t_s": t, "kind": "rss", "pid": i["pid"], "role": role_of(i, by_pid), "bytes": rss})
                else:
                    gone = True
            if not gone or attempt:
                break
            self._listed = None  # a listed process has ended (a kill, a restart): list again, once
        rows.append({"t_s": t, "kind": "private_dir", "pid": "", "role": "", "bytes": dir_bytes(self.private)})
        used = fs_used_bytes(self.shm)
        if used is not None:
            rows.append({"t_s": t, "kind": "dev_shm", "pid": "", "role": "", "bytes": used})
        for group, n in sorted(shm_groups(self.shm).items()):
            rows.append({"t_s": t, "kind": "shm_group", "pid": "", "role": group, "bytes": n})
        for group, n in sorted(shm_groups(self.shm, apparent=True).items()):
            rows.append({"t_s": t, "kind": "shm_size", "pid": "", "role": group, "bytes": n})
        with self._lock:
            self.rows.extend(rows)

    def mark(self, event: str, **info: Any) -> dict[str, Any]:
        e = {"t_s": self.now(), "event": event, **info}
        with self._lock:
            self.events.append(e)
        return e

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 - a report, never a reason to fail the arm
                self.mark("sample_error", error=f"{type(e).__name__}: {e}")
            if self._stop.wait(self.every_s):
                return

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="e2e-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def write(self, out_dir: Path, warmup_s: float = 0.0) -> dict[str, Any]:
        """``memory.csv`` (the rows), ``memory.json`` (rows, events, :func:`flatness`) and ``memory.png`` in
        ``out_dir``; the summary (paths, the flatness verdicts, the plot's note)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            rows, events = list(self.rows), list(self.events)
        csv_path = out_dir / "memory.csv"
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.FIELDS)
            w.writeheader()
            w.writerows(rows)
        flat = flatness(rows, warmup_s)
        summary = {"every_s": self.every_s, "samples": len({r["t_s"] for r in rows}), "warmup_s": warmup_s,
                   "csv": str(csv_path), "json": str(out_dir / "memory.json"), "flat": flat}  # fmt: skip
        plotted = plot({"": rows}, {"": events}, out_dir / "memory.png")
        summary["plot"] = plotted
        (out_dir / "memory.json").write_text(
            json.dumps({"rows": rows, "events": events, "summary": summary}, indent=1, default=str)
        )
        return summary


def series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[float, int]]]:
    """The rows as time series: ``"<role> <pid>"`` per process (RSS), ``private_dir``, ``dev_shm``, and
    ``"shm:<group>"`` per group of ``/dev/shm`` entries."""
    out: dict[str, list[tuple[float, int]]] = {}
    for r in rows:
        kind = r["kind"]
        if kind == "rss":
            name = f"{r['role']} {r['pid']}"
        elif kind in ("shm_group", "shm_size"):
            name = f"{'shm' if kind == 'shm_group' else 'size'}:{r['role']}"
        else:
            name = kind
        out.setdefault(name, []).append((float(r["t_s"]), int(r["bytes"])))
    return out


#: a series is flat when it grows (last quarter's median over first quarter's, after the warm-up) by at most
#: this many bytes or this fraction of its first value, whichever is larger
FLAT_BYTES = 32 << 20
FLAT_FRACTION = 0.05


def flatness(rows: list[dict[str, Any]], warmup_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """Per series after ``warmup_s``: the median of its first and last quarter of samples, the growth between
    them, the largest value, and ``flat`` (growth at most :data:`FLAT_BYTES` or :data:`FLAT_FRACTION` of the
    first). A series with fewer than 4 samples after the warm-up gets ``flat: None`` (too short to tell)."""
    out = {}
    for name, pts in series(rows).items():
        after = [v for t, v in pts if t >= warmup_s]
        entry: dict[str, Any] = {"samples": len(after)}
        if len(after) >= 4:
            q = max(1, len(after) // 4)
            first, last = statistics.median(after[:q]), statistics.median(after[-q:])
            growth = last - first
            entry.update({"first": int(first), "last": int(last), "max": max(after), "growth": int(growth),
                          "flat": growth <= max(FLAT_BYTES, FLAT_FRACTION * first)})  # fmt: skip
        else:
            entry["flat"] = None
        out[name] = entry
    for name, entry in out.items():  # a /dev/shm group beside the most its files can take
        size = out.get("size:" + name[4:]) if name.startswith("shm:") else None
        if size is not None and size.get("last") and "last" in entry:
            entry["size"] = size["last"]
            if entry["last"] <= size["last"]:  # sparse files (small ones round up to whole blocks: no fill)
                entry["fill"] = round(entry["last"] / size["last"], 3)
    return out


def plot(
    rows_by_arm: dict[str, list[dict[str, Any]]], events_by_arm: dict[str, list[dict[str, Any]]], out: Path
) -> str:
    """One figure per call: RSS per process (MB) above, ``/dev/shm`` in use and omni-accum's private
    directory (MB) below, over time, events as vertical lines; one column per arm. Returns the path written,
    or why nothing was (matplotlib not installed: ``pip install matplotlib`` in the harness's virtualenv)."""
    try:
        import matplotlib  # noqa: PLC0415 - an optional extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib); the data is in memory.csv / memory.json"
    arms = list(rows_by_arm)
    fig, axes = plt.subplots(2, len(arms), figsize=(7 * len(arms), 7), squeeze=False, sharex="col")
    for col, arm in enumerate(arms):
        top, bottom = axes[0][col], axes[1][col]
        for name, pts in sorted(series(rows_by_arm[arm]).items()):
            if name.startswith("size:"):
                continue  # the groups' sizes are in memory.json ("fill"), not drawn
            ax = bottom if name in ("private_dir", "dev_shm") or name.startswith("shm:") else top
            label = {"private_dir": "omni-accum private dir", "dev_shm": "/dev/shm in use"}.get(name, name)
            ax.plot([t for t, _ in pts], [v / 2**20 for _, v in pts], label=label, lw=1,
                    ls=":" if name.startswith("shm:") else "-")
        for e in events_by_arm.get(arm, []):
            for ax in (top, bottom):
                ax.axvline(e["t_s"], color="red" if "kill" in e["event"] else "grey", ls="--", lw=0.8)
            top.annotate(e["event"], (e["t_s"], 1), xycoords=("data", "axes fraction"), rotation=90, va="top",
                         fontsize=7)  # fmt: skip
        top.set_title(f"{arm}: RSS per server process" if arm else "RSS per server process")
        top.set_ylabel("MB")
        bottom.set_title("/dev/shm")
        bottom.set_ylabel("MB")
        bottom.set_xlabel("seconds since the server was ready")
        for ax in (top, bottom):
            ax.legend(fontsize=6, loc="upper left")
            ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return str(out)


# ------------------------------------------------------------------------------------------------ faults
def stage_number(value: str) -> int:
    """``thinker`` / ``talker`` / ``code2wav`` or a stage number; ValueError naming the choices."""
    v = str(value).strip().lower()
    if v in STAGES:
        return STAGES[v]
    if v.isdigit():
        return int(v)
    raise ValueError(f"--kill-stage {value!r}: use {', '.join(STAGES)} or a stage number")


def stage_process(procs: list[dict[str, Any]], stage: int) -> dict[str, Any] | None:
    """The engine-core process of ``stage`` among a server's processes (the lowest pid if several)."""
    by_pid = {i["pid"]: i for i in procs}
    hits = [i for i in procs if role_of(i, by_pid) == f"stage{stage} engine-core"]
    return min(hits, key=lambda i: i["pid"]) if hits else None


class StageKiller:
    """SIGKILL the engine-core process of ``stage`` ``after_s`` seconds after :meth:`arm` (once)."""

    def __init__(self, stage: int, after_s: float, processes: Callable[[], list[dict[str, Any]]],
                 on_kill: Callable[[dict[str, Any]], None] | None = None, log_path: Path | None = None) -> None:  # fmt: skip
        self.stage, self.after_s = stage, after_s
        self._processes, self._on_kill, self._log = processes, on_kill, log_path
        self.record: dict[str, Any] = {"stage": stage, "after_s": after_s, "killed": False}
        self._timer: threading.Timer | None = None

    def arm(self) -> None:
        if self._timer is None:
            self._timer = threading.Timer(self.after_s, self.kill)
            self._timer.daemon = True
            self._timer.start()

    def kill(self) -> dict[str, Any]:
        procs = self._processes()
        target = stage_process(procs, self.stage)
        if target is None:
            self.record["note"] = f"no stage{self.stage} engine-core process among {len(procs)} server processes"
            return self.record
        self.record.update({"pid": target["pid"], "start": target["start"], "title": target["title"][:120],
                            "role": f"stage{self.stage} engine-core", "before": procs,
                            "log_offset": self._log.stat().st_size if self._log and self._log.exists() else 0})  # fmt: skip
        try:
            os.kill(target["pid"], signal.SIGKILL)
            self.record["killed"] = True
            self.record["wall_time"] = time.time()
        except ProcessLookupError:
            self.record["note"] = f"pid {target['pid']} had ended already"
        if self._on_kill is not None:
            self._on_kill(self.record)
        return self.record

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def fault_report(record: dict[str, Any], now_procs: list[dict[str, Any]], server_alive: bool,
                 health: int | None, log_path: Path | None, bench: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """What the server did after :class:`StageKiller` killed a stage: ``server_running``, ``health`` (the
    HTTP status of ``/health`` afterwards, None when it did not answer), ``killed_process_gone``,
    ``restarted`` (a process in the killed role with another pid or start time), ``new_processes``, the
    benchmark client's errors, and the server's log lines after the kill that name an error, a death, a
    restart (at most 60)."""
    out = {k: v for k, v in record.items() if k != "before"}
    if not record.get("killed"):
        return out
    by_pid = {i["pid"]: i for i in now_procs}
    same_role = [i for i in now_procs if role_of(i, by_pid) == record["role"]]
    before = {(i["pid"], i["start"]) for i in record.get("before", [])}
    killed = proc_info(record["pid"])
    out.update(
        {
            "server_running": server_alive,
            "health": health,
            "killed_process_gone": killed is None or killed["start"] != record["start"] or killed["state"] == "Z",
            "restarted": any((i["pid"], i["start"]) != (record["pid"], record["start"]) for i in same_role),
            "new_processes": [
                {"pid": i["pid"], "role": role_of(i, by_pid), "title": i["title"][:80]}
                for i in now_procs
                if (i["pid"], i["start"]) not in before
            ],
        }
    )
    if bench is not None:
        out["client"] = client_errors(bench)
    out["log_lines"] = event_lines(log_path, record.get("log_offset", 0), 60)
    return out


def event_lines(log_path: Path | str | None, offset: int = 0, limit: int = 60) -> list[str]:
    """The lines of ``log_path`` from byte ``offset`` on that name an error, a death, a restart, a time-out
    (:data:`EVENT_RE`), at most ``limit``, each cut at 300 characters; [] when the file is missing."""
    lines: list[str] = []
    if log_path is None or not Path(log_path).exists():
        return lines
    with open(log_path, "rb") as f:
        f.seek(offset)
        for raw in f:
            line = raw.decode(errors="replace").rstrip()
            if EVENT_RE.search(line):
                lines.append(line[:300])
                if len(lines) >= limit:
                    break
    return lines


def health_status(base: str, timeout: float = 10) -> int | None:
    """The HTTP status of the server's ``/health``; None when it does not answer."""
    try:
        return http_json("GET", base + "/health", timeout=timeout)[0]
    except Exception:  # noqa: BLE001 - a server that does not answer is what is being recorded
        return None


def fallbacks_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float] | str:
    """omni-accum's fallbacks counted between two ``/metrics`` scrapes (``e2e_report.scrape_metrics``), by
    reason, only those that moved; the scrape's error text when one failed."""
    if "error" in before or "error" in after:
        return str(before.get("error") or after.get("error"))
    b = before.get("fallbacks") or {}
    return {k: v - b.get(k, 0.0) for k, v in sorted((after.get("fallbacks") or {}).items()) if v - b.get(k, 0.0)}


def client_errors(bench: list[dict[str, Any]]) -> dict[str, Any]:
    """The benchmark client's answered and failed requests over ``bench`` (run.py's entries, each with the
    client's JSON ``raw``) and its distinct error texts with their counts."""
    sent = completed = failed = 0
    errors: dict[str, int] = {}
    for b in bench:
        raw = b.get("raw") or {}
        sent += int(b.get("num_prompts") or 0)
        completed += int(raw.get("completed") or 0)
        failed += int(raw.get("failed") or 0)
        for text, n in (b.get("errors") or {}).items():
            errors[text] = errors.get(text, 0) + n
    return {"sent": sent, "completed": completed, "failed": failed, "errors": errors,
            "every_request_answered": sent > 0 and completed == sent and failed == 0}  # fmt: skip


def bench_errors(result_file: Path) -> dict[str, int]:
    """Distinct non-empty ``errors`` of a ``vllm bench serve`` result file, with counts (first 200 chars)."""
    try:
        raw = json.loads(result_file.read_text())
    except (OSError, ValueError):
        return {}
    out: dict[str, int] = {}
    for e in raw.get("errors") or []:
        if e:
            k = str(e).strip().splitlines()[-1][:200] if str(e).strip() else str(e)[:200]
            out[k] = out.get(k, 0) + 1
    return out


def omni_accum_left(before: set[str], entries: Callable[[], set[str]], wait_s: float = 10.0) -> list[str]:
    """omni-accum's entries (``omni-accum-<euid>/...`` and ``omni_accum*`` names) among ``entries()`` that were
    not in ``before``, once none are left or ``wait_s`` has passed (the reapers of killed processes remove
    theirs a moment after those end)."""

    def ours() -> list[str]:
        return sorted(n for n in entries() - before if n.startswith(("omni-accum-", "omni_accum")))

    deadline = time.monotonic() + wait_s
    left = ours()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = ours()
    return left
