"""benchmarks/gpu_handoff.py on CPU: the host pieces it times copy chunk 0 bit for bit, leave no shared-memory
segment behind, and its arguments are checked (the device pieces need a GPU: benchmarks/e2e/README.md has a run)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_handoff.py"


@pytest.fixture()
def gpu_handoff(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # as `python3 benchmarks/gpu_handoff.py` has it (its _rows)
    spec = importlib.util.spec_from_file_location("gpu_handoff", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _segments() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_the_shared_memory_model_returns_chunk_0_bit_for_bit_and_unlinks_its_segments(gpu_handoff):
    g = torch.Generator().manual_seed(3)
    src = [torch.randn(37, 2048, generator=g).bfloat16() for _ in range(2)]
    before = _segments()
    got = gpu_handoff._shm_copies(src)
    assert _segments() <= before
    assert all(a.dtype == torch.bfloat16 and a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, src))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(got, src))


def test_a_cpu_run_times_the_host_pieces_and_checks_them(gpu_handoff, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert gpu_handoff.main(["--device", "cpu", "--rows", "16,48", "--repeats", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["device"] == "cpu"
    for rows in ("16", "48"):
        r = res["results"][rows]
        assert r["payload_bytes"] == 2 * int(rows) * 2048 * 2
        assert set(r["median_ms"]) == {"memcpy", "shm_copies"} == set(r["bit_identical"])
        assert all(r["bit_identical"].values())
        assert "expected_ms" not in r  # the expected hand-off needs the device pieces
    assert "P=48: 0.4 MB" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--rows", "8000,x"], ["--rows", "0"], ["--repeats", "0"]])
def test_bad_arguments_are_named_without_a_traceback(gpu_handoff, capsys, argv):
    assert gpu_handoff.main(["--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu_handoff: --rows") and "positive integers" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal is for machines without")
def test_cuda_asked_for_without_a_device_is_refused(gpu_handoff, capsys):
    assert gpu_handoff.main(["--device", "cuda", "--rows", "16"]) == 2
    assert "torch sees no CUDA device (use --device cpu)" in capsys.readouterr().err
