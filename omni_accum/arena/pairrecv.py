"""The receiving process of ``omni-accum bench --wire arena`` (:mod:`omni_accum.arena.pairbench`).

One spawned process per run, told one bucket after another: each bucket's streams (the references its views
are checked against), its arena and the arms' vllm-omni connectors. It answers every step with the time it took
and a mismatch (or None), and an error with ``("error", message)``, after which it goes on.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time
from typing import Any

import torch

from omni_accum.bench.reference import check_taken, check_view
from omni_accum.bench.streams import append_length_hints, build_stream
from omni_accum.bench.workloads import Workload
from omni_accum.context import StreamContext

clock = time.perf_counter_ns


def policy_of(wl: Workload) -> Any:
    """The workload's policy (``default`` when it names none)."""
    from omni_accum.policy import load_policy

    return load_policy(wl.policy or "default")


def connector(arm: str, stage_id: int, name: str, data_bytes: int) -> Any:
    """The vllm-omni connector of ``arm`` (``shm`` or ``connector``) for one side of the pair."""
    if arm == "shm":
        from omni_accum.integrations.vllm_omni.classes import shm_connector

        return shm_connector()({"stage_id": stage_id})
    from omni_accum.integrations.vllm_omni.classes import VllmOmniUnavailable

    try:
        from omni_accum.integrations.vllm_omni.arena_connector import ArenaConnector
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken vLLM build beside CPU torch
        raise VllmOmniUnavailable(
            f"the connector arm (OmniAccumArenaConnector) needs vllm-omni (a supported release), which cannot be "
            f"imported here ({type(e).__name__}: {e}). Install it with: pip install 'omni-accum[vllm]'"
        ) from e
    extra = {"stage_id": stage_id, "arena_name": f"{name}c", "ring_bytes": "4MiB"}
    return ArenaConnector({**extra, "arena_bytes": data_bytes} if data_bytes else extra)


class Pipe:
    """One end of the control pipe; ``spin``: poll it instead of sleeping in ``recv`` (``--arena-wait``)."""

    def __init__(self, conn: Any, spin: bool) -> None:
        self.conn, self.spin = conn, spin
        self.send, self.poll = conn.send, conn.poll

    def recv(self) -> Any:
        if self.spin:
            poll = self.conn.poll
            while not poll(0):
                pass
        return self.conn.recv()


class _Bucket:
    """The receiving side of one bucket: its streams (the references), its arena, the arms' connectors."""

    def __init__(self, wl: Workload, cl: int, concurrency: int, name: str, data_bytes: int) -> None:
        from omni_accum.arena.receiver import ArenaReceiver

        self.wl, self.name, self.data_bytes = wl, name, data_bytes
        self.streams = [build_stream(wl, cl, r) for r in range(concurrency)]
        self.reads = [(k.path, k.read) for k in wl.keys if k.read != "never"]
        self.ctx = StreamContext(
            context_len=cl, concurrency=concurrency, length_hints=append_length_hints(wl, self.streams[0])
        )
        self.conns: dict[str, Any] = {}  # arm -> the vllm-omni connector it gets from
        self.policy_rx: Any = None
        self.rx = ArenaReceiver(name, data_bytes)

    def begin(self, arm: str) -> None:
        if arm == "arena":
            return
        from omni_accum.engine import Receiver

        if arm not in self.conns:
            self.conns[arm] = connector(arm, 1, self.name, self.data_bytes)
            self.conns[arm].get("0", "1", "create")  # the arena connector's receiver makes its region
        self.policy_rx = Receiver(policy_of(self.wl), context=self.ctx)

    def step(self, arm: str, rid: str, r: int, last: bool, key: str) -> tuple[float, str | None]:
        t0 = clock()
        if arm == "arena":
            ev = self.rx.poll(30.0)
            if ev is None:
                raise RuntimeError("arena: no chunk within 30 s")
            view = ev.view
        else:
            got = self.conns[arm].get("0", "1", key)
            if got is None:
                raise RuntimeError(f"{type(self.conns[arm]).__name__}.get found nothing at {key}")
            view = self.policy_rx.merge(rid, got[0])
        chunk = self.streams[r][int(key.rsplit("_", 1)[1])]
        taken = []
        for path, how in self.reads:
            if how == "end" and not last:
                continue
            top, _, qual = path.partition(".")
            if how == "delta" and (top not in chunk or (qual and qual not in chunk[top])):
                continue  # taken with the chunk that carried it
            val = view[top][qual] if qual else view[top]
            if how == "newest_row" and len(val):
                val = val[-1:]
            elif how == "delta":  # the rows this chunk added (each arm keeps them; none drops them)
                val = val[-len(chunk[top][qual] if qual else chunk[top]) :]
                taken.append((path, val))
        dt = (clock() - t0) / 1000.0
        mismatch = check_taken(chunk, taken) if taken else None
        if last:
            mismatch = mismatch or check_view(self.wl, self.streams[r], view)
            if arm == "arena":
                self.rx.release(rid)
            else:
                self.policy_rx.release(rid)
        return dt, mismatch

    def close(self) -> None:
        try:
            self.rx.close()
        finally:
            for c in self.conns.values():
                c.close()


def receiver_main(conn: Any, spin: bool = False) -> None:
    """The receiving process of a whole run: one bucket after another (``("bucket", ...)``), so that torch and
    vllm-omni are imported once, not once per bucket. An error in a step or an arm's set-up is answered
    ``("error", message)`` and the process goes on; the sender gives that arm of that bucket up. The process ends
    quietly when the sender goes away (its end of the pipe closed) or on an interrupt (the sender handles Ctrl-C;
    :class:`ReceiverProcess` starts this process with SIGINT ignored)."""
    torch.set_num_threads(1)
    conn = Pipe(conn, spin)
    bucket: _Bucket | None = None
    try:
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd[0] == "quit":
                break
            try:
                if cmd[0] == "bucket":
                    if bucket is not None:  # the last bucket's arena, connectors and streams let go first
                        try:
                            bucket.close()
                        finally:
                            bucket = None
                    bucket = _Bucket(*cmd[1:])
                    conn.send("ok")
                elif bucket is None:
                    raise RuntimeError(f"{cmd[0]!r} before any bucket")
                elif cmd[0] == "begin":
                    bucket.begin(cmd[1])
                    conn.send("ok")
                else:
                    conn.send(bucket.step(*cmd[1:]))
            except Exception as e:  # noqa: BLE001 - reported to the parent, which gives the arm up
                conn.send(("error", f"{type(e).__name__}: {e}"))
    except (EOFError, OSError, KeyboardInterrupt):  # the sender went away or was interrupted: nothing to answer
        pass
    finally:
        if bucket is not None:
            bucket.close()


class ReceiverProcess:
    """The spawned receiving process of a run: started at its first bucket (a spawn imports torch, and for the
    connector arms vllm-omni: 15-25 s on a small machine), then told each bucket in turn, and started again
    only for a bucket after one in which it died."""

    def __init__(self, spin: bool) -> None:
        self.spin = spin
        self.proc: Any = None
        self.conn: Pipe | None = None
        self.started = 0  # how many processes this run started

    def bucket(self, wl: Workload, cl: int, concurrency: int, name: str, data_bytes: int) -> None:
        if self.proc is None or not self.proc.is_alive():
            self.close()
            self._start()
        self.ask("bucket", wl, cl, concurrency, name, data_bytes)

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_main, args=(child, self.spin), daemon=True)
        # Ctrl-C reaches the whole process group: the child ignores it (from its first instruction on, a spawned
        # Python keeps an ignored SIGINT) and this process, which handles it, ends the child by closing it
        ignore = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignore else None
        try:
            self.proc.start()
        finally:
            if ignore:
                signal.signal(signal.SIGINT, old)
        self.started += 1
        child.close()  # the child's end lives in the child only: its exit is an EOF here, not a hang
        self.conn = Pipe(parent, self.spin)
        try:
            ready = parent.poll(600) and parent.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            proc = self.proc
            self.close()
            raise ArmFailed(f"the receiver process did not start (exit status {proc.exitcode})")

    def ask(self, *cmd: Any) -> Any:
        """Send ``cmd``, return the answer; an ``("error", message)`` answer raises ``ArmFailed``."""
        assert self.conn is not None
        try:
            self.conn.send(cmd)
            reply = self.conn.recv()
        except (EOFError, OSError) as e:
            self.proc.join(5)
            raise ArmFailed(f"the receiver process ended (exit status {self.proc.exitcode})") from e
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            raise ArmFailed(f"receiver: {reply[1]}")
        return reply

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.is_alive():
            try:
                self.conn.send(("quit",))
            except OSError:
                pass
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.conn.close()
        self.proc = self.conn = None


class ArmFailed(Exception):
    """One arm of one bucket cannot go on (the other arms and buckets do): its row says why."""
