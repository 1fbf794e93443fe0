"""Test processes forked from a server that imported vLLM and vllm-omni once (multiprocessing's forkserver).

A fresh interpreter importing vllm-omni takes ~25 s of one core on a 2-core machine, and the arena's process tests
start a dozen connector peers. A peer forked from the server starts at once; everything else is as in a process of
its own: the test's environment at the moment it starts (``os.environ`` and the extra variables given), omni-accum
imported there after that environment is set (the server imports only torch and vllm-omni), and the process's exit
functions run when its target returns (as at a normal exit; a peer killed with SIGKILL runs none, as before).
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import signal
import subprocess
import time
from typing import Any

#: What the server imports once (nothing of omni-accum: each peer imports it under its own environment).
PRELOAD = ["torch", "vllm_omni.distributed.omni_connectors.connectors.shm_connector"]
_ctx: Any = None


def context() -> Any:
    global _ctx
    if _ctx is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # taken when the server starts (the first peer of this test process)
        _ctx = ctx
    return _ctx


def _call(target: str, args: tuple[Any, ...], env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    module, _, name = target.rpartition(".")
    try:
        getattr(importlib.import_module(module), name)(*args)
    finally:
        atexit._run_exitfuncs()  # what a process that ends normally runs (multiprocessing's child ends with _exit)


def process(target: Any, *args: Any) -> Any:
    """A ``multiprocessing.Process`` (not started) of :func:`context` running ``target(*args)`` (a module-level
    function) under the test's environment of now; its events and queues come from :func:`context` too."""
    name = f"{target.__module__}.{target.__qualname__}"
    return context().Process(target=_call, args=(name, args, dict(os.environ)))


class Forked:
    """``target(conn, *args)`` (a function named ``module.name``) in a forked process; ``conn``: its end of a pipe
    (this side: :attr:`conn`). Answers ``wait`` / ``poll`` / ``kill`` as a ``subprocess.Popen`` does."""

    def __init__(self, target: str, *args: Any, env: dict[str, str] | None = None) -> None:
        ctx = context()
        self.conn, child = ctx.Pipe()
        self._p = ctx.Process(target=_call, args=(target, (child, *args), {**os.environ, **(env or {})}))
        self._p.start()
        child.close()
        self.pid = self._p.pid

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout or 0)
        return self._p.exitcode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def answer(self, timeout: float) -> Any:
        """What it sent on :attr:`conn` within ``timeout`` seconds; None when it sent nothing (it ended first: its
        error is in the test's output, or it is still running: :meth:`end` then kills it)."""
        try:
            return self.conn.recv() if self.conn.poll(timeout) else None
        except EOFError:
            return None

    def end(self, timeout: float) -> int:
        """Its exit status within ``timeout`` seconds; past that it is killed and reaped, then ``TimeoutExpired``
        (a process left running would hang the test process at exit: multiprocessing joins its children there)."""
        try:
            return self.wait(max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            self.kill()
            self._p.join(30)
            raise
        finally:
            self.conn.close()

    def finish(self, timeout: float) -> tuple[Any, int]:
        """:meth:`answer` and :meth:`end` within one deadline of ``timeout`` seconds: (its answer or None, its exit
        status)."""
        deadline = time.monotonic() + timeout
        said = self.answer(timeout)
        return said, self.end(deadline - time.monotonic())
