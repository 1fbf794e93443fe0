"""The receiving side of ``OmniAccumMooncakeConnector`` (:mod:`.mooncake_connector`): ``get``.

A get asks the store for the chunk's key (0.30.0's way: 20 tries 50 ms apart in the call, or with
``mooncake_get_poll`` one ask per call, :mod:`.mooncake_wait`), decodes the payload with vllm-omni's own decoder
and, when the payload references parts (the fast path's tensors), allocates each tensor and reads its parts into it
with ``batch_get_into`` (through a registered staging buffer, or into the tensor's own memory registered for the call
when it is larger than the buffer), then removes the key and its parts from the store. With ``mooncake_read_threads``
that read runs on a thread of its own and the get returns None until it has finished (:mod:`.mooncake_reads`).

:class:`FastGets` holds these methods for :class:`.mooncake_connector.MooncakeFastConnector`, which provides what
they use: ``store``, ``inner``, ``waits``, ``get_poll``, ``reads``, ``counts``, ``seconds``, ``buffer_bytes``, the
receive lock and the registration and fallback helpers.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from omni_accum.integrations.vllm_omni.mooncake_reads import DONE, RUNNING
from omni_accum.integrations.vllm_omni.mooncake_settings import NAME
from omni_accum.integrations.vllm_omni.mooncake_wait import TRIES, TRY_INTERVAL_S, monotonic
from omni_accum.integrations.vllm_omni.mooncake_wire import PART_SEP, Buffer, Decoder, read_parts

logger = logging.getLogger("omni_accum.vllm_omni")

#: What a get returns inside the connector when it has started a read of the parts in the background.
READING = object()


class FastGets:
    """``get`` and its steps (a mixin of :class:`.mooncake_connector.MooncakeFastConnector`; see the module)."""

    #: The reads of parts on threads of their own (:class:`.mooncake_reads.BackgroundReads`); None: in the get.
    reads: Any = None

    # ------------------------------------------------------------------ get
    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        if self.store is None or self._closed:
            return None
        key = self._make_key(get_key, from_stage, to_stage)
        if self.reads is not None:
            state, got = self.reads.take(key)
            if state == RUNNING:
                return None  # its parts are being read: the adapter asks again on its next pass
            if state == DONE and got is not None:
                return got
            # no read of it, or the read failed (counted): ask the store
        if self.get_poll is not None:
            return self._poll(key)
        self.waits.due(key, monotonic())  # its first ask, for the time waited
        for attempt in range(TRIES):  # 0.30.0's connector: 20 tries, 50 ms apart
            got = self._try(key, attempt)
            if got is READING:
                return None
            if got is not None:
                return got
            if attempt < TRIES - 1:
                time.sleep(TRY_INTERVAL_S)
        self.inner._metrics["timeouts"] += 1
        logger.warning("%s: timeout waiting for %s", NAME, key)  # as 0.30.0's connector says it: the key waited for
        return None

    def _poll(self, key: str) -> tuple[Any, int] | None:
        """``mooncake_get_poll``: ask the store at most once per interval for ``key``; sleep only while no key asked
        for lately is due (:mod:`.mooncake_wait`)."""
        if not self.waits.turn(key, monotonic, time.sleep):
            return None
        got = self._try(key, 0)
        if got is READING:
            return None
        if got is None and self.waits.missed(key, monotonic()):
            self.inner._metrics["timeouts"] += 1
            logger.warning("%s: timeout waiting for %s", NAME, key)
        return got

    def _try(self, key: str, attempt: int) -> tuple[Any, int] | None:
        with self._rx_lock:
            t0 = monotonic()
            try:
                raw = self.store.get(key)
            except Exception as e:  # noqa: BLE001 - as 0.30.0: try again
                logger.debug("%s get attempt %s failed: %s", NAME, attempt, e)
                raw = None
            if not raw:
                return None
            return self._decode(key, raw, t0)

    def _decode(self, key: str, raw: bytes, t0: float) -> tuple[Any, int] | None:
        t1 = monotonic()
        dec = Decoder()
        dec.prefix = key + PART_SEP
        obj = dec.decode(raw)
        self.inner._metrics["gets"] += 1
        if not dec.todo:
            self.counts["inner_gets"] += 1
            self.waits.found(key, t1)
            return obj, len(raw)
        if self.reads is not None:
            self.counts["background_reads"] += 1
            self.reads.start(key, lambda buf: self._complete(key, raw, dec, obj, t0, t1, buf, self._rx_lock))
            return READING
        return self._complete(key, raw, dec, obj, t0, t1, self._buffer("rx"), contextlib.nullcontext())

    def _complete(self, key: str, raw: bytes, dec: Decoder, obj: Any, t0: float, t1: float, buf: Buffer | None,
                  counting: Any) -> tuple[Any, int] | None:
        """Read the parts ``dec`` found into its tensors through ``buf``, remove them and the key; None when the read
        fails (counted; the key stays for another get). ``counting``: held while the counts change (a reader
        thread takes the receive lock then; a get already holds it)."""
        try:
            if buf is None:
                raise RuntimeError("no registered buffer to read into")
            n = read_parts(self.store, buf, dec.todo, self._register, self._unregister)
        except Exception as e:  # noqa: BLE001 - counted; the key stays for another try
            with counting:
                self.inner._metrics["gets"] -= 1
                self._fell_back("mooncake_get_error", e)
            return None
        t2 = monotonic()
        # taken: the key and its parts go now (force: the lease this get holds would refuse it; they are
        # this payload's alone, under keys of their own, and this get was their one reader)
        keys = list(dict.fromkeys([pk for _, parts in dec.todo for pk, _ in parts] + [key]))
        try:
            rcs = self.store.batch_remove(keys, True)
            bad = [k for k, rc in zip(keys, rcs) if rc != 0]
        except Exception as e:  # noqa: BLE001 - left to the store's eviction
            bad = [f"{key} ({e})"]
        t3 = monotonic()
        with counting:
            if bad:
                self.counts["remove_errors"] += len(bad)
                logger.warning("omni-accum %s: could not remove %s", NAME, ", ".join(bad[:3]))
            waited = self.waits.found(key, t0)
            sec = self.seconds
            sec["get_waited"] += waited
            sec["get_key"] += t1 - t0
            sec["get_parts"] += t2 - t1
            sec["get_remove"] += t3 - t2
            self.counts["fast_gets"] += 1
        logger.info("omni-accum %s: got %s: waited %.1f ms, payload %d bytes %.1f ms, %d tensor bytes in %d part(s) "
                    "%.1f ms%s, removed in %.1f ms", NAME, key, waited * 1e3, len(raw), (t1 - t0) * 1e3, n,
                    len(keys) - 1, (t2 - t1) * 1e3, "" if self.reads is None else " (a reader thread)",
                    (t3 - t2) * 1e3)  # fmt: skip
        return obj, len(raw) + n
