"""``--wire mooncake``: the sender and the receiver in two OS processes, through vllm-omni 0.30.0's real
``MooncakeStoreConnector`` (Mooncake's distributed store: a master, and a holder process owning the memory).

Three parts, usable alone:

* :class:`MooncakeServices` starts ``mooncake_master`` (embedded HTTP metadata server, no etcd) on
  127.0.0.1 with free ports, and a *holder* process that mounts the store's memory (a segment of
  ``segment_bytes``); it stops both by their process ids. The stage processes get ``segment: 0``: every
  object they put lives in the holder, so every put and every get crosses a TCP connection (a process
  reading a replica in its own segment would get a local memcpy). An external master can be given
  instead (``master=HOST:PORT``, ``metadata=URL``): then only the holder is started.
* :class:`StageHost` imports vllm-omni and Mooncake once, then forks stage processes from itself, each
  a fresh OS process running one job (importing vllm-omni costs 15 s or more per process; forking costs
  milliseconds). Jobs talk through pipes the host makes and return a picklable result.
* :func:`measure_mooncake`: one bucket, every arm, in one sender process and one receiver process
  (both forked from a :class:`StageHost`), in lock step: the sender encodes a chunk, ``put``s it through
  the connector and tells the receiver its key; the receiver ``get``s it, merges it and reads the
  consumer's keys, then acknowledges. A step is timed in the sender, from before the encode to the
  acknowledgement (two pipe hops included, the same for every arm). Bytes through the store are the
  connector's own ``put`` results. A request's objects are removed once it has finished (untimed), so
  a long run does not fill the segment; vllm-omni 0.30.0 never removes them (its ``cleanup()`` does
  nothing and every object is soft-pinned for 30 min): :func:`occupancy` measures what that leaves.

Every Mooncake process gets ``MC_TCP_BIND_ADDRESS=127.0.0.1``; the master's RPC, metadata and metrics
ports are picked free (Mooncake's default master port, 50051, is also the transfer-engine connector's
default ZMQ port).
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_accum.errors import OmniAccumError

HOST = "127.0.0.1"
#: Environment of every Mooncake process this module starts.
MOONCAKE_ENV = {"MC_TCP_BIND_ADDRESS": HOST}
#: Modules a :class:`StageHost` imports before it forks (the costly ones).
STAGE_PRELOAD = (
    "torch",
    "vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter",
    "vllm_omni.distributed.omni_connectors.connectors.mooncake_store_connector",
    "omni_accum.bench.replay",
)
CONNECTOR = "MooncakeStoreConnector"


class MooncakeUnavailable(OmniAccumError):
    """Mooncake (``omni-accum[mooncake]``) or the Debian ``libibverbs1`` it links is missing, or a service did
    not start."""


def mooncake_problem() -> str | None:
    """What is missing for Mooncake here (exactly), or None when ``mooncake.store`` loads."""
    try:
        importlib.import_module("mooncake.store")
    except ImportError as e:
        text = str(e)
        if "libibverbs" in text:
            return f"the Debian package libibverbs1 is missing ({text}): apt-get install libibverbs1"
        return f"Mooncake is not installed ({text}): pip install 'omni-accum[mooncake]' (or bash scripts/env.sh)"
    except Exception as e:  # noqa: BLE001 - a wheel that does not load on this machine
        return f"Mooncake does not load here ({type(e).__name__}: {e})"
    return None


def master_binary() -> str:
    """Path of the ``mooncake_master`` binary shipped inside the installed ``mooncake`` package."""
    problem = mooncake_problem()
    if problem:
        raise MooncakeUnavailable(problem)
    import mooncake  # noqa: PLC0415

    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.is_file():
        raise MooncakeUnavailable(f"no mooncake_master binary in {path.parent}")
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def listening_ports(pids: Sequence[int] | None = None) -> set[int]:
    """TCP ports in LISTEN state (IPv4 and IPv6), optionally only those whose socket belongs to ``pids``."""
    inodes: set[str] | None = None
    if pids is not None:
        inodes = set()
        for pid in pids:
            try:
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    try:
                        target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    except OSError:
                        continue
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
            except OSError:
                continue
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A" and (inodes is None or parts[9] in inodes):
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _stop(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def parse_size(text: str | int) -> int:
    """``512MiB``, ``1GiB``, ``256M``, ``1g``, or bytes -> bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().lower().removesuffix("b").removesuffix("i")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(s[-1:], 1)
    try:
        n = int(float(s[:-1] if mult > 1 else s) * mult)
    except ValueError:
        raise OmniAccumError(f"not a size: {text!r} (give bytes, or e.g. 512MiB, 2GiB)") from None
    if n < 0:
        raise OmniAccumError(f"not a size: {text!r}")
    return n


# ---------------------------------------------------------------------------------------------- #
# Services: the master and the holder
# ---------------------------------------------------------------------------------------------- #


@dataclass
class MooncakeServices:
    """``mooncake_master`` (own ports, HTTP metadata) and a holder process owning ``segment_bytes`` of store memory.

    Use as a context manager, or :meth:`start` / :meth:`stop`. ``master`` / ``metadata`` given: use that
    master (nothing of it is started or stopped here); the holder still mounts its segment there.
    """

    segment_bytes: int = 512 << 20
    master: str | None = None
    metadata: str | None = None
    lease_ttl_ms: int | None = None
    soft_pin_ttl_ms: int | None = None
    log_dir: str | None = None
    python: str = sys.executable
    rpc_port: int = 0
    http_port: int = 0
    metrics_port: int = 0
    master_proc: subprocess.Popen | None = field(default=None, repr=False)
    holder_proc: subprocess.Popen | None = field(default=None, repr=False)
    _logs: list[Any] = field(default_factory=list, repr=False)

    @property
    def own_master(self) -> bool:
        return self.master_proc is not None

    @property
    def master_addr(self) -> str:
        return self.master or f"{HOST}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return self.metadata or f"http://{HOST}:{self.http_port}/metadata"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in (self.master_proc, self.holder_proc) if p is not None]

    def connector_extra(self, **more: Any) -> dict[str, Any]:
        """The ``extra`` of a ``MooncakeStoreConnector`` for a stage: this master, ``segment: 0`` (the holder
        owns the memory), a local buffer large enough for an 8k prefill object."""
        extra = {
            "host": HOST,
            "metadata_server": self.metadata_url,
            "master": self.master_addr,
            "segment": 0,
            "localbuf": 256 << 20,
            "proto": "tcp",
        }
        extra.update(more)
        return extra

    def env(self) -> dict[str, str]:
        return {**os.environ, **MOONCAKE_ENV}

    def _log(self, name: str) -> Any:
        if self.log_dir is None:
            return subprocess.DEVNULL
        f = open(Path(self.log_dir) / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(f)
        return f

    def start(self, timeout: float = 60.0) -> MooncakeServices:
        try:
            if self.master is None:
                self._start_master(timeout)
            self._start_holder(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_master(self, timeout: float) -> None:
        binary = master_binary()
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        args = [
            binary,
            f"--rpc_address={HOST}",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={HOST}",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.metrics_port}",
        ]
        if self.lease_ttl_ms is not None:  # a lease shorter than a get (an 8k prefill object under load) fails it
            args.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        if self.soft_pin_ttl_ms is not None:
            args.append(f"--default_kv_soft_pin_ttl={self.soft_pin_ttl_ms}")
        self.master_proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=self._log("master"), stderr=subprocess.STDOUT, env=self.env()
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.master_proc.poll() is not None:
                raise MooncakeUnavailable(f"mooncake_master exited with {self.master_proc.returncode} ({' '.join(args)})")
            if self._answers() and self.rpc_port in listening_ports([self.master_proc.pid]):
                return
            if time.monotonic() > deadline:
                raise MooncakeUnavailable(f"mooncake_master did not answer within {timeout:.0f} s")
            time.sleep(0.05)

    def _answers(self) -> bool:
        """The metadata server answers HTTP (404 for an unknown key is an answer)."""
        try:
            urllib.request.urlopen(f"{self.metadata_url}?key=omni-accum-probe", timeout=1.0).close()
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def _start_holder(self, timeout: float) -> None:
        self.holder_proc = subprocess.Popen(
            [self.python, "-m", "omni_accum.bench.mooncake", "holder", self.master_addr, self.metadata_url,
             str(self.segment_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log("holder"),
            env=self.env(),
            cwd=tempfile.gettempdir(),
        )
        line = _readline(self.holder_proc.stdout, timeout)
        if line.strip() != "ready":
            code = self.holder_proc.poll()
            raise MooncakeUnavailable(f"the Mooncake holder process did not start (exit {code}, said {line!r})")

    def metrics(self) -> dict[str, float]:
        """The master's Prometheus metrics (``name{labels}`` -> value); empty for an external master."""
        if not self.metrics_port:
            return {}
        text = urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics", timeout=5.0).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def stop(self) -> None:
        """Stop the holder, then the master, by their process ids (SIGTERM, then SIGKILL after 10 s)."""
        if self.holder_proc is not None:
            try:
                if self.holder_proc.stdin:
                    self.holder_proc.stdin.close()  # the holder unmounts and exits on EOF
                self.holder_proc.wait(timeout=10)
            except (subprocess.TimeoutExpired, OSError):
                _stop(self.holder_proc)
        _stop(self.master_proc)
        for f in self._logs:
            f.close()
        self._logs.clear()

    def __enter__(self) -> MooncakeServices:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _readline(stream: Any, timeout: float) -> str:
    """One line of ``stream`` (a pipe), or ``""`` after ``timeout`` seconds."""
    out: list[bytes] = []
    t = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return out[0].decode(errors="replace") if out else ""


def _holder_main(master: str, metadata: str, segment: int) -> int:
    """The holder: mounts ``segment`` bytes of store memory, says ``ready``, holds it until stdin closes."""
    from mooncake.store import MooncakeDistributedStore  # noqa: PLC0415

    store = MooncakeDistributedStore()
    rc = store.setup(HOST, metadata, segment, 16 << 20, "tcp", "", master)
    if rc != 0:
        print(f"setup failed: {rc}", flush=True)
        return 1
    print("ready", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.stdin.close())
    try:
        sys.stdin.read()
    except (OSError, ValueError):
        pass
    store.close()
    return 0


# ---------------------------------------------------------------------------------------------- #
# Stage processes: forked from a host that imported vllm-omni once
# ---------------------------------------------------------------------------------------------- #


@dataclass
class Job:
    """One stage process: ``fn`` (``module:function``) called with ``pipes`` and ``kwargs``, in ``env``."""

    fn: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


class StageFailed(OmniAccumError):
    """A stage process raised, crashed or ran out of time."""


class StageHost:
    """A process that imports vllm-omni and Mooncake once and forks stage processes from itself.

    Each :meth:`run` forks one fresh process per :class:`Job` (all at once, sharing ``pipes`` os.pipe()
    pairs), waits for all of them and returns their results in order. A job's stdout goes to stderr.
    """

    def __init__(self, *, env: Mapping[str, str] | None = None, preload: Sequence[str] = STAGE_PRELOAD,
                 python: str = sys.executable, pythonpath: Sequence[str] = ()) -> None:
        self.env = {**os.environ, **MOONCAKE_ENV, **(env or {})}
        if pythonpath:
            self.env["PYTHONPATH"] = os.pathsep.join([*pythonpath, self.env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.preload = list(preload)
        self.python = python
        self.proc: subprocess.Popen | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="omni-accum-stages-")

    def start(self, timeout: float = 600.0) -> StageHost:
        self.proc = subprocess.Popen(
            [self.python, "-m", "omni_accum.bench.mooncake", "stage-host", *self.preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            cwd=self._tmp.name,  # not a source tree: a stale *.egg-info there would shadow the installed entry points
        )
        line = _readline(self.proc.stdout, timeout)
        if line.strip() != "ready":
            self.stop()
            raise StageFailed(f"the stage host did not start (said {line!r})")
        return self

    def run(self, jobs: Sequence[Job], *, pipes: int = 2, timeout: float = 600.0) -> list[Any]:
        if self.proc is None or self.proc.poll() is not None:
            raise StageFailed("the stage host is not running")
        req = Path(self._tmp.name) / f"req-{time.monotonic_ns()}.pkl"
        outs = [str(req) + f".out{i}" for i in range(len(jobs))]
        with open(req, "wb") as f:
            pickle.dump({"jobs": [(j.fn, j.kwargs, j.env, o) for j, o in zip(jobs, outs)], "pipes": pipes,
                         "timeout": timeout}, f)
        assert self.proc.stdin is not None
        self.proc.stdin.write((str(req) + "\n").encode())
        self.proc.stdin.flush()
        line = _readline(self.proc.stdout, timeout + 30)
        if not line:
            raise StageFailed(f"the stage host gave no answer within {timeout + 30:.0f} s")
        rcs = json.loads(line)
        results, errors = [], []
        for job, out, rc in zip(jobs, outs, rcs):
            try:
                with open(out, "rb") as f:
                    status, value = pickle.load(f)
            except (OSError, EOFError, pickle.UnpicklingError):
                status, value = "error", f"no result (exit status {rc})"
            if status != "ok":
                errors.append(f"{job.fn}: {value}")
            results.append(value)
        if errors:
            raise StageFailed("stage process failed:\n" + "\n".join(errors))
        return results

    def stop(self) -> None:
        if self.proc is not None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, OSError):
                _stop(self.proc)
        self._tmp.cleanup()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def __enter__(self) -> StageHost:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _resolve(name: str) -> Callable[..., Any]:
    mod, _, attr = name.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _host_main(preload: Sequence[str]) -> int:
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever vllm-omni prints goes to stderr; stdout carries the protocol only
    for name in preload:
        importlib.import_module(name)
    proto.write("ready\n")
    proto.flush()
    for line in sys.stdin:
        with open(line.strip(), "rb") as f:
            req = pickle.load(f)
        fds = [os.pipe() for _ in range(req["pipes"])]
        pids = []
        for fn, kwargs, env, out in req["jobs"]:
            pid = os.fork()
            if pid == 0:  # the stage process
                rc = 1
                try:
                    devnull = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(devnull, 0)
                    os.environ.update(env)
                    value = _resolve(fn)(pipes=fds, **kwargs)
                    with open(out, "wb") as f:
                        pickle.dump(("ok", value), f)
                    rc = 0
                except BaseException:  # noqa: BLE001 - reported to the parent
                    with open(out, "wb") as f:
                        pickle.dump(("error", traceback.format_exc()), f)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(rc)
            pids.append(pid)
        for r, w in fds:
            os.close(r)
            os.close(w)
        rcs = _wait_all(pids, req["timeout"])
        proto.write(json.dumps(rcs) + "\n")
        proto.flush()
    return 0


def _wait_all(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    rcs: dict[int, int] = {}
    while len(rcs) < len(pids):
        for pid in pids:
            if pid in rcs:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rcs[pid] = os.waitstatus_to_exitcode(status)
        if len(rcs) < len(pids):
            if time.monotonic() > deadline:
                for pid in pids:
                    if pid not in rcs:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        rcs[pid] = -9
                break
            time.sleep(0.01)
    return [rcs[p] for p in pids]


def pipe_ends(pipes: list[tuple[int, int]], role: str) -> tuple[Any, Any]:
    """(reader, writer) files of a sender (``role="tx"``) or receiver over pipes[0] (tx->rx) and pipes[1] (rx->tx);
    the ends the role does not use are closed."""
    (a_r, a_w), (b_r, b_w) = pipes[0], pipes[1]
    if role == "tx":
        os.close(a_r)
        os.close(b_w)
        return os.fdopen(b_r, "r"), os.fdopen(a_w, "w")
    os.close(a_w)
    os.close(b_r)
    return os.fdopen(a_r, "r"), os.fdopen(b_w, "w")


def make_connector(stage_id: int, extra: Mapping[str, Any]) -> Any:
    """vllm-omni 0.30.0's ``MooncakeStoreConnector`` through its own factory (compatibility step applied)."""
    from omni_accum.integrations.vllm_omni import mooncake_compat  # noqa: PLC0415
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory  # noqa: PLC0415
    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec  # noqa: PLC0415

    mooncake_compat.activate()
    return OmniConnectorFactory.create_connector(ConnectorSpec(name=CONNECTOR, extra={**extra, "stage_id": stage_id}))


# ---------------------------------------------------------------------------------------------- #
# The bench pair
# ---------------------------------------------------------------------------------------------- #


@dataclass
class MooncakeArmResult:
    """Store figures of one arm in one bucket, beside its :class:`~omni_accum.bench.replay.ArmResult`."""

    arm: str
    context_len: int
    concurrency: int
    store_bytes_per_step: float = 0.0
    store_bytes_per_request: float = 0.0
    put_bytes_p50: float = 0.0
    puts: int = 0
    failed_puts: int = 0


def _plan(wl: Any, cl: int, concurrency: int) -> tuple[Any, list[list[dict[str, Any]]]]:
    from omni_accum.bench.replay import iter_leaves  # noqa: PLC0415
    from omni_accum.bench.streams import build_stream  # noqa: PLC0415
    from omni_accum.context import StreamContext  # noqa: PLC0415

    import torch  # noqa: PLC0415

    streams = [build_stream(wl, cl, r) for r in range(concurrency)]
    hints: dict[str, int] = {}
    for spec in wl.keys:
        if spec.kind == "append":
            rows = [int(v.shape[0]) for c in streams[0] for p, v in iter_leaves(c)
                    if p == spec.path and isinstance(v, torch.Tensor) and v.dim() > 0]
            if rows:
                hints[spec.path] = sum(rows)
    return StreamContext(context_len=cl, concurrency=concurrency, length_hints=hints), streams


def _schedule(labels: list[str], repeats: int, warmup: bool) -> list[tuple[str, int]]:
    """(arm, repeat) in replay order: a warm-up replay (repeat -1) per arm, then rotated rounds as measure()."""
    out = [(lab, -1) for lab in labels] if warmup else []
    for rep in range(repeats):
        k = rep % len(labels)
        out += [(lab, rep) for lab in labels[k:] + labels[:k]]
    return out


def _sender(*, pipes: list, extra: dict, wl: Any, arms: dict, cl: int, concurrency: int, repeats: int,
            warmup: bool, keep: bool, tag: str) -> dict[str, Any]:
    from omni_accum.bench.engines import make_engine  # noqa: PLC0415

    rd, wr = pipe_ends(pipes, "tx")
    ctx, streams = _plan(wl, cl, concurrency)
    conn = make_connector(0, extra)
    clock = time.perf_counter_ns
    res: dict[str, Any] = {lab: {"samples": [], "totals": [], "bytes": 0, "puts": 0, "failed": 0, "steps": 0,
                                 "sizes": []} for lab in arms}
    try:
        for lab, rep in _schedule(list(arms), repeats, warmup):
            engine = make_engine(arms[lab], ctx)
            rids = [f"{tag}-{lab}-{rep}-{r}" for r in range(concurrency)]
            wr.write(json.dumps(["begin", lab, rep]) + "\n")
            wr.flush()
            steps: list[float] = []
            totals = [0.0] * concurrency
            keys: list[list[str]] = [[] for _ in rids]
            n = len(streams[0])
            for i in range(n):
                for r, rid in enumerate(rids):
                    t0 = clock()
                    sent = engine.encode(rid, streams[r][i])
                    ok, size, _ = conn.put("0", "1", f"{rid}_{i}", sent)
                    wr.write(json.dumps(["chunk", r, i, ok]) + "\n")
                    wr.flush()
                    ack = rd.readline()
                    dt = (clock() - t0) / 1000.0
                    if not ack.startswith("ok"):
                        raise StageFailed(f"receiver: {ack.strip() or 'gone'}")
                    keys[r].append(conn._make_key(f"{rid}_{i}", "0", "1"))
                    if rep >= 0:
                        steps.append(dt)
                        totals[r] += dt
                        st = res[lab]
                        st["puts"] += 1
                        st["bytes"] += int(size) if ok else 0
                        if rep == 0:
                            st["sizes"].append(int(size) if ok else 0)
                        st["failed"] += 0 if ok else 1
                    if i == n - 1:  # the request has finished: its objects may go (untimed)
                        engine.release(rid)
                        if not keep:
                            conn.store.batch_remove(keys[r], True)
            wr.write(json.dumps(["end", lab, rep]) + "\n")
            wr.flush()
            if not rd.readline().startswith("ok"):
                raise StageFailed("receiver gave no end-of-replay acknowledgement")
            engine.close()
            if rep >= 0:
                res[lab]["samples"].append(steps)
                res[lab]["totals"].append(statistics.fmean(totals))
                res[lab]["steps"] += len(steps)
        wr.write(json.dumps(["stop"]) + "\n")
        wr.flush()
    finally:
        conn.close()
    return res


def _receiver(*, pipes: list, extra: dict, wl: Any, arms: dict, cl: int, concurrency: int, tag: str,
              **_: Any) -> dict[str, Any]:
    from omni_accum.bench.engines import make_engine  # noqa: PLC0415
    from omni_accum.bench.replay import _ABSENT, _Read, check_view  # noqa: PLC0415

    import torch  # noqa: PLC0415

    rd, wr = pipe_ends(pipes, "rx")
    ctx, streams = _plan(wl, cl, concurrency)
    reads = [_Read.of(k.path, k.read) for k in wl.keys if k.read != "never"]
    conn = make_connector(1, extra)
    out: dict[str, Any] = {lab: {"peak": 0, "mismatch": None, "error": None} for lab in arms}
    engine = None
    lab, rep = "", 0
    n = len(streams[0])
    try:
        for line in rd:
            msg = json.loads(line)
            if msg[0] == "stop":
                break
            if msg[0] == "begin":
                lab, rep = msg[1], msg[2]
                engine = make_engine(arms[lab], ctx)
                wr_views: dict[int, Any] = {}
                continue
            if msg[0] == "end":
                engine.close()
                wr.write("ok\n")
                wr.flush()
                continue
            _, r, i, ok = msg
            try:
                rid = f"{tag}-{lab}-{rep}-{r}"
                got = conn.get("0", "1", f"{rid}_{i}") if ok else None
                if got is None:
                    raise StageFailed(f"nothing in the store for {rid}_{i}")
                view = engine.merge(rid, got[0])
                for rdk in reads:
                    if rdk.pattern == "end" and i != n - 1:
                        continue
                    val = rdk.lookup(view)
                    if val is not _ABSENT and rdk.pattern == "newest_row" and isinstance(val, (torch.Tensor, list)):
                        val = val[-1:]
                if i == n - 1:
                    st = out[lab]
                    st["peak"] = max(st["peak"], engine.nbytes())
                    if rep == 0 and st["mismatch"] is None and getattr(engine, "checks_views", True):
                        m = check_view(wl, streams[r], view)
                        if m:
                            st["mismatch"] = f"request {r}: {m}"
                    wr_views[r] = True
                    engine.release(rid)
                wr.write("ok\n")
            except Exception as e:  # noqa: BLE001 - the sender stops on it
                out[lab]["error"] = f"{type(e).__name__}: {e}"
                wr.write(f"error {type(e).__name__}: {e}\n")
            wr.flush()
    finally:
        conn.close()
    return out


def measure_mooncake(
    host: StageHost,
    services: MooncakeServices,
    workload: Any,
    arms: Mapping[str, Any],
    *,
    context_len: int | None = None,
    concurrency: int = 1,
    repeats: int = 3,
    warmup: bool = True,
    keep: bool = False,
    timeout: float = 600.0,
) -> tuple[list[Any], list[MooncakeArmResult]]:
    """One bucket: every arm through a sender process and a receiver process (see the module docstring).

    Returns ``(ArmResult per arm, MooncakeArmResult per arm)``; ``ArmResult.wire_bytes_per_step`` is the
    bytes ``put`` through the store per step, ``peak_bytes`` the receiver's accumulation state.
    """
    from omni_accum.bench.replay import ArmResult  # noqa: PLC0415
    from omni_accum.bench.workloads import load_workload  # noqa: PLC0415

    wl = load_workload(workload)
    cl = context_len or wl.context_len
    tag = f"oa{os.getpid()}-{time.monotonic_ns() % 10**9}"
    kw = {"extra": services.connector_extra(), "wl": wl, "arms": dict(arms), "cl": cl, "concurrency": concurrency,
          "repeats": repeats, "warmup": warmup, "keep": keep, "tag": tag}
    tx, rx = host.run([Job(f"{__name__}:_sender", kw), Job(f"{__name__}:_receiver", kw)], timeout=timeout)
    n_chunks = wl.n_chunks(cl)
    results, store = [], []
    for lab in arms:
        s, r = tx[lab], rx[lab]
        res = ArmResult(lab, cl, concurrency, "mooncake", requests=concurrency, steps=n_chunks)
        res.samples_us = s["samples"]
        res.total_us_per_request = s["totals"]
        res.wire_bytes_per_step = s["bytes"] / s["puts"] if s["puts"] else 0.0
        res.peak_bytes = r["peak"]
        if r["error"] or r["mismatch"]:
            res.correct = False
            res.mismatch = r["mismatch"] or r["error"]
            res.error = r["error"]
        results.append(res)
        reqs = max(1, concurrency * repeats)
        store.append(MooncakeArmResult(lab, cl, concurrency, res.wire_bytes_per_step, s["bytes"] / reqs,
                                       statistics.median(s["sizes"]) if s["sizes"] else 0.0, s["puts"], s["failed"]))
    return results, store


def format_store_table(store: list[MooncakeArmResult], baseline: str = "upstream") -> str:
    """Bytes through the store per step (mean, and the median put: a decode chunk), per request (= what vllm-omni
    0.30.0 leaves pinned per request), each as a ratio to ``baseline``."""
    from omni_accum.bench.report import _fmt_bytes  # noqa: PLC0415

    base = next((s for s in store if s.arm == baseline), None)
    rows = [["arm", "store/step", "p50 put", "store/request", f"vs {baseline}", "p50 put vs", "puts", "failed puts"]]
    for s in store:
        ratio = f"{s.store_bytes_per_request / base.store_bytes_per_request:.3g}x" if base and base.store_bytes_per_request else "-"
        p50 = f"{s.put_bytes_p50 / base.put_bytes_p50:.3g}x" if base and base.put_bytes_p50 else "-"
        rows.append([s.arm, _fmt_bytes(s.store_bytes_per_step), _fmt_bytes(s.put_bytes_p50),
                     _fmt_bytes(s.store_bytes_per_request), ratio, p50, str(s.puts), str(s.failed_puts)])
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows)


# ---------------------------------------------------------------------------------------------- #
# Occupancy: what vllm-omni 0.30.0 leaves pinned in the store
# ---------------------------------------------------------------------------------------------- #


def _occupancy_sender(*, pipes: list, extra: dict, wl: Any, arm: Any, cl: int, requests: int, tag: str,
                      metrics_url: str | None) -> dict[str, Any]:
    """Send ``requests`` requests one after another as 0.30.0 does (nothing removed); after each, the master's
    allocated bytes and key count."""
    from omni_accum.bench.engines import make_engine  # noqa: PLC0415

    for fd in (fd for p in pipes for fd in p):
        os.close(fd)
    ctx, streams = _plan(wl, cl, 1)
    conn = make_connector(0, extra)
    engine = make_engine(arm, ctx)
    rows = []
    objects = 0
    try:
        for q in range(requests):
            rid = f"{tag}-{q}"
            sent_bytes, failed = 0, 0
            for i, chunk in enumerate(streams[0]):
                ok, size, _ = conn.put("0", "1", f"{rid}_{i}", engine.encode(rid, chunk))
                sent_bytes += int(size) if ok else 0
                failed += 0 if ok else 1
                objects += 1 if ok else 0
            engine.release(rid)
            m = _scrape(metrics_url) if metrics_url else {}
            rows.append({"request": q + 1, "put_bytes": sent_bytes, "failed_puts": failed, "objects": objects,
                         "allocated": m.get("master_allocated_bytes"), "keys": m.get("master_key_count"),
                         "capacity": m.get("master_total_capacity_bytes")})
    finally:
        engine.close()
        conn.close()
    return {"rows": rows}


def _scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in urllib.request.urlopen(url, timeout=5.0).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


@dataclass
class Occupancy:
    """One arm's run of ``requests`` requests into a fresh store of ``segment_bytes``, nothing removed."""

    arm: str
    context_len: int
    segment_bytes: int
    rows: list[dict[str, Any]]

    @property
    def put_bytes_per_request(self) -> float:
        ok = [r["put_bytes"] for r in self.rows if not r["failed_puts"]]
        return statistics.fmean(ok) if ok else 0.0

    @property
    def pinned_bytes_per_request(self) -> float | None:
        """Allocated bytes in the segment per request, over the requests before the first failed put or eviction."""
        good = []
        for r in self.rows:
            if r["failed_puts"] or r["allocated"] is None or self._evicted(r):
                break
            good.append(r)
        if not good:
            return None
        return good[-1]["allocated"] / good[-1]["request"]

    @staticmethod
    def _evicted(row: dict[str, Any]) -> bool:
        return row.get("keys") is not None and row["keys"] < row["objects"]

    @property
    def first_eviction(self) -> int | None:
        """The first request after which the master holds fewer objects than were put: it evicted soft-pinned
        objects (``allow_evict_soft_pinned_objects``, at ``eviction_high_watermark_ratio`` of the segment)."""
        return next((r["request"] for r in self.rows if self._evicted(r)), None)

    @property
    def first_failure(self) -> int | None:
        """The first request with a failed put (the segment was full), or None."""
        return next((r["request"] for r in self.rows if r["failed_puts"]), None)


def occupancy(
    host: StageHost,
    workload: Any,
    arms: Mapping[str, Any],
    *,
    context_len: int,
    requests: int,
    segment_bytes: int,
    timeout: float = 600.0,
) -> list[Occupancy]:
    """Per arm, a fresh master and holder of ``segment_bytes``, then ``requests`` requests as vllm-omni 0.30.0
    leaves them: soft-pinned, never removed."""
    from omni_accum.bench.workloads import load_workload  # noqa: PLC0415

    wl = load_workload(workload)
    out = []
    for lab, arm in arms.items():
        with MooncakeServices(segment_bytes=segment_bytes) as svc:
            url = f"http://{HOST}:{svc.metrics_port}/metrics"
            kw = {"extra": svc.connector_extra(), "wl": wl, "arm": arm, "cl": context_len, "requests": requests,
                  "tag": f"occ{os.getpid()}-{lab}", "metrics_url": url}
            (res,) = host.run([Job(f"{__name__}:_occupancy_sender", kw)], timeout=timeout)
        out.append(Occupancy(lab, context_len, segment_bytes, res["rows"]))
    return out


def format_occupancy(occ: list[Occupancy]) -> str:
    from omni_accum.bench.report import _fmt_bytes  # noqa: PLC0415

    rows = [["arm", "put/request", "pinned/request", "requests", "first eviction", "first failed put",
             "allocated at end", "objects kept"]]
    for o in occ:
        last = o.rows[-1] if o.rows else {}
        pinned = o.pinned_bytes_per_request
        rows.append([
            o.arm,
            _fmt_bytes(o.put_bytes_per_request),
            _fmt_bytes(pinned) if pinned is not None else "-",
            str(len(o.rows)),
            f"after request {o.first_eviction}" if o.first_eviction else "none",
            f"request {o.first_failure}" if o.first_failure else "none",
            f"{_fmt_bytes(last.get('allocated') or 0)} of {_fmt_bytes(o.segment_bytes)}",
            f"{int(last.get('keys') or 0)} of {last.get('objects', 0)}",
        ])
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows)


def _cli_problem(args: Any) -> str | None:
    if args.view_hop or args.through != "direct" or args.plot:
        return "--wire mooncake takes neither --view-hop, --through vllm-omni nor --plot"
    if args.mooncake_metadata and not args.mooncake_master:
        return "--mooncake-metadata goes with --mooncake-master"
    if args.mooncake_occupancy and args.mooncake_master:
        return "--mooncake-occupancy starts a fresh master per arm; it does not take --mooncake-master"
    if args.mooncake_master and ":" not in args.mooncake_master:
        return f"--mooncake-master {args.mooncake_master}: give HOST:PORT"
    try:
        parse_size(args.mooncake_segment)
    except OmniAccumError as e:
        return f"--mooncake-segment: {e}"
    return mooncake_problem()


def run_cli(args: Any, wl: Any, arms: Mapping[str, Any]) -> int:
    """``omni-accum bench --wire mooncake`` (called by :mod:`omni_accum.cli.bench` once the arms are built)."""
    from omni_accum.bench.report import format_table, machine_info  # noqa: PLC0415

    problem = _cli_problem(args)
    if problem:
        print(f"omni-accum bench: error: {problem}", file=sys.stderr)
        return 2
    segment = parse_size(args.mooncake_segment)
    cls = list(args.context_lens or wl.default_context_lens())
    concs = list(args.concurrency or wl.concurrency)
    metadata = args.mooncake_metadata
    if args.mooncake_master and not metadata:
        metadata = f"http://{args.mooncake_master.rsplit(':', 1)[0]}:8080/metadata"
    where = f"master {args.mooncake_master}" if args.mooncake_master else "own master"
    print(f"workload {wl.name}: arms {', '.join(arms)}; wire mooncake ({where}, sender and receiver in two processes); "
          f"{args.repeats} repeats", flush=True)
    host = StageHost().start()
    results: list[Any] = []
    store: list[MooncakeArmResult] = []
    try:
        if args.mooncake_occupancy:
            for cl in cls:
                occ = occupancy(host, wl, arms, context_len=cl, requests=args.mooncake_occupancy, segment_bytes=segment)
                print(f"\ncontext_len={cl}: {args.mooncake_occupancy} requests per arm, one at a time, nothing removed, "
                      f"segment {segment} bytes")
                print(format_occupancy(occ), flush=True)
            return 0
        with MooncakeServices(segment_bytes=segment, master=args.mooncake_master, metadata=metadata) as svc:
            for cl in cls:
                for c in concs:
                    res, st = measure_mooncake(host, svc, wl, arms, context_len=cl, concurrency=c, repeats=args.repeats)
                    results += res
                    store += st
                    print()
                    print(format_table(res, decode_steps=wl.decode_steps))
                    print(format_store_table(st), flush=True)
    finally:
        host.stop()
    if args.json:
        doc = {"workload": wl.name, "wire": "mooncake", "machine": machine_info(), "results": [
            {"arm": r.arm, "key": r.key, "context_len": r.context_len, "concurrency": r.concurrency,
             "step_us_p50": r.step_us_p50, "step_us_p99": r.step_us_p99,
             "total_us_per_request": statistics.fmean(r.total_us_per_request) if r.total_us_per_request else None,
             "wire_bytes_per_step": r.wire_bytes_per_step, "store_bytes_per_request": s.store_bytes_per_request, "put_bytes_p50": s.put_bytes_p50,
             "failed_puts": s.failed_puts, "peak_bytes": r.peak_bytes, "requests": r.requests, "steps": r.steps,
             "correct": r.correct}
            for r, s in zip(results, store)]}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    wrong = sorted({r.arm for r in results if not r.correct and r.arm != "upstream"})
    if wrong:
        print(f"omni-accum: error: arm(s) {', '.join(wrong)} gave views differing from the cat reference",
              file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "holder":
        return _holder_main(argv[1], argv[2], int(argv[3]))
    if argv and argv[0] == "stage-host":
        return _host_main(argv[1:])
    print("usage: python -m omni_accum.bench.mooncake holder MASTER METADATA SEGMENT | stage-host MODULE...",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
