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


def test_the_shared_memory_model_returns_chunk_0_bit_for_bit_and_unlinks_its_segments(gpu_handoff, monkeypatch):
    made: list[str] = []  # the segments it creates (by name: another process may make segments of its own meanwhile)

    class Recorded(gpu_handoff.shared_memory.SharedMemory):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self.name)

    monkeypatch.setattr(gpu_handoff.shared_memory, "SharedMemory", Recorded)
    g = torch.Generator().manual_seed(3)
    src = [torch.randn(37, 2048, generator=g).bfloat16() for _ in range(2)]
    got = gpu_handoff._shm_copies(src)
    assert len(made) == 2 and not [n for n in made if os.path.exists(f"/dev/shm/{n.lstrip('/')}")], made
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


MED = {"memcpy": 10.0, "shm_copies": 160.0, "d2h_snapshot": 2.0, "d2h_cpu": 35.0, "d2h_pinned": 1.0,
       "d2h_slab": 4.0, "d2h_slab_registered": 1.5, "h2d_pageable": 7.0, "h2d_slab": 6.0}


def test_the_expected_hand_off_adds_0_30_0s_pieces(gpu_handoff):
    e = gpu_handoff.expected(MED)
    # vllm-omni 0.30.0's runner snapshot (pinned), six host copies, a pageable H2D
    assert e["shm_path"] == 2.0 + 160.0 + 7.0
    # the same snapshot, the sender's one copy into the slab, the H2D from the receiver's view
    assert e["arena_path"] == 2.0 + 10.0 + 6.0
    assert e["arena_d2h_into_slab"] == 1.5 + 6.0
    assert e["arena_over_shm"] == round(18.0 / 169.0, 3)
    # a runner without the snapshot: the processor's .cpu() is a pageable D2H
    assert e["shm_path_pageable_d2h"] == 35.0 + 160.0 + 7.0 and e["arena_path_pageable_d2h"] == 35.0 + 10.0 + 6.0
    older = {k: v for k, v in MED.items() if k not in ("d2h_snapshot", "d2h_slab_registered")}
    e = gpu_handoff.expected(older)  # an older result: the pinned copy stands in, the unregistered slab
    assert e["shm_path"] == 1.0 + 160.0 + 7.0 and e["arena_d2h_into_slab"] == 4.0 + 6.0


def test_a_stored_run_is_worked_out_again_from_its_medians(gpu_handoff, tmp_path, capsys):
    stored = tmp_path / "old.json"
    stored.write_text(json.dumps({"device": "NVIDIA H200", "cpus": 16, "torch": "2.11.0", "results": {
        "8000": {"payload_bytes": 65536000, "median_ms": MED, "GB_per_s": {k: 1.0 for k in MED},
                 "bit_identical": {k: True for k in MED}, "expected_ms": {"shm_path": 1.0}},
        "16": {"payload_bytes": 131072, "median_ms": {"memcpy": 0.1, "shm_copies": 0.2},
               "GB_per_s": {"memcpy": 1.0, "shm_copies": 1.0},
               "bit_identical": {"memcpy": True, "shm_copies": True}}}}))
    again = tmp_path / "again.json"
    assert gpu_handoff.main(["--from-json", str(stored), "--json", str(again)]) == 0
    res = json.loads(again.read_text())
    assert res["device"] == "NVIDIA H200"
    assert res["results"]["8000"]["expected_ms"] == gpu_handoff.expected(MED)
    assert "expected_ms" not in res["results"]["16"]  # host pieces only: nothing to add up
    out = capsys.readouterr().out
    assert "(stored: " in out and "arena 18.0 ms (0.107x)" in out


def test_a_file_that_is_not_a_result_is_named(gpu_handoff, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    for text in ('{"results": {"8000": {"median_ms": {"d2h_pinned": 1.0}}}}',  # pieces missing
                 '{"results": {"16": {"payload_bytes": 1, "median_ms": {"memcpy": 0.1}}}}',  # no GB_per_s
                 '[1, 2]', 'not json'):
        bad.write_text(text)
        assert gpu_handoff.main(["--from-json", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"gpu_handoff: --from-json {bad}: not a result of this script"), text
    assert gpu_handoff.main(["--from-json", str(tmp_path / "absent.json")]) == 2
    assert "not a result of this script (FileNotFoundError" in capsys.readouterr().err
