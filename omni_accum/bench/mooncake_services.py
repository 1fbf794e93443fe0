"""Mooncake's services for a run on one machine: ``mooncake_master`` and a holder process owning the store's memory.

:class:`MooncakeServices` starts ``mooncake_master`` (embedded HTTP metadata server, no etcd) on
127.0.0.1 with free ports, and a *holder* process that mounts the store's memory (a segment of
``segment_bytes``); it stops both by their process ids. Stage processes get ``segment: 0``, so every
object they put lives in the holder and every put and get crosses TCP (a process reading a replica in
its own segment gets a local memcpy). An external master can be given instead (``master=HOST:PORT``,
``metadata=URL``): then only the holder is started. Every Mooncake process gets
``MC_TCP_BIND_ADDRESS=127.0.0.1``; the master's RPC, metadata and metrics ports are picked free
(Mooncake's default master port, 50051, is also the transfer-engine connector's default ZMQ port).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_accum.arena.region import pid_alive as _alive  # noqa: F401 - re-exported by bench.mooncake (a zombie counts as dead)
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


class _MasterExited(MooncakeUnavailable):
    """The master exited while starting (a port taken since it was picked, say): started again on new ports."""


#: Starts of a master that exits at once (each on newly picked ports) before giving up.
MASTER_STARTS = 3


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


try:  # resolved here, not in a preexec_fn (no import between fork and exec)
    _LIBC: Any = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: this process gets ``sig`` when its parent dies (a killed bench or test run leaves no service
    behind). Used as ``preexec_fn`` and at the start of helper processes; a no-op elsewhere."""
    if _LIBC is not None:
        _LIBC.prctl(1, int(sig))  # PR_SET_PDEATHSIG


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on :data:`HOST` now (all held while they are picked, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind((HOST, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


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


def _stop(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


#: How :func:`parse_size` reads a unit (the connectors' rule, ``mooncake_buffer_bytes``'s).
UNITS_SAID = "KB, MB, GB are 10^3, 10^6, 10^9 bytes; KiB, MiB, GiB (and K, M, G) 2^10, 2^20, 2^30"


def parse_size(text: str | int) -> int:
    """``512MiB``, ``1GiB``, ``256M``, ``1GB``, or bytes -> bytes, by the connectors' units (``mooncake_buffer_bytes``,
    :func:`.arena_settings.parse_size`, which reads them): ``MB`` is 10^6 bytes, ``MiB`` (and ``M``) 2^20, so that a
    size means the same on the bench's command line as in a deploy's ``extra``."""
    from omni_accum.integrations.vllm_omni.mooncake_settings import parse_size as connectors  # noqa: PLC0415

    if isinstance(text, int) and not isinstance(text, bool):
        return text
    try:
        n = connectors(str(text), "size", minimum=0)
    except ValueError as e:  # its words name a connector's extra key: the bench's own here
        if "whole number" in str(e):
            raise OmniAccumError(f"not a size: {text!r} is not a whole number of bytes") from None
        raise OmniAccumError(f"not a size: {text!r} (give bytes, or a number with B, KiB, MiB, GiB, KB, MB, GB: "
                             f"{UNITS_SAID})") from None  # fmt: skip
    if n <= 0:
        raise OmniAccumError(f"not a size: {text!r} (it must be at least 1 byte)")
    return n


def segment_problem(segment: int, what: str, zero_ok: bool = False) -> str | None:
    """Why Mooncake's setup refuses a segment of ``segment`` bytes (``what`` names where it was given), or None:
    other than 0 (``zero_ok``: no memory contributed) it must be at least 16 MiB, and at most this host's memory,
    else the setup fails with rc -600 (the bench's holder said so only after its services had started)."""
    from omni_accum.integrations.vllm_omni.mooncake_settings import MIN_SEGMENT, segment_too_large  # noqa: PLC0415

    too_large = segment_too_large(segment)
    if too_large is not None:
        return f"{what} is {segment} bytes, which {too_large}; give a smaller one"
    if 0 < segment < MIN_SEGMENT:
        return (f"{what} is {segment} bytes, under Mooncake's smallest segment: its setup fails (rc -600, 'Total size "
                f"must be at least {MIN_SEGMENT}'); give {'0 or ' if zero_ok else ''}at least 16MiB ({MIN_SEGMENT} "
                "bytes)")
    return None


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
    _tmp: Any = field(default=None, repr=False)  # the holder's private working directory

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
                for attempt in range(MASTER_STARTS):  # another process may take a port between pick and bind
                    try:
                        self._start_master(timeout)
                        break
                    except _MasterExited:
                        if attempt == MASTER_STARTS - 1:
                            raise
            self._start_holder(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_master(self, timeout: float) -> None:
        binary = master_binary()
        self.rpc_port, self.http_port, self.metrics_port = free_ports(3)
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
            args,
            preexec_fn=die_with_parent,
            stdin=subprocess.DEVNULL,
            stdout=self._log("master"),
            stderr=subprocess.STDOUT,
            env=self.env(),
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.master_proc.poll() is not None:
                raise _MasterExited(f"mooncake_master exited with {self.master_proc.returncode} ({' '.join(args)})")
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
            [
                self.python,
                "-m",
                "omni_accum.bench.mooncake",
                "holder",
                self.master_addr,
                self.metadata_url,
                str(self.segment_bytes),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log("holder"),
            env=self.env(),
            cwd=self._holder_dir(),  # private: python -m puts its cwd first on sys.path (a shared /tmp could plant)
        )
        line = _readline(self.holder_proc.stdout, timeout).strip()
        if line != "ready":
            try:  # it exits right after saying why
                code: int | None = self.holder_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            where = f" against master {self.master_addr} (metadata {self.metadata_url})" if self.master else ""
            hint = "; is that master running and reachable from here?" if self.master else ""
            said = f"it said: {line}" if line else f"it said nothing within {timeout:.0f} s"
            ended = "" if code is None else f", exit status {code}"
            raise MooncakeUnavailable(f"the Mooncake holder process did not start{where} ({said}{ended}){hint}")

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

    def _holder_dir(self) -> str:
        self._tmp = self._tmp or tempfile.TemporaryDirectory(prefix="omni-accum-mooncake-")
        return self._tmp.name

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
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            tmp.cleanup()

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

    die_with_parent()
    store = MooncakeDistributedStore()
    rc = store.setup(HOST, metadata, segment, 16 << 20, "tcp", "", master)
    if rc != 0:
        print(f"Mooncake's setup of a {segment}-byte segment failed with rc {rc}", flush=True)  # one line
        return 1
    print("ready", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.stdin.close())
    try:
        sys.stdin.read()
    except (OSError, ValueError):
        pass
    store.close()
    return 0
