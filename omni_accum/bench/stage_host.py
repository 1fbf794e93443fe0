"""Stage processes forked from a host that imported vllm-omni and Mooncake once.

Importing vllm-omni costs 15 s or more per process; forking costs milliseconds. :class:`StageHost`
runs ``python -m omni_accum.bench.mooncake stage-host MODULE...``, which imports the modules and then,
per :meth:`StageHost.run`, forks one fresh process per :class:`Job` (all at once, sharing os.pipe()
pairs) and reports their exit statuses; each job's picklable result comes back through a file.
:func:`make_connector` builds vllm-omni 0.30.0's ``MooncakeStoreConnector`` in a stage process.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_accum.errors import OmniAccumError

from omni_accum.bench.mooncake_services import (
    CONNECTOR,
    MOONCAKE_ENV,
    STAGE_PRELOAD,
    _readline,
    _stop,
    die_with_parent,
)


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

    def __init__(
        self,
        *,
        env: Mapping[str, str] | None = None,
        preload: Sequence[str] = STAGE_PRELOAD,
        python: str = sys.executable,
        pythonpath: Sequence[str] = (),
    ) -> None:
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
            pickle.dump(
                {"jobs": [(j.fn, j.kwargs, j.env, o) for j, o in zip(jobs, outs)], "pipes": pipes, "timeout": timeout},
                f,
            )
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
    die_with_parent()
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
                die_with_parent()
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


def _plan(wl: Any, cl: int, concurrency: int) -> tuple[Any, list[list[dict[str, Any]]]]:
    from omni_accum.bench.streams import append_length_hints, build_stream  # noqa: PLC0415
    from omni_accum.context import StreamContext  # noqa: PLC0415

    streams = [build_stream(wl, cl, r) for r in range(concurrency)]
    hints = append_length_hints(wl, streams[0])
    return StreamContext(context_len=cl, concurrency=concurrency, length_hints=hints), streams
