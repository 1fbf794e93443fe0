"""Stage processes forked from a host that imported vllm-omni and Mooncake once.

Importing vllm-omni costs 15 s or more per process; forking costs milliseconds. :class:`StageHost`
runs ``python -m omni_accum.bench.mooncake stage-host MODULE...``, which imports the modules and then,
per :meth:`StageHost.run`, forks one fresh process per :class:`Job` (all at once, sharing os.pipe()
pairs) and reports their exit statuses; each job's result comes back through a file. The request and
result files (in the host's private temporary folder) are JSON that can make plain values, tuples, dicts,
bytes, tensors, a :class:`~omni_accum.bench.workloads.Workload` and a :class:`~omni_accum.policy.model.Policy`
only (pydantic-validated): nothing read from them is unpickled, and a file that is not this format is refused.
:func:`make_connector` builds vllm-omni 0.30.0's ``MooncakeStoreConnector`` in a stage process.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import json
import math
import os
import signal
import stat
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


# ---------------------------------------------------------------------------------------------- #
# The files between the host and its stage processes: JSON, never pickled
# ---------------------------------------------------------------------------------------------- #

MAX_FILE_BYTES = 1 << 30
"""The largest request or result file read (a result carries its tensors' bytes, base64)."""
MAX_DEPTH = 64
"""The deepest nesting of a value in a request or result."""


class BadStageFile(StageFailed):
    """A request or result file that is not this format's JSON (a pickle, say): refused, never executed."""


def _enc(v: Any, depth: int = 0) -> Any:
    """A JSON value for ``v``: plain values as they are; every other thing a one-key object (``{"$tag": ...}``)."""
    if depth > MAX_DEPTH:
        raise TypeError(f"nested deeper than {MAX_DEPTH}")
    t = type(v)
    if v is None or t is bool or t is int or t is str:
        return v
    if t is float:
        return v if math.isfinite(v) else {"$float": repr(v)}
    if t is list:
        return [_enc(x, depth + 1) for x in v]
    if t is tuple:
        return {"$tuple": [_enc(x, depth + 1) for x in v]}
    if t is dict:
        return {"$dict": [[_enc(k, depth + 1), _enc(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"$bytes": base64.b64encode(v).decode("ascii")}
    mod = t.__module__
    if mod.startswith("torch") and t.__name__ in ("Tensor", "Parameter"):
        return {"$tensor": _enc_tensor(v)}
    from omni_accum.bench.workloads import Workload  # noqa: PLC0415
    from omni_accum.policy.model import Policy  # noqa: PLC0415

    if t is Workload:
        return {"$workload": v.model_dump(mode="json")}
    if t is Policy:
        return {"$policy": {"policy": v.model_dump(mode="json"), "bound": v._plugins is not None}}
    raise TypeError(
        f"a {mod}.{t.__name__} does not cross to or from a stage process (plain values, tuples, dicts, bytes, "
        "tensors, a Workload or a Policy only)"
    )


def _enc_tensor(t: Any) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    c = t.detach().to("cpu").contiguous().reshape(-1)
    raw = c.view(torch.uint8).numpy().tobytes() if c.numel() else b""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": base64.b64encode(raw).decode("ascii")}


def _dec(v: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_dec(x, depth + 1) for x in v]
    if not isinstance(v, dict) or len(v) != 1:
        raise ValueError(f"not a value of this format: {str(v)[:80]!r}")
    ((tag, body),) = v.items()
    if tag == "$tuple" and isinstance(body, list):
        return tuple(_dec(x, depth + 1) for x in body)
    if tag == "$dict" and isinstance(body, list):
        out = {}
        for kv in body:
            if not (isinstance(kv, list) and len(kv) == 2):
                raise ValueError("a $dict item is not a [key, value] pair")
            k = _dec(kv[0], depth + 1)
            if isinstance(k, (list, dict)):
                raise ValueError(f"a $dict key is a {type(k).__name__}")
            out[k] = _dec(kv[1], depth + 1)
        return out
    if tag == "$float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "$bytes" and isinstance(body, str):
        return base64.b64decode(body, validate=True)
    if tag == "$tensor" and isinstance(body, dict):
        return _dec_tensor(body)
    if tag == "$workload" and isinstance(body, dict):
        from omni_accum.bench.workloads import Workload  # noqa: PLC0415

        return Workload.model_validate(body)
    if tag == "$policy" and isinstance(body, dict) and isinstance(body.get("policy"), dict):
        from omni_accum.policy.environment import installed_plugins  # noqa: PLC0415
        from omni_accum.policy.model import Policy  # noqa: PLC0415

        policy = Policy.model_validate(body["policy"], context={"allow_repeats": True})
        if body.get("bound") is True:
            policy.bind_plugins(installed_plugins)
        return policy
    raise ValueError(f"unknown or malformed tag {str(tag)[:40]!r}")


def _dec_tensor(body: dict[str, Any]) -> Any:
    import torch  # noqa: PLC0415

    name, shape, data = body.get("dtype"), body.get("shape"), body.get("data")
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a tensor of dtype {name!r}: not a torch dtype")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape) and isinstance(data, str)):
        raise ValueError(f"a tensor of shape {shape!r}: not a list of sizes, or no data")
    raw = base64.b64decode(data, validate=True)
    numel = math.prod(shape)
    if len(raw) != numel * dtype.itemsize:
        raise ValueError(f"a {name} tensor of shape {shape}: {len(raw)} bytes, not {numel * dtype.itemsize}")
    if not numel:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _write_file(path: str | os.PathLike[str], value: Any) -> None:
    """Write ``value`` (see :func:`_enc`) as JSON, readable only by this user."""
    text = json.dumps({"omni_accum_stage_file": 1, "value": _enc(value)}, allow_nan=False)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def _read_file(path: str | os.PathLike[str], limit: int = MAX_FILE_BYTES) -> Any:
    """The value of a file :func:`_write_file` wrote; :class:`BadStageFile` for anything else (never unpickled)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise BadStageFile(f"{path}: cannot open: {e.strerror}") from e
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise BadStageFile(f"{path}: not a regular file")
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise BadStageFile(f"{path}: larger than {limit} bytes")
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
        if not (isinstance(doc, dict) and doc.keys() == {"omni_accum_stage_file", "value"}
                and doc["omni_accum_stage_file"] == 1):  # fmt: skip
            raise ValueError("not a stage file (no 'omni_accum_stage_file': 1)")
        return _dec(doc["value"])
    except (UnicodeDecodeError, ValueError, TypeError, RecursionError, binascii.Error) as e:
        raise BadStageFile(f"{path}: not a stage file of this format: {e}") from e


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _check_request(req: Any, path: str) -> None:
    """A request as :meth:`StageHost.run` writes it, with its result files beside it; BadStageFile otherwise."""
    where = os.path.dirname(path)
    ok = (
        isinstance(req, dict)
        and req.keys() == {"jobs", "pipes", "timeout"}
        and type(req["pipes"]) is int
        and 0 <= req["pipes"] <= 64
        and type(req["timeout"]) in (int, float)
        and req["timeout"] > 0
        and isinstance(req["jobs"], list)
    )
    for job in req["jobs"] if ok else ():
        ok = ok and (
            isinstance(job, tuple)
            and len(job) == 4
            and isinstance(job[0], str)
            and isinstance(job[1], dict)
            and all(isinstance(k, str) for k in job[1])
            and isinstance(job[2], dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in job[2].items())
            and isinstance(job[3], str)
            and os.path.dirname(job[3]) == where
        )
    if not ok:
        raise BadStageFile(f"{path}: not a stage request (jobs, pipes, timeout; result files beside it)")


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
        req = Path(self._tmp.name) / f"req-{time.monotonic_ns()}.json"
        outs = [str(req) + f".out{i}" for i in range(len(jobs))]
        try:
            _write_file(
                req,
                {"jobs": [(j.fn, j.kwargs, j.env, o) for j, o in zip(jobs, outs)], "pipes": pipes, "timeout": timeout},
            )
        except TypeError as e:
            raise StageFailed(f"a job's arguments cannot go to a stage process: {e}") from e
        assert self.proc.stdin is not None
        self.proc.stdin.write((str(req) + "\n").encode())
        self.proc.stdin.flush()
        line = _readline(self.proc.stdout, timeout + 30)
        if not line:
            raise StageFailed(f"the stage host gave no answer within {timeout + 30:.0f} s")
        rcs = json.loads(line)
        if isinstance(rcs, dict):
            raise StageFailed(f"the stage host refused the request: {rcs.get('error')}")
        results, errors = [], []
        for job, out, rc in zip(jobs, outs, rcs):
            status, value = _read_result(out, rc)
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


def _read_result(out: str, rc: int) -> tuple[str, Any]:
    """``("ok", value)`` or ``("error", why)`` of one job's result file."""
    if not os.path.lexists(out):
        return "error", f"no result (exit status {rc})"
    try:
        res = _read_file(out)
    except BadStageFile as e:
        return "error", f"result refused (exit status {rc}): {e}"
    if not (isinstance(res, tuple) and len(res) == 2 and res[0] in ("ok", "error")):
        return "error", f"result refused (exit status {rc}): {out}: not a (status, value) pair"
    if res[0] == "error" and not isinstance(res[1], str):
        return "error", f"result refused (exit status {rc}): {out}: an error without its text"
    return res


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
        path = line.strip()
        try:
            req = _read_file(path)
            _check_request(req, path)
        except BadStageFile as e:
            proto.write(json.dumps({"error": str(e)}) + "\n")
            proto.flush()
            continue
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
                    _write_file(out, ("ok", value))
                    rc = 0
                except BaseException:  # noqa: BLE001 - reported to the parent
                    _write_file(out, ("error", traceback.format_exc()))
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
