"""``OmniAccumMooncakeConnector``: vllm-omni 0.30.0's ``MooncakeStoreConnector`` with a tensor fast path.

Select it in a deploy YAML in place of ``MooncakeStoreConnector`` (the same ``extra``, plus optional keys of its own,
:mod:`.mooncake_settings`)::

    connectors:
      connector_of_mooncake:
        name: OmniAccumMooncakeConnector
        extra:
          host: 10.0.0.2
          master: 10.0.0.1:50151
          metadata_server: http://10.0.0.1:8080/metadata
          segment: 536870912
          localbuf: 268435456
          mooncake_buffer_bytes: 16MiB       # registered staging buffer per direction, and the largest part (default)
          mooncake_tensor_min_bytes: 256KiB  # smaller tensors stay in the serialized payload (default 256KiB)
          mooncake_get_poll: 10ms            # how a get waits for a key not there yet (default blocking: 0.30.0's)
          mooncake_parts_segment: any        # where the parts go: local (default: this process's segment) or any
          mooncake_read_threads: 4           # threads that read the parts outside the get (default 0: in the get)

0.30.0's connector serializes the whole payload (msgpack, every tensor's bytes copied into the message),
``put`` s it as one object, and the receiver ``get`` s the bytes and decodes them (another copy). For the
tensors of keys the sending policy appends (the prefill's ``[P+1, 2048]`` embeddings and hidden states:
66 MB at 8k) this connector moves the bytes with the store's buffer-based calls instead:

* sending, each such tensor of at least ``mooncake_tensor_min_bytes`` is copied once into a registered
  staging buffer (``MooncakeDistributedStore.register_buffer``) and stored from it as objects of their own
  (``batch_put_from``); a tensor larger than the buffer has its own memory registered for the call instead
  (no copy; through the staging buffer, one buffer-full per call, if that fails) and goes as parts of at
  most the buffer's size (objects stay small enough for any segment; in this process's own segment when it
  contributes one, ``segment`` > 0, and ``mooncake_parts_segment`` is ``local``, the default: the put is a
  local copy; ``any``: the master chooses, as for 0.30.0's puts); the rest of the payload is serialized as 0.30.0
  does, each such tensor replaced by a reference naming its parts (:mod:`.mooncake_wire`), and ``put`` last
  under the chunk's key: a receiver that finds the key finds every part;
* receiving, the payload is decoded with vllm-omni's own decoder, each referenced tensor allocated and its
  parts read with ``batch_get_into`` into the registered receive buffer and copied into it (one copy; a tensor
  larger than the buffer is registered itself and read into directly; a part that cannot be read through
  registered memory is read with the store's plain ``get``), then the key and its parts are
  removed from the store (0.30.0 leaves every object soft-pinned; its own puts stay so here too).

The values that come out are those 0.30.0's connector gives: the same dtypes, shapes and bytes.

A get waits for a key as 0.30.0's does (20 tries 50 ms apart, in the call) unless ``mooncake_get_poll`` names an
interval (:mod:`.mooncake_wait`), and reads the parts it finds inside the call unless ``mooncake_read_threads`` names
threads for that (:mod:`.mooncake_reads`: the get then returns None until the read has finished). The receiving side
is :mod:`.mooncake_get`'s. Each fast put and get logs its phases (INFO), summed in ``health()["fast_seconds"]``.

Which tensors: within omni-accum's send hook, those of the keys the sending policy appends (as the arena
connector's append chains); outside it (a benchmark, a test), the keys ``append_test(path, value)`` says.
A payload with no such tensor is 0.30.0's put, unchanged (the peer hellos, the decode chunks).

Fallbacks, as the arena connector's (counted in ``health()["fallbacks"]`` and
``omni_accum_fallbacks_total{reason=...}``): a buffer that cannot be registered (``mooncake_register_error``, per
direction, tried again after :data:`REGISTER_RETRY_S`: meanwhile a send buffer's failure sends this process's puts
serialized, a receive buffer's reads the parts with the store's plain ``get``, delivered all the same), a part the
store refuses (``mooncake_put_error``: the parts put are removed and the whole payload goes serialized), a payload
that does not encode (``encode_error``: serialized, which says why), a chunk whose parts cannot be read
(``mooncake_get_error``, once per chunk: parts gone from the store lose the chunk, which is removed and its request
failed; others are tried again by the next get, :mod:`.mooncake_get`). A request the sending side has
released (``release_request``, omni-accum's sender-release hook) sends its later puts serialized; a put in
progress when it is released completes whole (the key goes last).

Registered with ``OmniConnectorFactory`` by the ``omni_accum_mooncake`` entry point
(:mod:`.mooncake_compat`).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from vllm_omni.distributed.omni_connectors.connectors.base import OmniConnectorBase

from omni_accum.integrations.vllm_omni.arena_chains import append_test, cpu_contiguous, plain_tensor, request_of
from omni_accum.integrations.vllm_omni.arena_chains import struct_map
from omni_accum.integrations.vllm_omni.mooncake_get import FastGets
from omni_accum.integrations.vllm_omni.mooncake_reads import BackgroundReads
from omni_accum.integrations.vllm_omni.mooncake_settings import KNOWN_KEYS, NAME, STORE_KEYS, notes, parse_settings
from omni_accum.integrations.vllm_omni.mooncake_settings import store_problem
from omni_accum.integrations.vllm_omni.mooncake_wait import KeyWaits, monotonic
from omni_accum.integrations.vllm_omni.mooncake_wire import PART_SEP, Buffer, Encoder, bytes_of
from omni_accum.integrations.vllm_omni.prometheus import fallback as _count_fallback

logger = logging.getLogger("omni_accum.vllm_omni")

#: The released requests remembered (their later puts go serialized).
MAX_RELEASED = 4096
#: After a buffer of one direction could not be registered, registration is tried again this many seconds later.
REGISTER_RETRY_S = 60.0
#: What a fallback means, per reason (the warning's end).
_FALLBACK_SAYS = {
    "mooncake_register_error tx": "this process's puts go serialized (0.30.0's way) until a registration succeeds "
                                  f"(tried again in {REGISTER_RETRY_S:.0f} s)",
    "mooncake_register_error rx": "this process reads the fast path's parts with the store's plain get (one more "
                                  "copy, the same bytes) until a registration succeeds (tried again in "
                                  f"{REGISTER_RETRY_S:.0f} s)",
    "mooncake_put_error": "that put goes serialized (0.30.0's way)",
    "encode_error": "that put goes serialized (0.30.0's way), which says why",
}


#: Set by :func:`.mooncake_compat.register_connector` (the plugin's activation, which registers this connector):
#: the compatibility step for vllm-omni 0.30.0 on Mooncake 0.3.13, and vllm-omni's ``MooncakeStoreConnector``
#: class (None: not importable). This module does not import that one: it imports this one.
_prepare: Any = None
_inner_class: Any = None


class MooncakeFastConnector(FastGets, OmniConnectorBase):
    """See the module docstring. ``config`` is the connector's ``extra`` (vllm-omni adds ``stage_id``)."""

    def __init__(self, config: dict[str, Any] | None) -> None:
        self.config = dict(config or {})
        settings = parse_settings(self.config)  # refuses a bad value of its own keys, naming it
        problem = store_problem(self.config)  # and of 0.30.0's keys, as doctor --deploy does: before Mooncake's setup
        if problem:
            raise ValueError(problem)
        for note in notes(self.config, settings):
            logger.warning("omni-accum %s", note)
        self.buffer_bytes = settings.buffer_bytes
        self.tensor_min_bytes = settings.tensor_min_bytes
        self.get_poll = settings.get_poll
        self.parts_segment = settings.parts_segment
        self.read_threads = settings.read_threads
        if _prepare is None or _inner_class is None:
            raise ImportError(f"{NAME}: not set up: omni-accum's omni_accum_mooncake plugin registers it "
                              "(omni_accum.integrations.vllm_omni.mooncake_compat.activate())")
        _prepare()  # 0.30.0's connector does not build on Mooncake 0.3.13 without the compatibility step
        cls = _inner_class()
        if cls is None:
            raise ImportError(f"{NAME}: vllm-omni's MooncakeStoreConnector cannot be imported")
        inner_cfg = {k: v for k, v in self.config.items() if k not in KNOWN_KEYS}
        where = _addresses(inner_cfg)
        logger.info("omni-accum %s: setting up Mooncake (%s)", NAME, where)
        try:
            self.inner = cls(inner_cfg)
        except Exception as e:  # 0.30.0's message names no address ("Mooncake setup failed: -1")
            raise RuntimeError(f"{NAME}: Mooncake setup failed with {where}: {e}. Check that the master answers at "
                               "that address from this host, that metadata_server starts with http:// for the "
                               "master's HTTP metadata server, and that host is this host's address as the others "
                               "reach it (docs/mooncake.md, 'Across hosts, step by step')") from e
        self._tx_lock = threading.Lock()
        self._rx_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._tx_buf: Buffer | None = None
        self._rx_buf: Buffer | None = None
        #: per direction: no registration tried before this time (monotonic; a failed one sets it)
        self._no_buffer_until = {"tx": 0.0, "rx": 0.0}
        self._released: OrderedDict[str, None] = OrderedDict()
        #: ``(key path, value) -> bool``: the keys whose tensors take the fast path in a put that omni-accum's
        #: send hook is not making (a benchmark, a test); within the hook, the sending policy decides.
        self.append_test: Any = None
        #: Called between two buffer-fulls of one put (tests: a release mid-transfer).
        self.between_parts: Any = None
        self.counts = {"fast_puts": 0, "inner_puts": 0, "fast_gets": 0, "inner_gets": 0, "fast_tensor_bytes": 0,
                       "fast_parts": 0, "remove_errors": 0, "direct_tensors": 0, "background_reads": 0,
                       "plain_parts": 0, "lost_chunks": 0}  # fmt: skip
        self._init_gets()
        #: The reads of parts outside the get (``mooncake_read_threads``; None: in the get).
        self.reads = BackgroundReads(self.read_threads, lambda: self._new_buffer("rx"),
                                     self._let_go) if self.read_threads else None  # fmt: skip
        #: Seconds spent in the fast path's phases, summed (``health()["fast_seconds"]``).
        self.seconds = {"put_parts": 0.0, "put_key": 0.0, "get_waited": 0.0, "get_key": 0.0, "get_parts": 0.0,
                        "get_remove": 0.0}
        self.waits = KeyWaits(self.get_poll)
        self.fallbacks: dict[str, int] = {}
        self._warned: set[str] = set()
        self._closed = False
        self._pin: Any = None
        #: This process's own segment, where the fast path's objects go (None: the master chooses).
        self.local_segment: str | None = None

    @property
    def stage_id(self) -> int:
        return self.config.get("stage_id", -1)

    @property
    def store(self) -> Any:
        return self.inner.store

    @property
    def pin(self) -> Any:
        return self.inner.pin

    def _part_pin(self) -> Any:
        """The replication config of the fast path's objects: 0.30.0's (soft pin), preferring this process's own
        segment when it contributes one (``segment`` > 0) and ``mooncake_parts_segment`` is ``local``: the put is
        then a local copy, and the receiver's get the one transfer."""
        if self._pin is None:
            pin = self.inner.pin
            try:
                if self.parts_segment == "local" and int(self.inner.segment or 0) > 0:
                    from mooncake.store import ReplicateConfig  # noqa: PLC0415

                    pin = ReplicateConfig()
                    pin.with_soft_pin = True
                    pin.preferred_segment = self.store.get_hostname()
                    self.local_segment = pin.preferred_segment
            except Exception as e:  # noqa: BLE001 - 0.30.0's config then
                logger.info("omni-accum %s: no preferred segment (%s)", NAME, e)
                pin = self.inner.pin
            self._pin = pin
        return self._pin

    # ------------------------------------------------------------------ fallbacks
    def _count_fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        _count_fallback(reason)

    def _fell_back(self, reason: str, e: BaseException | str, which: str = "") -> None:
        """Count ``reason`` and say what it means (rate-limited: :class:`.mooncake_get.RateLog`)."""
        with self._count_lock:
            self._count_fallback(reason)
        says = _FALLBACK_SAYS.get(f"{reason} {which}".strip(), "")
        self.rate_log.warning(f"{reason} {which}", "omni-accum %s: %s%s (%s); %s", NAME, reason,
                              f" ({'send' if which == 'tx' else 'receive'} buffer)" if which else "", str(e), says)

    def _buffer(self, which: str) -> Buffer | None:
        """This process's registered staging buffer of direction ``which`` (``tx``, ``rx``); None while it cannot be
        registered (tried again :data:`REGISTER_RETRY_S` after a failure)."""
        attr = "_tx_buf" if which == "tx" else "_rx_buf"
        buf = getattr(self, attr)
        if buf is None and self.store is not None:
            buf = self._new_buffer(which)
            setattr(self, attr, buf)
        return buf

    def _new_buffer(self, which: str) -> Buffer | None:
        """A registered staging buffer for direction ``which``: this process's (:meth:`_buffer`), or a reader
        thread's (``rx``). None when registration failed (counted as ``mooncake_register_error``), or failed less than
        :data:`REGISTER_RETRY_S` ago for that direction (not tried)."""
        if monotonic() < self._no_buffer_until[which]:
            return None
        try:
            return Buffer(self.store, self.buffer_bytes)
        except Exception as e:  # noqa: BLE001
            self._no_buffer_until[which] = monotonic() + REGISTER_RETRY_S
            self._fell_back("mooncake_register_error", e, which)
            return None

    # ------------------------------------------------------------------ put
    def _chosen(self, put_key: str, data: Any) -> dict[int, torch.Tensor]:
        req = request_of(put_key)
        if req is not None and req in self._released:
            return {}
        test = append_test() or self.append_test
        if test is None:
            return {}
        as_map = data if isinstance(data, Mapping) else struct_map(data)
        if as_map is None:
            return {}
        out: dict[int, torch.Tensor] = {}

        def pick(path: str, v: Any) -> None:
            if plain_tensor(v) and v.numel() * v.element_size() >= self.tensor_min_bytes and test(path, v):
                out[id(v)] = v

        for top, value in as_map.items():
            if isinstance(value, Mapping):
                for qual, qv in value.items():
                    pick(f"{top}.{qual}", qv)
            else:
                pick(str(top), value)
        return out

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        with self._tx_lock:
            chosen = {} if self._closed else self._chosen(put_key, data)
            buf = self._buffer("tx") if chosen else None
            if buf is not None:
                try:
                    return self._put(buf, from_stage, to_stage, put_key, data, chosen)
                except _PutFailed as e:
                    self._fell_back("mooncake_put_error", e)
                except Exception as e:  # noqa: BLE001 - a payload that does not encode: 0.30.0's put says why
                    self._fell_back("encode_error", e)
        result = self.inner.put(from_stage, to_stage, put_key, data)
        if result[0]:
            self.counts["inner_puts"] += 1
        return result

    def _put(self, buf: Buffer, from_stage: str, to_stage: str, put_key: str, data: Any,
             chosen: dict[int, torch.Tensor]) -> tuple[bool, int, dict[str, Any]]:  # fmt: skip
        key = self._make_key(put_key, from_stage, to_stage)
        nonce = secrets.token_hex(4)
        parts: dict[int, tuple[torch.Tensor, list[list[Any]]]] = {}
        plan: list[str] = []  # the part keys, in order
        for i, (tid, tensor) in enumerate(chosen.items()):
            t = cpu_contiguous(tensor)
            listed: list[list[Any]] = []
            parts[tid] = (t, listed)
            flat = bytes_of(t)
            n = flat.numel()
            for j, off in enumerate(range(0, n, buf.nbytes)):
                ln = min(buf.nbytes, n - off)
                pk = f"{key}{PART_SEP}{nonce}.{i}.{j}"
                listed.append([pk, ln])
                plan.append(pk)
        done: list[str] = []
        calls = 0
        pin = self._part_pin()
        t0 = monotonic()

        def call(keys: list[str], ptrs: list[int], sizes: list[int]) -> None:
            nonlocal calls
            if calls and self.between_parts is not None:
                self.between_parts(put_key)
            calls += 1
            rcs = self.store.batch_put_from(keys, ptrs, sizes, pin)
            ok = [pk for pk, rc in zip(keys, rcs) if rc == 0]
            done.extend(ok)
            if len(ok) != len(keys):
                raise _PutFailed(f"batch_put_from of {len(keys)} part(s) returned {list(rcs)}")

        try:
            staged: list[tuple[str, torch.Tensor, int, int]] = []  # parts waiting in the staging buffer
            used = 0

            def flush() -> None:
                nonlocal used
                if staged:
                    call([p[0] for p in staged], [buf.ptr + u for *_, u in staged], [p[3] for p in staged])
                    staged.clear()
                    used = 0

            for t, listed in parts.values():
                flat = bytes_of(t)
                if flat.numel() > buf.nbytes and self._register(flat):
                    # larger than the staging buffer: its own memory registered for this call, no copy
                    flush()
                    try:
                        call([pk for pk, _ in listed], [flat.data_ptr() + j * buf.nbytes for j in range(len(listed))],
                             [ln for _, ln in listed])  # fmt: skip
                    finally:
                        self._unregister(flat)
                    continue
                off = 0
                for pk, ln in listed:
                    if used + ln > buf.nbytes:
                        flush()
                    buf.mem[used : used + ln].copy_(flat[off : off + ln])
                    staged.append((pk, flat, off, ln, used))  # type: ignore[arg-type]
                    used += ln
                    off += ln
            flush()
            t1 = monotonic()
            body = Encoder(parts).encode(data)
            rc = self.store.put(key, body, self._part_pin())
            if not (rc is None or rc == 0 or rc is True):
                raise _PutFailed(f"put of the payload's {len(body)} bytes returned {rc!r}")
        except BaseException:
            if done:
                try:
                    self.store.batch_remove(done, True)
                except Exception as e:  # noqa: BLE001 - left to the store's eviction
                    logger.warning("omni-accum %s: could not remove %d part(s): %s", NAME, len(done), e)
            raise
        t2 = monotonic()
        self.seconds["put_parts"] += t1 - t0
        self.seconds["put_key"] += t2 - t1
        tensor_bytes = sum(t.numel() * t.element_size() for t, _ in parts.values())
        n = len(body) + tensor_bytes
        logger.info("omni-accum %s: put %s: %d tensor bytes in %d part(s) %.1f ms, payload %d bytes %.1f ms",
                    NAME, key, tensor_bytes, len(plan), (t1 - t0) * 1e3, len(body), (t2 - t1) * 1e3)
        self.counts["fast_puts"] += 1
        self.counts["fast_tensor_bytes"] += tensor_bytes
        self.counts["fast_parts"] += len(plan)
        m = self.inner._metrics
        m["puts"] += 1
        m["bytes_transferred"] += n
        if self.counts["fast_puts"] == 1:
            logger.info("omni-accum %s: first put through registered buffers (%d tensor(s), %d part(s), %d bytes)",
                        NAME, len(parts), len(plan), n)
        return True, n, {"mooncake_parts": plan, "size": n}

    def release_request(self, external_req_id: str) -> None:
        """The sending side is done with ``external_req_id``: its later puts go serialized (a put in progress
        completes whole). Never waits."""
        self._released[external_req_id] = None
        while len(self._released) > MAX_RELEASED:
            self._released.popitem(last=False)

    def _register(self, flat: torch.Tensor) -> bool:
        """Register a tensor's own memory for one call (False: it goes through the staging buffer)."""
        try:
            rc = self.store.register_buffer(flat.data_ptr(), flat.numel())
        except Exception as e:  # noqa: BLE001
            rc = str(e)
        if rc != 0:
            if "register-direct" not in self._warned:
                self._warned.add("register-direct")
                logger.info("omni-accum %s: register_buffer of a tensor returned %s; it goes through the staging "
                            "buffer (a get without one: the store's plain get)", NAME, rc)
            return False
        with self._count_lock:  # reader threads register too
            self.counts["direct_tensors"] += 1
        return True

    def _unregister(self, flat: torch.Tensor) -> None:
        try:
            self.store.unregister_buffer(flat.data_ptr())
        except Exception as e:  # noqa: BLE001
            logger.warning("omni-accum %s: unregister_buffer: %s", NAME, e)

    # ------------------------------------------------------------------ the rest of the interface
    def cleanup(self, request_id: str) -> None:
        self.inner.cleanup(request_id)

    def health(self) -> dict[str, Any]:
        return {**self.inner.health(), **self.counts, "fallbacks": dict(self.fallbacks),
                "local_segment": self.local_segment, "parts_segment": self.parts_segment,
                "fast_seconds": dict(self.seconds),
                "get_poll": "blocking" if self.get_poll is None else self.get_poll, "read_threads": self.read_threads,
                "buffers_registered": {"tx": self._tx_buf is not None, "rx": self._rx_buf is not None},
                "reads_dropped": 0 if self.reads is None else self.reads.dropped}

    def close(self) -> None:
        """Unregister the buffers, close 0.30.0's connector (idempotent). Finished background reads no get took have
        their keys and parts removed from the store first (:meth:`_let_go`)."""
        if getattr(self, "_closed", True):
            return
        if self.reads is not None:
            self.reads.close()  # the reads running finish first; those no get took are removed
        with self._tx_lock, self._rx_lock:
            self._closed = True
            for buf in (self._tx_buf, self._rx_buf):
                if buf is not None:
                    try:
                        buf.close()
                    except Exception as e:  # noqa: BLE001
                        logger.warning("omni-accum %s: unregister_buffer: %s", NAME, e)
            self._tx_buf = self._rx_buf = None
        self.inner.close()


def _addresses(extra: Mapping[str, Any]) -> str:
    """The addresses 0.30.0's connector sets Mooncake up with, as it reads them (its defaults where absent)."""
    said = {k: extra.get(k, STORE_KEYS[k]) for k in ("master", "metadata_server", "host", "proto")}
    return ", ".join(f"{k} {v!r}" for k, v in said.items())


class _PutFailed(RuntimeError):
    """The store refused a part or the payload's key."""
