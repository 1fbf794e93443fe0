"""The peer hello itself: its key, its content, and where it lives between processes on one host.

A receiving stage's hello is a small JSON value (:data:`HELLO`: ``[1, fingerprint, source, pid, host name, machine
id]``) under :func:`hello_key` (the deployment token of :func:`deployment_token`, the stage pair). Over shared memory
it is a file of its own in this user's private directory (:class:`ShmChannel`, :data:`SHM_CHANNEL`); over any other
connector, that connector's ``put`` / ``get`` / ``cleanup`` of the key (:func:`_channel`). :func:`machine_id` says
where a hello's process id names the same process as here. :mod:`.peer` is who says hello and who listens.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import threading
from pathlib import Path
from typing import Any

from omni_accum import samehost

#: The deployment token: one value for every stage process of one server.
ENV_DEPLOYMENT = "OMNI_ACCUM_DEPLOYMENT"
#: The payload key of a hello: ``[1, fingerprint, source, pid, host name, machine id]`` (an older omni-accum's has no
#: machine id: its host name is compared then).
HELLO = "omni_accum_hello"

_lock = threading.Lock()  # the first deployment token of this process, made once


def deployment_token() -> str:
    """``OMNI_ACCUM_DEPLOYMENT``, or a fresh random token written there (the processes started from this
    one inherit it)."""
    tok = os.environ.get(ENV_DEPLOYMENT, "").strip()
    if not tok:
        with _lock:
            tok = os.environ.get(ENV_DEPLOYMENT, "").strip()
            if not tok:
                tok = os.environ[ENV_DEPLOYMENT] = secrets.token_hex(6)
    return tok


def hello_key(src: int, dst: int) -> str:
    """The connector key of the hello that stage ``dst`` (receiving) puts for stage ``src`` (sending)."""
    tok = re.sub(r"[^A-Za-z0-9_.-]", "_", deployment_token())[:64]
    return f"omni_accum_hello_{tok}_{src}_{dst}"


#: The largest hello read (bytes); a larger file is refused.
HELLO_MAX = 4096


class ShmChannel:
    """Hellos as files of their own in this user's private directory (see the module docstring)."""

    def path(self, key: str) -> Path:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,200}", key) or key.startswith("."):
            raise ValueError(f"hello key {key!r}: use letters, digits, '_', '.', '-'")
        return samehost.private_dir() / key

    def put(self, src: str, dst: str, key: str, data: Any) -> tuple[bool, int, None]:
        body = json.dumps(data).encode()
        path = self.path(key)
        samehost.write_private(path, body, str(os.getpid()))  # whole or not at all
        # removed if this process ends without withdrawing it (as the arena's regions), unless another replica of
        # the stage wrote its own hello there since
        samehost.track(path, body.decode())
        return True, len(body), None

    def get(self, src: str, dst: str, key: str) -> tuple[Any, int] | None:
        try:
            body = samehost.read_private(self.path(key), HELLO_MAX)
            return json.loads(body), len(body)
        except samehost.SameHostRefused as e:
            if samehost.log_refusal(e, "peer hello"):
                from omni_accum.integrations.vllm_omni.prometheus import fallback  # noqa: PLC0415

                fallback("samehost_refused")
            return None
        except (OSError, ValueError, RecursionError):
            return None

    def stamp(self, key: str) -> tuple[int, int, int] | None:
        """What changes when the hello file is rewritten or removed (a stat, no read); None: not there."""
        try:
            st = os.stat(self.path(key), follow_symlinks=False)
        except (OSError, ValueError, samehost.SameHostRefused):  # (a private folder refused: get says so, once)
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def cleanup(self, key: str) -> None:
        path = self.path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        samehost.untrack(path)

    def withdraw(self, key: str) -> None:
        """Remove this process's hello under ``key``. Replicas of a receiving stage (vllm-omni's ``num_replicas``)
        on one host share the key, the last one written is there: a hello another live or dead process wrote
        since stays (its writer withdraws it, or the reaper of a dead one removes it)."""
        path = self.path(key)
        samehost.untrack(path)
        h = _hello_of(self.get("", "", key))
        if h is None or (h[3] == os.getpid() and same_machine(h)):
            self.cleanup(key)


SHM_CHANNEL = ShmChannel()


def _channel(conn: Any) -> Any:
    """What carries the hellos of connector ``conn``: for shared memory (key-addressed, this host)
    :data:`SHM_CHANNEL`, so the adapter's connector counts no put or byte that vllm-omni did not make;
    else the connector itself."""
    chan = getattr(conn, "peer_channel", None) or conn
    from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

    return SHM_CHANNEL if isinstance(chan, SharedMemoryConnector) else chan


def _stage(conn: Any) -> int | None:
    try:
        return int(conn.stage_id)
    except (AttributeError, TypeError, ValueError):
        return None


def _hello_of(got: Any) -> list[Any] | None:
    data = got[0] if isinstance(got, tuple) and got else None
    h = data.get(HELLO) if isinstance(data, dict) else None
    if isinstance(h, list) and len(h) >= 5 and isinstance(h[1], str) and type(h[3]) is int:
        return h
    return None


_machine: str | None = None


def machine_id() -> str:
    """Where a process id names the same process as here: 12 hex digits of a hash of the kernel's boot id
    (``/proc/sys/kernel/random/boot_id``: cloned machines differ, processes of one boot share it, network namespaces
    included) and this process's PID namespace (``/proc/self/ns/pid``: containers on one kernel differ). Without
    either, one of this process only (no hello is then judged by its pid)."""
    global _machine
    if _machine is None:
        seed = []
        for path, read in (("/proc/sys/kernel/random/boot_id", lambda p: Path(p).read_text().strip()),
                           ("/proc/self/ns/pid", os.readlink)):  # fmt: skip
            try:
                seed.append(read(path))
            except OSError:
                seed.append("")
        if not all(seed):
            seed = [f"pid:{os.getpid()}:{secrets.token_hex(8)}"]
        _machine = hashlib.sha256("\n".join(seed).encode()).hexdigest()[:12]
    return _machine


def same_machine(h: list[Any]) -> bool:
    """Whether hello ``h`` comes from a process whose id means the same process here (:func:`machine_id`; a hello
    without one, from an older omni-accum: the same host name)."""
    if len(h) >= 6 and isinstance(h[5], str):
        return h[5] == machine_id()
    return h[4] == socket.gethostname()


def _stale(h: list[Any]) -> bool:
    """True for a hello from a process on this machine (:func:`same_machine`) that is no longer alive."""
    return same_machine(h) and not samehost.pid_alive(h[3])
