"""vLLM's ``MessageQueue`` in one process: what a worker process gets from the scheduler's output, for the tests of
omni-accum's 0.16 runner rows (``tests/test_runner_rows.py``, ``tests/test_integration_vllm_omni_v016.py``) and
``talker_step_016.py``. It unpickles only the bytes it has just pickled itself, in the same call; it is not part of
the omni-accum package, which unpickles nothing."""

from __future__ import annotations

import pickle
from typing import Any


def through_message_queue(obj: Any, *, reuse: bool = True) -> tuple[Any, int]:
    """``obj`` as a worker gets it from vLLM's ``MessageQueue`` (``enqueue``: ``pickle.dumps`` with protocol 5,
    buffers of 1 MiB or more out of band, their bytes copied into the queue; ``dequeue``: ``pickle.loads``), and
    the bytes that crossed. ``reuse``: the queue's bytes are overwritten after the load, as the ring's next
    message does (what was not copied out shows it)."""
    oob: list[Any] = []

    def callback(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if len(raw) < 1024 * 1024:
            return True
        oob.append(raw)
        return False

    main = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=callback)
    queue = [bytearray(main), *(bytearray(b) for b in oob)]
    out = pickle.loads(queue[0], buffers=queue[1:])
    if reuse:
        for q in queue:
            q[:] = b"\xff" * len(q)
    return out, sum(len(q) for q in queue)
