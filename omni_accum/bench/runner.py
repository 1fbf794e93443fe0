"""Running a bench: every arm in every bucket (context length x concurrency), with a progress bar.

:func:`run_bench` returns a :class:`~omni_accum.bench.report.BenchRun`; :mod:`~omni_accum.bench.report`
formats it (tables, JSON) and :mod:`~omni_accum.bench.plotting` draws it. Arms come from
:mod:`~omni_accum.bench.arms`, measurements from :func:`~omni_accum.bench.replay.measure`.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, TextIO

import torch

from omni_accum.bench.replay import Arm, ArmResult, delta_roundtrip_us, measure
from omni_accum.bench.report import BenchRun, _fmt_bytes
from omni_accum.bench.streams import bucket_steps, stream_nbytes
from omni_accum.bench.workloads import MAX_ROWS, Workload, load_workload
from omni_accum.errors import OmniAccumError


class BenchError(OmniAccumError):
    """A bench run cannot go on: a bucket too large for this machine's memory, a bad context length."""


def context_lens_problem(context_lens: Iterable[int], option: str = "--context-lens") -> str | None:
    """Why a context length cannot be benchmarked (under 1 or over :data:`MAX_ROWS`), or None."""
    for n in context_lens:
        if n < 1 or n > MAX_ROWS:
            return f"{option} {n}: context lengths go from 1 to {MAX_ROWS} ({MAX_ROWS // 1000}k) prefill rows"
    return None


#: The most requests at once a bucket replays (a stream each, built before the first step: 100,000 took minutes
#: with no output; a serving stage holds tens).
MAX_CONCURRENCY = 1024


def concurrency_problem(concurrency: Iterable[int], option: str = "--concurrency") -> str | None:
    """Why a concurrency cannot be benchmarked (under 1 or over :data:`MAX_CONCURRENCY`), or None."""
    for n in concurrency:
        if n < 1 or n > MAX_CONCURRENCY:
            return f"{option} {n}: from 1 to {MAX_CONCURRENCY} requests at once"
    return None


def is_allocation_failure(e: BaseException) -> bool:
    """``e`` is torch's (or Python's) failure to allocate memory, not a bug."""
    if isinstance(e, MemoryError) or isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and (
        "can't allocate memory" in text
        or "out of memory" in text.lower()
        or "size calculation overflowed" in text
        or "bad_alloc" in text  # C++'s std::bad_alloc (an address-space limit: ulimit -v)
    )


def available_memory() -> int | None:
    """Bytes this process may still allocate: ``MemAvailable`` of ``/proc/meminfo``, or less under an address-space
    limit (``ulimit -v``: the limit less what the process maps already); None where neither is known."""
    found: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    left = address_space_left()
    if left is not None:
        found.append(left)
    return min(found) if found else None


def address_space_left() -> int | None:
    """What ``RLIMIT_AS`` (``ulimit -v``) leaves this process beyond what it maps now, or None without a limit."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/status", encoding="ascii") as f:
            mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (ImportError, OSError, ValueError, IndexError, StopIteration):
        return None
    return max(0, limit - mapped)


#: The options that set a bucket's size, as bench spells them (``tune`` passes its own ``--decode-steps``).
BENCH_SIZE_OPTIONS = {"context": "--context-lens", "steps": "--steps", "concurrency": "--concurrency"}


def bucket_memory_problem(
    wl: Workload, context_len: int, concurrency: int, options: dict[str, str] | None = None
) -> str | None:
    """Why a bucket cannot fit in this machine's memory (checked before anything is built), or None.

    The lower bound it checks, worked out from the workload's shapes, dtypes and steps without allocating
    (:func:`~omni_accum.bench.streams.stream_nbytes`): every request's stream is built before the replay (the
    prefill tensors once, shared; each request's own decode rows, ids and codes, keys read as deltas included),
    and every request in flight has the receiver's copy of each key it keeps (keys read as deltas are dropped once
    taken); against :func:`available_memory`. The message names the option to lower first: the steps when the
    decode chunks take most of it, else the context lengths (and the concurrency when above 1). Without this a
    bucket of 100000 requests ran into the kernel's out-of-memory killer, and a 1000k context into an allocation
    failure deep in building the streams."""
    avail = available_memory()
    if avail is None:
        return None
    sizes = stream_nbytes(wl, context_len)
    need = sizes.total(concurrency)
    if need <= avail:
        return None
    opt = {**BENCH_SIZE_OPTIONS, **(options or {})}
    decode = sizes.decode_total(concurrency)
    first = (
        f"fewer {opt['steps']} (decode steps: {wl.decode_steps})"
        if decode * 2 >= need
        else f"shorter {opt['context']}"
    )
    lower = f"give {first}" + (f" or a lower {opt['concurrency']}" if concurrency > 1 else "")
    return (
        f"context_len={context_len} concurrency={concurrency}: needs at least {_fmt_bytes(need)} of memory "
        f"({_fmt_bytes(sizes.shared)} {'of streams built before the replay' if sizes.pool else 'of prefill shared by the requests'}, then {_fmt_bytes(sizes.per_request())} per "  # noqa: E501
        f"request in flight; the decode steps take {_fmt_bytes(decode)} of it), and {_fmt_bytes(avail)} is "
        f"available; {lower}"
    )


def allocation_detail(e: BaseException) -> str:
    """``" (could not allocate 81.9 TB)"`` from torch's allocator message, else ``""``."""
    m = re.search(r"tried to allocate (\d+) bytes", str(e))
    return f" (could not allocate {_fmt_bytes(int(m.group(1)))})" if m else ""


def step_weight(context_len: int) -> int:
    """What one step of a bucket counts for in the progress bar: its rows, roughly what it costs.

    Steps of a 32k bucket take far longer than steps of a 1k bucket (upstream's step copies the whole
    context); counting every step alike made the ETA jump at each new bucket. The ``64`` stands for what
    any step costs whatever the context (the wire, the read).
    """
    return context_len + 64


class Progress:
    """A progress bar with ETA on a stream (stderr), drawn only once a run takes over a second.

    On a terminal it is a ``tqdm`` bar when tqdm is importable (average rate: the ETA does not jump),
    else a fixed ``[###---]`` line redrawn in place; elsewhere (a log file) a line every 5 s.
    :meth:`finish` ends a completed run at 100 % (steps of an arm that failed are never replayed);
    :meth:`close` ends the bar as it stands (a run cut short by an error).
    """

    def __init__(
        self, total: float, stream: TextIO | None = None, *, min_interval: float = 0.2, use_tqdm: bool | None = None
    ) -> None:
        self.total = max(1, total)
        self.done = 0.0
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.monotonic()
        self._last = 0.0
        self._drawn = False
        self._closed = False
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._min = min_interval if self._tty else 5.0
        self._tqdm = self._make_tqdm(min_interval) if (self._tty if use_tqdm is None else use_tqdm) else None

    def _make_tqdm(self, min_interval: float) -> Any:
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(
            total=self.total,
            file=self.stream,
            delay=1.0,
            mininterval=min_interval,
            smoothing=0.0,
            leave=True,
            bar_format="{l_bar}{bar}| {elapsed} elapsed, ETA {remaining}",
        )

    def advance(self, n: float = 1) -> None:
        n = min(n, self.total - self.done)
        self.done += n
        if self._tqdm is not None:
            self._tqdm.update(n)
            return
        now = time.monotonic()
        if now - self.t0 < 1.0 or now - self._last < self._min:
            return
        self._last = now
        self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(1.0, self.done / self.total)
        el = now - self.t0
        # Under 1 % done (warm-up, the first bucket's set-up) an extrapolation is noise ("ETA 4770 s"): none yet.
        eta = f"{el / frac - el:6.1f}s" if frac >= 0.01 else "     ?"
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        line = f"[{bar}] {100 * frac:5.1f}% {el:6.1f}s elapsed, ETA {eta}"
        self.stream.write(("\r" + line) if self._tty else (line + "\n"))
        self.stream.flush()
        self._drawn = True

    def finish(self) -> None:
        """The run completed: the bar ends at 100 % (and ETA 0), then closes."""
        if self._closed:
            return
        self.advance(self.total - self.done)
        if self._tqdm is None and self._drawn:
            self._draw(time.monotonic())
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tqdm is not None:
            self._tqdm.close()
        elif self._drawn and self._tty:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


def run_bench(
    workload: Workload | str,
    arms: dict[str, Arm],
    *,
    context_lens: Iterable[int] | None = None,
    concurrency: Iterable[int] | None = None,
    wire: str = "inproc",
    view_hop: str | None = None,
    repeats: int = 3,
    per_key: bool = False,
    through: str = "direct",
    progress: TextIO | None = None,
    on_bucket: Callable[[list[ArmResult]], None] | None = None,
) -> BenchRun:
    """Measure ``arms`` in every bucket (context length x concurrency) of the workload.

    Raises :class:`BenchError` for a context length over :data:`~omni_accum.bench.workloads.MAX_ROWS` or a bucket
    that cannot fit in memory (:func:`bucket_memory_problem`; both before measuring), and when a bucket's stream
    or state cannot be allocated.
    """
    wl = load_workload(workload)
    cls = list(context_lens or wl.default_context_lens())
    concs = list(concurrency or wl.concurrency)
    problem = context_lens_problem(cls) or concurrency_problem(concs) or next(
        (p for cl in cls for c in concs if (p := bucket_memory_problem(wl, cl, c))), None
    )
    if problem:
        raise BenchError(problem)
    total = sum(repeats * len(arms) * bucket_steps(wl, cl, c) * step_weight(cl) for cl in cls for c in concs)
    bar = Progress(total, progress) if progress is not None else None
    run = BenchRun(wl, wire, view_hop, repeats)
    try:
        for cl in cls:
            for c in concs:
                try:
                    res = measure(
                        wl,
                        arms,
                        context_len=cl,
                        concurrency=c,
                        wire=wire,
                        repeats=repeats,
                        view_hop=view_hop,
                        per_key=per_key,
                        through=through,
                        progress=(lambda n, w=step_weight(cl): bar.advance(n * w)) if bar else None,
                        warmup=True,
                    )
                except (MemoryError, RuntimeError) as e:
                    if not is_allocation_failure(e):
                        raise
                    raise BenchError(
                        f"context_len={cl} concurrency={c}: out of memory{allocation_detail(e)}; "
                        "give shorter --context-lens or a lower --concurrency"
                    ) from e
                run.results += res
                if on_bucket is not None:
                    on_bucket(res)
        if bar is not None:
            bar.finish()
    finally:
        if bar is not None:
            bar.close()
    if wire == "serializer" or view_hop == "serializer":
        run.delta_roundtrip_us = delta_roundtrip_us(wl, context_len=cls[0])
    return run
