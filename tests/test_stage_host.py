"""The stage host's request and result files: JSON only, what crosses comes back equal, a pickle is refused."""

from __future__ import annotations

import json
import math
import os
import pickle
import time

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))


def _values():
    from omni_accum.bench.arms import build_arms
    from omni_accum.bench.workloads import load_workload

    wl = load_workload("qwen3-omni-override-ids").model_copy(update={"decode_steps": 7})
    arms = build_arms(wl, ["upstream", "qwen3-omni", "default"])
    tensors = {
        "bf16": torch.randn(5, 3, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
        "zero_d": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4, dtype=torch.int64),
        "bool": torch.tensor([True, False, True]),
        "strided": torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),
    }
    plain = {1: ("a", None, [True, 2.5, -7]), "nan": float("nan"), "inf": float("-inf"), b"k": b"\x00\xff", (1, 2): []}
    return wl, arms, tensors, plain


def _same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() else a, b.reshape(-1).view(torch.uint8) if b.numel() else b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def test_values_cross_the_file_unchanged(tmp_path):
    from omni_accum.bench.stage_host import _read_file, _write_file

    wl, arms, tensors, plain = _values()
    value = {"wl": wl, "arms": arms, "t": tensors, "p": plain}
    _write_file(tmp_path / "f", value)
    json.loads((tmp_path / "f").read_text())  # JSON text
    got = _read_file(tmp_path / "f")
    _same(got, value)
    assert got["wl"] == wl and got["arms"] == arms


def test_unknown_objects_do_not_cross(tmp_path):
    from omni_accum.bench.stage_host import _write_file

    with pytest.raises(TypeError, match="types.SimpleNamespace does not cross"):
        _write_file(tmp_path / "f", {"x": __import__("types").SimpleNamespace(a=1)})


class _Boom:
    """Unpickling this creates the folder ``marker``: proof that the pickle was executed."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize(
    "content",
    [
        "pickle",
        b'{"omni_accum_stage_file": 1, "value": {"$tensor": {"dtype": "float32", "shape": [2], "data": "AAAA"}}}',
        b'{"omni_accum_stage_file": 1, "value": {"$object": "os.system"}}',
        b'{"omni_accum_stage_file": 1, "value": {"$tensor": {"dtype": "Tensor", "shape": [0], "data": ""}}}',
        b'{"value": 1}',
        b"[" * 100000 + b"]" * 100000,
    ],
)
def test_a_result_that_is_not_the_format_is_refused(tmp_path, content):
    from omni_accum.bench.stage_host import _read_result

    marker = tmp_path / "unpickled"
    out = tmp_path / "res.out0"
    out.write_bytes(pickle.dumps(("ok", _Boom(str(marker)))) if content == "pickle" else content)
    status, why = _read_result(str(out), 0)
    assert status == "error" and "result refused" in why and str(out) in why, why
    assert not marker.exists()


def test_an_oversized_file_is_refused(tmp_path):
    from omni_accum.bench.stage_host import BadStageFile, _read_file, _write_file

    _write_file(tmp_path / "f", "x" * 2000)
    with pytest.raises(BadStageFile, match="larger than 1000 bytes"):
        _read_file(tmp_path / "f", limit=1000)


def _job(*, pipes, value):
    for fd in (fd for p in pipes for fd in p):
        os.close(fd)
    return {"pid": os.getpid(), "echo": value}


def _failing_job(*, pipes):
    raise ValueError("on purpose")


@pytest.fixture(scope="module")
def bare_host():
    """A stage host that preloads nothing (no vllm-omni, no Mooncake): the protocol alone."""
    from omni_accum.bench.stage_host import StageHost

    host = StageHost(preload=(), pythonpath=[TESTS]).start(timeout=120)
    try:
        yield host
    finally:
        pid = host.pid
        host.stop()
        assert pid is not None and host.proc.poll() is not None


def test_jobs_run_in_forked_processes_and_their_results_come_back(bare_host):
    from omni_accum.bench.stage_host import Job, StageFailed

    wl, arms, tensors, plain = _values()
    value = {"wl": wl, "arms": arms, "t": tensors, "p": plain}
    a, b = bare_host.run([Job("test_stage_host:_job", {"value": value}), Job("test_stage_host:_job", {"value": 1})])
    assert a["pid"] != b["pid"] != os.getpid() and b["echo"] == 1
    _same(a["echo"], value)
    with pytest.raises(StageFailed, match="ValueError: on purpose"):
        bare_host.run([Job("test_stage_host:_failing_job", {})])


def test_a_pickled_request_is_refused_not_executed(bare_host, tmp_path):
    """A pickle in the request's place (the host's private folder): the host refuses it, runs nothing, and
    goes on serving requests of the format."""
    from omni_accum.bench.mooncake_services import _readline
    from omni_accum.bench.stage_host import Job

    marker = tmp_path / "unpickled"
    req = os.path.join(bare_host._tmp.name, f"req-{time.monotonic_ns()}.json")
    with open(req, "wb") as f:
        pickle.dump({"jobs": [], "pipes": 0, "timeout": _Boom(str(marker))}, f)
    bare_host.proc.stdin.write((req + "\n").encode())
    bare_host.proc.stdin.flush()
    answer = json.loads(_readline(bare_host.proc.stdout, 60))
    assert "not a stage file of this format" in answer["error"] and req in answer["error"], answer
    assert not marker.exists()
    assert bare_host.proc.poll() is None
    (res,) = bare_host.run([Job("test_stage_host:_job", {"value": (1, "x")})], pipes=0)
    assert res["echo"] == (1, "x")
