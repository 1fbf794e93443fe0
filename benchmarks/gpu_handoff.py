"""What the prefill hand-off of one Qwen3-Omni chunk 0 costs on a GPU server's host, piece by piece, in one run.

    python3 benchmarks/gpu_handoff.py --rows 8000,32000 --repeats 7 [--json OUT.json]

The end-to-end harness runs vllm-omni on CPU, where the thinker's rows are born in host memory. On a GPU server
they are born on the GPU. vllm-omni 0.30.0's thinker runner (``use_async_omni_output``, on with ``async_chunk``
and async scheduling) snapshots each step's captured layers to host memory itself: it clones them on the device,
then copies them on a side stream into pinned host tensors allocated for the step
(``_snapshot_tensor_payload_to_cpu_async``, ``pin_memory=is_pin_memory_available()``). The thinker-to-talker
processor (``thinker2talker_async_chunk``) then takes ``embed.prefill`` and ``hidden_states.output`` (``[P, 2048]``
bf16 each) with ``.detach().cpu()``, which returns those host tensors as they are; a runner without that snapshot
(async scheduling off) hands the processor device tensors, and ``.cpu()`` is a pageable copy. The talker's runner
moves what it received back onto its own device. This script times, on the machine it runs on, each piece of that
path for both tensors of a prompt of P tokens:

* ``d2h_snapshot``: 0.30.0's runner snapshot as its code makes it (clone on the device, a pinned host tensor
  allocated per call, the copy on a side stream, the wait for its event);
* ``d2h_cpu``: ``t.detach().cpu()`` on a device tensor (a new pageable tensor: the path without the snapshot);
* ``d2h_pinned``: into a pinned buffer allocated beforehand;
* ``d2h_slab``: into a warm buffer over a ``/dev/shm`` mapping, what the arena's staged rows are (the rows
  copied into the arena's slab as they come, so the put copies none);
* ``d2h_slab_registered``: the same slab registered with CUDA (``cudaHostRegister``), page-locked;
* ``memcpy``: one host copy of the payload's bytes into a warm buffer (one thread); vllm-omni's
  ``SharedMemoryConnector`` makes about six such copies of chunk 0 (to bytes, into the msgpack buffer, into a
  fresh segment, out of it, the decode, a bytearray) where the arena makes one (the sender's, into the slab)
  and the receiver none (views);
* ``shm_copies``: those six copies made with the same Python primitives (a model of that path, not vllm-omni's
  code: its serializer and connector import the whole of vLLM, which this machine may not have);
* ``h2d_pageable`` / ``h2d_slab`` / ``h2d_pinned``: the talker's move back onto the device from a pageable
  tensor (what the SHM path hands it), from the arena's view, and from pinned memory.

Medians over ``--repeats`` after one warm-up; every copy is checked bit for bit against the source (untimed).
Without CUDA (or with ``--device cpu``) only the host pieces run. Read ratios between pieces of one run.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from multiprocessing import shared_memory
from typing import Any, Callable

import torch
from _rows import rows_and_repeats  # benchmarks/, the folder of this script

_clock = time.perf_counter


def _timed(fn: Callable[[], Any], repeats: int, sync: bool) -> tuple[float, Any]:
    """Median milliseconds of ``fn`` over ``repeats`` runs after a warm-up, and the result of one more (untimed)."""

    def once() -> Any:
        out = fn()
        if sync:
            torch.cuda.synchronize()
        return out

    once()
    times = []
    for _ in range(repeats):
        t0 = _clock()
        out = once()
        times.append((_clock() - t0) * 1e3)
        del out  # freed after the clock, before the next run (which does not find its memory still held)
    return statistics.median(times), once()


class _Slab:
    """A warm host buffer over a /dev/shm file mapping (what the arena's region is), as bf16 tensors."""

    def __init__(self, nbytes: int):
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.file = tempfile.NamedTemporaryFile(dir=folder, prefix="gpu-handoff-")
        os.ftruncate(self.file.fileno(), nbytes)
        self.map = mmap.mmap(self.file.fileno(), nbytes)
        self.flat = torch.frombuffer(self.map, dtype=torch.uint8)
        self.flat.fill_(0)  # pages taken and mapped: a warm slab
        self.registered = False

    def tensors(self, shape: tuple[int, int], n: int) -> list[torch.Tensor]:
        per = shape[0] * shape[1] * 2
        return [self.flat[i * per : (i + 1) * per].view(torch.bfloat16).view(shape) for i in range(n)]

    def register(self) -> bool:
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(self.flat.data_ptr(), self.flat.numel(), 0)
        self.registered = int(rc) == 0 if not isinstance(rc, tuple) else int(rc[0]) == 0
        return self.registered

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
        del self.flat
        self.map.close()
        self.file.close()


def _shm_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The six host copies of vllm-omni's shared-memory path, made with the same Python primitives."""
    out = []
    for t in tensors:
        raw = t.view(torch.uint8).numpy().tobytes()  # 1. tensor -> bytes
        packed = bytearray()
        packed += raw  # 2. into the msgpack buffer
        del raw
        seg = shared_memory.SharedMemory(create=True, size=len(packed))  # a fresh segment per put
        try:
            seg.buf[: len(packed)] = packed  # 3. into the segment
            del packed
            back = bytes(seg.buf[: seg.size])  # 4. out of it
        finally:
            seg.close()
            seg.unlink()
        decoded = bytes(memoryview(back))  # 5. msgspec's decode of a bin field (a bytes object)
        del back
        buf = bytearray(decoded)  # 6. a writable bytearray for torch.frombuffer
        del decoded
        out.append(torch.frombuffer(buf, dtype=torch.bfloat16).view(t.shape))
    return out


def _runner_snapshot(dev: list[torch.Tensor], copy_stream: Any) -> list[torch.Tensor]:
    """vllm-omni 0.30.0's ``_snapshot_tensor_payload_to_cpu_async`` for these tensors, waited for as its output is."""
    cloned = [t.detach().clone() for t in dev]
    ready = torch.cuda.Event()
    with torch.cuda.stream(copy_stream):
        copy_stream.wait_stream(torch.cuda.current_stream())
        out = []
        for c in cloned:
            cpu = torch.empty_like(c, device="cpu", pin_memory=True)
            cpu.copy_(c, non_blocking=True)
            out.append(cpu)
        ready.record(copy_stream)
    ready.synchronize()
    return out


def expected(med: dict[str, float]) -> dict[str, float]:
    """The expected hand-off of chunk 0 on this host, pieces added (milliseconds, and ratios to vllm-omni's path).

    ``shm_path``: vllm-omni 0.30.0 over ``SharedMemoryConnector`` (the runner's pinned snapshot, six host copies,
    a pageable H2D); ``arena_path``: over omni-accum's arena as it is (the same snapshot, one copy into the slab,
    the H2D from the view); ``arena_d2h_into_slab``: the snapshot landing in the slab registered with CUDA instead
    (not built: the runner's allocation would have to come from the arena). The ``*_pageable_d2h`` pair: the same
    two paths for a runner without the snapshot, whose processor's ``.cpu()`` makes a pageable copy. A run without
    ``d2h_snapshot`` (an older output of this script) uses ``d2h_pinned`` for it: the same copy, its buffer
    allocated beforehand.
    """
    snap = med.get("d2h_snapshot", med["d2h_pinned"])
    into_slab = med.get("d2h_slab_registered", med["d2h_slab"])
    off = snap + med["shm_copies"] + med["h2d_pageable"]
    arena = snap + med["memcpy"] + med["h2d_slab"]
    direct = into_slab + med["h2d_slab"]
    off_p = med["d2h_cpu"] + med["shm_copies"] + med["h2d_pageable"]
    arena_p = med["d2h_cpu"] + med["memcpy"] + med["h2d_slab"]
    return {"shm_path": round(off, 2), "arena_path": round(arena, 2), "arena_d2h_into_slab": round(direct, 2),
            "arena_over_shm": round(arena / off, 3), "arena_d2h_into_slab_over_shm": round(direct / off, 3),
            "shm_path_pageable_d2h": round(off_p, 2), "arena_path_pageable_d2h": round(arena_p, 2),
            "arena_over_shm_pageable_d2h": round(arena_p / off_p, 3)}


def run(rows_list: list[int], repeats: int, device: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    cuda = device == "cuda"
    results: dict[str, Any] = {}
    for rows in rows_list:
        shape = (rows, 2048)
        g = torch.Generator().manual_seed(rows)
        host = [torch.randn(*shape, generator=g).bfloat16() for _ in range(2)]
        nbytes = sum(t.numel() * 2 for t in host)
        med: dict[str, float] = {}
        checks: dict[str, bool] = {}

        def check(name: str, got: list[torch.Tensor]) -> None:
            checks[name] = all(torch.equal(a.cpu(), b) for a, b in zip(got, host))

        warm = [torch.empty_like(t).fill_(0) for t in host]
        med["memcpy"], got = _timed(lambda: [d.copy_(s) for d, s in zip(warm, host)], repeats, False)
        check("memcpy", got)
        med["shm_copies"], got = _timed(lambda: _shm_copies(host), repeats, False)
        check("shm_copies", got)
        if cuda:
            dev = [t.to("cuda") for t in host]
            pinned = [torch.empty_like(t).pin_memory() for t in host]
            slab = _Slab(nbytes)
            slab_t = slab.tensors(shape, 2)
            copy_stream = torch.cuda.Stream()
            med["d2h_snapshot"], got = _timed(lambda: _runner_snapshot(dev, copy_stream), repeats, True)
            check("d2h_snapshot", got)
            med["d2h_cpu"], got = _timed(lambda: [t.detach().cpu() for t in dev], repeats, True)
            check("d2h_cpu", got)
            med["d2h_pinned"], got = _timed(lambda: [p.copy_(t, non_blocking=True) for p, t in zip(pinned, dev)],
                                            repeats, True)
            check("d2h_pinned", got)
            med["d2h_slab"], got = _timed(lambda: [s.copy_(t) for s, t in zip(slab_t, dev)], repeats, True)
            check("d2h_slab", got)
            pageable = [t.clone() for t in host]
            med["h2d_pageable"], got = _timed(lambda: [t.to("cuda") for t in pageable], repeats, True)
            check("h2d_pageable", got)
            med["h2d_slab"], got = _timed(lambda: [s.to("cuda") for s in slab_t], repeats, True)
            check("h2d_slab", got)
            med["h2d_pinned"], got = _timed(lambda: [p.to("cuda", non_blocking=True) for p in pinned], repeats, True)
            check("h2d_pinned", got)
            if slab.register():
                med["d2h_slab_registered"], got = _timed(
                    lambda: [s.copy_(t, non_blocking=True) for s, t in zip(slab_t, dev)], repeats, True)
                check("d2h_slab_registered", got)
                med["h2d_slab_registered"], got = _timed(
                    lambda: [s.to("cuda", non_blocking=True) for s in slab_t], repeats, True)
                check("h2d_slab_registered", got)
            del got, slab_t
            slab.close()
            del dev, pinned
            torch.cuda.empty_cache()
        gbps = {k: round(nbytes / (v / 1e3) / 1e9, 2) for k, v in med.items()}
        results[str(rows)] = {"payload_bytes": nbytes, "median_ms": {k: round(v, 3) for k, v in med.items()},
                              "GB_per_s": gbps, "bit_identical": checks}
        if cuda:
            results[str(rows)]["expected_ms"] = expected(med)
    return results


def _report(res: dict[str, Any]) -> None:
    for rows, r in res.items():
        print(f"P={rows}: {r['payload_bytes'] / 1e6:.1f} MB")
        for k, v in r["median_ms"].items():
            print(f"  {k:<22} {v:9.2f} ms  {r['GB_per_s'][k]:7.2f} GB/s  bit-identical {r['bit_identical'][k]}")
        if "expected_ms" in r:
            e = r["expected_ms"]
            print(f"  expected hand-off: SHM path {e['shm_path']:.1f} ms, arena {e['arena_path']:.1f} ms "
                  f"({e['arena_over_shm']:.3f}x), the snapshot into the slab {e['arena_d2h_into_slab']:.1f} ms "
                  f"({e['arena_d2h_into_slab_over_shm']:.3f}x); without the runner's snapshot (pageable .cpu()): "
                  f"SHM path {e['shm_path_pageable_d2h']:.1f} ms, arena {e['arena_path_pageable_d2h']:.1f} ms "
                  f"({e['arena_over_shm_pageable_d2h']:.3f}x)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8000,32000", help="prompt lengths P, comma-separated (default 8000,32000)")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per piece after one warm-up (default 7)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda times the device copies too (default: cuda when available)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--from-json", metavar="FILE",
                    help="time nothing: print the results this script wrote to FILE, the expected hand-off worked out "
                         "again from its medians (with --json, written there)")
    args = ap.parse_args(argv)
    if args.from_json:
        try:
            with open(args.from_json) as f:
                stored = json.load(f)
            res = stored["results"]
            for r in res.values():
                med = r["median_ms"]
                if "d2h_pinned" in med:
                    r["expected_ms"] = expected(med)
            print(f"torch {stored.get('torch')}, {stored.get('device')}, {stored.get('cpus')} CPUs "
                  f"(stored: {args.from_json})", flush=True)
            _report(res)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            print(f"gpu_handoff: --from-json {args.from_json}: not a result of this script ({e!r})", file=sys.stderr)
            return 2
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**stored, "results": res}, f, indent=1)
        return 0
    rows_list = rows_and_repeats("gpu_handoff", args.rows, args.repeats)
    if rows_list is None:
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_handoff: --device cuda: torch sees no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}, {os.cpu_count()} CPUs", flush=True)
    res = run(rows_list, args.repeats, args.device)
    _report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "cpus": os.cpu_count(), "torch": torch.__version__, "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
