"""The memory check of bench and tune: worked out from the workload's shapes without allocating, counting everything
built before the replay, naming the option to lower; an allocation that fails anyway is one line (exit 1 in both)."""

from __future__ import annotations

import pytest
import torch
import yaml

from omni_accum import bench
from omni_accum.bench import streams
from omni_accum.bench.streams import build_stream, stream_nbytes
from omni_accum.bench.wires import iter_leaves
from omni_accum.bench.workloads import load_workload, workload_names
from omni_accum.cli import main

#: 2000 decode rows of 4194304 float32 each: ~33 GB of stream, the same again held by the receiver.
BIG_DECODE = {
    "name": "w",
    "context_len": 10,
    "decode_steps": 2000,
    "concurrency": [1],
    "keys": [{"path": "x", "kind": "append", "carried": "decode", "row_shape": [4194304], "dtype": "float32"}],
}


def _built_nbytes(wl, context_len: int, concurrency: int) -> int:
    """Bytes of the streams ``measure`` builds: shared tensors once, every request's own values."""
    seen: set[int] = set()
    total = 0
    built = [build_stream(wl, context_len, r) for r in range(concurrency)]  # alive together: ids stay unique
    for stream in built:
        for chunk in stream:
            for _, v in iter_leaves(chunk):
                if isinstance(v, torch.Tensor):
                    if id(v) not in seen:
                        seen.add(id(v))
                        total += v.numel() * v.element_size()
                elif isinstance(v, list) and not (v and isinstance(v[0], list)):
                    total += 36 * len(v)
    return total


@pytest.mark.parametrize("name", workload_names())
def test_the_stream_bytes_worked_out_equal_what_is_built(name):
    wl = load_workload(name).model_copy(update={"decode_steps": 7})
    for cl in (100, 5000):
        sizes = stream_nbytes(wl, cl)
        assert sizes.shared + 2 * (sizes.prefill + sizes.decode) == _built_nbytes(wl, cl, 2), (name, cl, sizes)


def test_the_check_allocates_nothing_and_names_the_steps(monkeypatch):
    """It built one request's stream to count it: 33 GB for this workload (a traceback under ulimit -v)."""
    monkeypatch.setattr(streams, "_tensor", lambda *a, **k: pytest.fail("the memory check built a tensor"))
    monkeypatch.setattr(bench.runner, "available_memory", lambda: 8_000_000_000)
    problem = bench.runner.bucket_memory_problem(load_workload(BIG_DECODE), 10, 1)
    assert problem.startswith("context_len=10 concurrency=1: needs at least 67.1 GB of memory"), problem
    assert problem.endswith("give fewer --steps (decode steps: 2000)"), problem


def test_keys_read_as_deltas_count_too_since_every_stream_is_built_before_the_replay(monkeypatch):
    """--steps 300000 --concurrency 10 on the 0.30 stream passed the check (its decode rows are read as deltas), used
    7.5 GB for a minute, then failed with a message blaming --context-lens."""
    wl = load_workload("qwen3-omni-0.30").model_copy(update={"decode_steps": 3000})
    monkeypatch.setattr(bench.runner, "available_memory", lambda: 100_000_000)
    problem = bench.runner.bucket_memory_problem(wl, 1000, 10)
    assert problem is not None and "give fewer --steps (decode steps: 3000) or a lower --concurrency" in problem
    assert bench.runner.bucket_memory_problem(wl, 1000, 10, {"steps": "--decode-steps"}).endswith(
        "give fewer --decode-steps (decode steps: 3000) or a lower --concurrency"
    )
    long = bench.runner.bucket_memory_problem(load_workload("qwen3-omni-0.30"), 100_000, 1)
    assert long.endswith("give shorter --context-lens"), long


def test_an_address_space_limit_lowers_what_is_available(monkeypatch):
    monkeypatch.setattr(bench.runner, "address_space_left", lambda: 12345)
    assert bench.runner.available_memory() == 12345


def test_bench_and_tune_refuse_a_bucket_too_large_with_exit_1_before_building_it(tmp_path, monkeypatch, capsys):
    wl = tmp_path / "big.yaml"
    wl.write_text(yaml.safe_dump(BIG_DECODE))
    monkeypatch.setattr(streams, "_tensor", lambda *a, **k: pytest.fail("a stream was built"))
    monkeypatch.setattr(bench.runner, "available_memory", lambda: 8_000_000_000)
    assert main(["bench", "--workload", str(wl), "--arms", "cat", "--repeats", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("omni-accum bench: error: context_len=10 concurrency=1: needs at least") and "--steps" in err
    out = tmp_path / "t.yaml"
    rc = main(["tune", "--workload", str(wl), "--out", str(out), "--context-lens", "10", "--concurrency", "1",
               "--decode-steps", "2000", "--quick", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 1 and "needs at least" in err and "give fewer --decode-steps" in err and "Traceback" not in err
    assert not out.exists()


def test_an_allocation_that_fails_in_tune_anyway_is_one_line(tmp_path, monkeypatch, capsys):
    def tune_bucket(*a, **k):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096004096 bytes.")

    monkeypatch.setattr("omni_accum.tuner.run.tune_bucket", tune_bucket)
    out = tmp_path / "t.yaml"
    rc = main(["tune", "--out", str(out), "--quick", "--context-lens", "1k", "--concurrency", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "context_len=1000 concurrency=1: out of memory (could not allocate 4.1 GB)" in err


def test_an_allocation_failure_no_check_foresaw_is_one_line(monkeypatch, capsys):
    """Anywhere in a command, outside the checks of a bucket: not a traceback."""
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: (_ for _ in ()).throw(MemoryError()))
    rc = main(["bench", "--arms", "cat", "--context-lens", "16", "--concurrency", "1", "--steps", "1", "--repeats", "1",
               "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 1 and "out of memory" in err and "Traceback" not in err


def test_tunes_out_of_memory_line_names_the_partial_file_only_when_one_was_written(tmp_path, monkeypatch, capsys):
    """The first bucket's verification failing said 'the buckets finished so far are in t.partial.yaml', a file
    that was never written; a later bucket failing names it, and it is there."""
    import omni_accum.tuner.run as tune_run

    oom = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096004096 bytes.")
    monkeypatch.setattr(tune_run, "verify_bucket", lambda *a, **k: (_ for _ in ()).throw(oom))
    out = tmp_path / "t.yaml"
    args = ["tune", "--out", str(out), "--quick", "--concurrency", "1", "--decode-steps", "4", "--no-progress"]
    assert main([*args, "--context-lens", "16", "--verify"]) == 1
    err = capsys.readouterr().err
    assert "out of memory" in err and "finished so far" not in err, err
    assert not any(tmp_path.iterdir())
    monkeypatch.undo()
    real, calls = tune_run.tune_bucket, []

    def second_fails(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise oom
        return real(*a, **k)

    monkeypatch.setattr(tune_run, "tune_bucket", second_fails)
    assert main([*args, "--context-lens", "16,32"]) == 1
    err = capsys.readouterr().err
    part = tune_run.partial_path(out)
    assert f"the buckets finished so far are in {part}" in err and part.is_file() and not out.exists(), err
