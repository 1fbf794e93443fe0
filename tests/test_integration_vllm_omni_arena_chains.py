"""Append chains of ``OmniAccumArenaConnector``: the rows of an append key live in one shared slab per
request and key, written once by the sender; the receiver hands them out as views over the shared pages,
and ``prealloc`` takes those views as its buffer (no copy), bit for bit the ``torch.cat`` of the chunks,
with the pages going back once no tensor shows them."""

from __future__ import annotations

import contextlib
import gc
import os
import random
from typing import Any

import pytest
import torch

from omni_accum.strategy import ARENA_TAG

from tests.forked import Forked
from tests.test_integration_vllm_omni import T2T, _thinker_steps, assert_same
from tests.test_integration_vllm_omni_arena_connector import NAME, _connector, arena_name, notice_dead_sender  # noqa: F401

pytestmark = pytest.mark.vllm
D = 64


def _inside(t: torch.Tensor, rx_arena: Any) -> bool:
    lo = rx_arena._u8.data_ptr()
    return lo <= t.data_ptr() < lo + rx_arena._u8.numel()


def _all_pages_back(tx_conn: Any, rx_conn: Any) -> bool:
    """After the views die: the receiver gives the slabs back, the sender takes them (its page map empties)."""
    rx_arena = rx_conn._rx[("0", "1")]
    rx_arena._pump()  # the chains' ends the sender pushed since the receiver last looked
    gc.collect()
    rx_arena.reap()
    tx_arena = tx_conn._tx[("0", "1")]
    tx_arena._drain()
    return not rx_arena._live_slabs and not any(bytes(rx_arena.region.pages))


def test_adapter_keys_live_in_the_arena_with_real_adapters(vo, arena_name, adapters):
    """Real chunk transfer adapters, qwen3-omni policy: the AR adapter's accumulated prefill and hidden
    states are views over the receiving region (no copy), the payloads handed over are those of the
    SharedMemoryConnector, and every slab goes back once the request's tensors are gone."""
    from omni_accum.integrations.vllm_omni.binding import binding_for
    from tests.test_integration_vllm_omni_lifecycle import drive

    _connector(1, f"{arena_name}-reg").close()  # registers the connector with the factory
    vo.install("qwen3-omni")
    pid = os.getpid()
    steps = _thinker_steps(seed=5, decode_steps=5)
    base = drive(adapters(0, next_func=T2T), adapters(1), f"oa-ch-base-{pid}", steps)
    extra = {"arena_name": arena_name}
    tx = adapters(0, next_func=T2T, connector=NAME, extra=extra)
    rx = adapters(1, connector=NAME, extra=extra)
    assert rx.connector.get("0", "1", "prime") is None
    arena = rx.connector._rx[("0", "1")]
    seen: list[tuple[str, bool]] = []

    def after(i: int) -> None:
        b = binding_for(rx)
        for rid in list(b.receiver._requests):
            view = b.receiver.view(rid)
            for top, qual in (("embed", "prefill"), ("hidden_states", "output")):
                seen.append((f"{top}.{qual}", _inside(view[top][qual], arena)))

    handed = drive(tx, rx, f"oa-ch-{pid}", steps, after=after)
    assert_same(handed, base, "handed")
    assert seen and all(inside for _, inside in seen), seen
    assert tx.connector.health()["chain_appends"] >= 2 and rx.connector.health()["chain_views"] >= 2
    assert tx.connector.health()["inner_puts"] == 0
    # the processor built both prompt keys (10 prefill rows, then the first decode step's) in the slabs
    # their put announced: the put copied none of those rows
    assert tx.connector.health()["chain_rows_in_place"] == 2 * (4 + 4 + 2 + 1)
    del handed
    assert _all_pages_back(tx.connector, rx.connector)


def sender_main(conn: Any, name: str, seed: int, tag: str) -> None:
    """The sending stage in a process of its own (forked: ``tests/forked.py``): request streams ``_streams(seed,
    tag)``, each released at its end, then its health to the test; it closes once the test says the receiver has
    taken everything (its inner connector's segments live until then)."""
    tx = _connector(0, name, arena_bytes="6MiB")
    streams = _streams(seed, tag)
    with _sending():
        for key, chunk in streams:
            while True:
                ok, size, meta = tx.put("0", "1", key, chunk)
                assert ok
                if meta.get("arena") or key != streams[0][0]:  # the first put waits for the region
                    break
            if chunk["meta"]["finished"]:
                tx.release_request(key.rsplit("_", 2)[0])  # omni-accum's sender-release hook does this
    conn.send(tx.health())
    conn.recv()
    tx.close()


def _streams(seed: int, tag: str) -> list[tuple[str, dict[str, Any]]]:
    """Three requests interleaved: chunked prefill (one chunk of request r1 too big for the 6 MiB arena:
    it goes through the inner connector), then decode rows; two dtypes, and a top-level key under cat.
    ``tag`` ends each request id (``r0<tag>``...): the chunk that goes the inner way is /dev/shm/<key>, which
    a fixed name would share with a test of another pytest process."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    plans = {
        "r0": [7, 130, 3] + [1] * 150,
        "r1": [40, 30000, 5] + [1] * 60,  # 30000 x 64 float32 rows: 7.7 MB, over the arena
        "r2": [1] * 90,
    }
    cursor = dict.fromkeys(plans, 0)
    out = []
    while any(cursor[r] < len(p) for r, p in plans.items()):
        r = rnd.choice([r for r, p in plans.items() if cursor[r] < len(p)])
        i = cursor[r]
        rows = plans[r][i]
        cursor[r] += 1
        key = "prefill" if i < 3 and r != "r2" else "decode"
        emb = {key: torch.randn(rows, D, generator=g).to(torch.float32 if r == "r1" else torch.bfloat16)}
        chunk = {"embed": emb, "meta": {"finished": torch.tensor(cursor[r] == len(plans[r]))}}
        if r == "r2":
            chunk["codes"] = torch.randint(0, 99, (rows, 4), generator=g)
        out.append((f"{r}{tag}_0_{i}", chunk))
    return out


class _sending:
    """A send as omni-accum's put wrapper makes it: the connector asks the qwen3-omni policy which keys
    it appends (outside vllm-omni's adapter, in a process of its own)."""

    def __enter__(self) -> None:
        from omni_accum.integrations.vllm_omni import send
        from omni_accum.integrations.vllm_omni.binding import Binding
        from omni_accum.integrations.vllm_omni.binding_settings import DEFAULT_ADAPTER_KEYS
        from omni_accum.policy import load_policy

        send._tls.putting = Binding(load_policy("qwen3-omni"), DEFAULT_ADAPTER_KEYS, "test")

    def __exit__(self, *exc: object) -> None:
        from omni_accum.integrations.vllm_omni import send

        send._tls.putting = None


def test_across_processes_views_are_cat_bit_for_bit_and_mostly_zero_copy(vo, arena_name):
    """A sender process, the receiver here merging into omni-accum's Receiver (qwen3-omni: prealloc for
    embed.*, cat for codes): after every chunk each view equals torch.cat of the chunks, the prealloc
    keys' views are the shared pages until a chunk comes another way (then a buffer of its own), slabs
    move as they grow, and every page goes back once the requests are released."""
    from omni_accum.engine import Receiver
    from omni_accum.policy import load_policy

    rx = _connector(1, arena_name, arena_bytes="6MiB")
    recv = Receiver(load_policy("qwen3-omni"))
    arena = None
    try:
        assert rx.get("0", "1", "prime") is None
        arena = rx._rx[("0", "1")]
        proc = Forked(f"{__name__}.sender_main", arena_name, 3, f"p{os.getpid()}")
        try:
            sent = proc.answer(600)
            assert sent is not None, "the sender said nothing within 600 s (its error, if it raised, is above)"
            assert sent["fallbacks"] == {"arena_full": 1}, sent  # r1's 7.7 MB chunk
            _receive(rx, recv, arena)
        finally:
            with contextlib.suppress(OSError):
                proc.conn.send("done")
            rc = proc.end(120)
        assert rc == 0
        gc.collect()
        arena.reap()
        assert not arena._live_slabs  # every slab went back
        # the next sender takes back what the last one had no time to: the page map ends empty
        tx = _connector(0, arena_name)
        try:
            assert tx.put("0", "1", "after_0_0", {"x": torch.arange(5000)})[2].get("arena")
            assert_same(rx.get("0", "1", "after_0_0")[0], {"x": torch.arange(5000)})
            assert _all_pages_back(tx, rx)
        finally:
            tx.close()
    finally:
        rx.close()


def _receive(rx: Any, recv: Any, arena: Any) -> None:
    """Take every chunk in order, merge it, check every view against torch.cat; release each request at its end."""
    ref: dict[str, dict[str, list[torch.Tensor]]] = {}
    zero_copy = copied = 0
    order = _streams(3, f"p{os.getpid()}")
    ends = {key.rsplit("_", 2)[0]: key for key, _ in order}
    for key, chunk in order:
        rid = key.rsplit("_", 2)[0]
        got = rx.get("0", "1", key)
        assert got is not None, key
        payload = got[0]
        assert_same(payload, chunk, key)
        recv.merge(rid, payload)
        mine = ref.setdefault(rid, {})
        for q, v in payload["embed"].items():
            mine.setdefault(("embed", q), []).append(v.clone())
        if "codes" in payload:
            mine.setdefault(("codes", None), []).append(payload["codes"].clone())
        view = recv.view(rid)
        for (top, q), parts in mine.items():
            held = view[top] if q is None else view[top][q]
            want = torch.cat(parts)
            assert held.dtype == want.dtype and torch.equal(held, want), (key, top, q)
            if top == "embed":  # prealloc: the shared pages while every chunk came through a chain
                if _inside(held, arena):
                    zero_copy += 1
                else:
                    copied += 1
        if key == ends[rid]:
            recv.release(rid)
            ref.pop(rid)
    assert rx.health()["chain_views"] > 300
    # r0 and r2 all the way, r1 until its chunk went through the inner connector
    assert zero_copy > copied > 0, (zero_copy, copied)


def test_rows_staged_in_a_slab_go_out_without_a_copy_and_unannounced_slabs_come_back(vo, arena_name):
    """``stage_rows``: a buffer over the slab of a request's chain. Rows written there and put from there are
    not copied (counted in place), the receiver's view is those pages, bit for bit; rows put from elsewhere
    are copied into it; a put that outgrows it moves to a larger slab; a staged slab no put announced goes
    back at the request's release or after a failed put; a chain that holds rows is not staged again."""
    rx, tx = _connector(1, arena_name, arena_bytes="8MiB"), _connector(0, arena_name)
    g = torch.Generator().manual_seed(7)
    try:
        assert rx.get("0", "1", "prime") is None
        arena = rx._rx[("0", "1")]
        with _sending():
            rows = torch.randn(40, 256, generator=g).bfloat16()
            buf = tx.stage_rows("0", "1", "s1", "embed.prefill", torch.bfloat16, (256,), 41)
            assert buf is not None and buf.shape == (41, 256)
            buf[:40] = rows
            buf[40:41] = rows[:1]
            assert tx.put("0", "1", "s1_0_0", {"embed": {"prefill": buf[:41]}})[2].get("arena")
            got = rx.get("0", "1", "s1_0_0")[0]["embed"]["prefill"]
            assert torch.equal(got, torch.cat([rows, rows[:1]])) and _inside(got, arena)
            assert tx.health()["chain_rows_in_place"] == 41
            # the next rows of the chain (a decode row from elsewhere) are copied behind them
            more = torch.randn(1, 256, generator=g).bfloat16()
            assert tx.put("0", "1", "s1_0_1", {"embed": {"prefill": more}})[2].get("arena")
            assert torch.equal(rx.get("0", "1", "s1_0_1")[0]["embed"]["prefill"], more)
            assert tx.health()["chain_rows_in_place"] == 41
            assert tx.stage_rows("0", "1", "s1", "embed.prefill", torch.bfloat16, (256,), 10) is None  # holds rows
            del got
            # rows put from their own memory into a staged slab: copied; more rows than it holds: moved
            buf2 = tx.stage_rows("0", "1", "s2", "embed.prefill", torch.bfloat16, (256,), 8)
            big = torch.randn(30, 256, generator=g).bfloat16()
            assert tx.put("0", "1", "s2_0_0", {"embed": {"prefill": big}})[2].get("arena")
            assert torch.equal(rx.get("0", "1", "s2_0_0")[0]["embed"]["prefill"], big)
            assert tx.health()["chain_rows_in_place"] == 41
            del buf2
            # staged, never put: the pages go back at the release
            tx_arena = tx._tx[("0", "1")]
            used = sum(1 for b in bytes(tx_arena.region.pages) if b)
            buf3 = tx.stage_rows("0", "1", "s3", "hidden_states.output", torch.bfloat16, (256,), 100)
            assert sum(1 for b in bytes(tx_arena.region.pages) if b) > used
            del buf3
            tx.release_request("s3")
            assert sum(1 for b in bytes(tx_arena.region.pages) if b) == used
            # staged, then a put that fails after the slab was announced in it: pages back, chain dropped
            buf4 = tx.stage_rows("0", "1", "s4", "embed.prefill", torch.bfloat16, (256,), 5)
            buf4[:5] = torch.ones(5, 256)
            tx_arena.drop_chains("s4")
            assert sum(1 for b in bytes(tx_arena.region.pages) if b) == used
            del buf4
            # staged for one dtype, put as another: a new chain; the staged slab's pages come back (the page
            # map ends empty below)
            tx.stage_rows("0", "1", "s6", "embed.prefill", torch.bfloat16, (256,), 4)
            assert tx.put("0", "1", "s6_0_0", {"embed": {"prefill": torch.ones(4, 256)}})[2].get("arena")
            assert torch.equal(rx.get("0", "1", "s6_0_0")[0]["embed"]["prefill"], torch.ones(4, 256))
            tx.release_request("s6")
            for rid in ("s1", "s2", "s4"):
                tx.release_request(rid)
        assert _all_pages_back(tx, rx)
    finally:
        tx.close()
        rx.close()
    off = _connector(0, arena_name, arena_stage_rows="off")
    try:  # arena_stage_rows off: no slab is handed out (the processor builds its rows in its own memory)
        assert off.stage_rows("0", "1", "s5", "embed.prefill", torch.bfloat16, (256,), 8) is None
    finally:
        off.close()


def test_a_staged_slab_takes_the_pages_the_receiver_gave_back(vo, arena_name):
    """``stage_rows`` first takes back the pages the receiver released (as a put does), so a request's slab
    reuses the previous request's pages (already given and mapped) instead of fresh ones."""
    rx, tx = _connector(1, arena_name, arena_bytes="8MiB"), _connector(0, arena_name)
    try:
        assert rx.get("0", "1", "prime") is None
        arena = rx._rx[("0", "1")]
        with _sending():
            buf = tx.stage_rows("0", "1", "p1", "embed.prefill", torch.bfloat16, (256,), 64)
            first = buf.data_ptr()
            buf[:] = 1
            assert tx.put("0", "1", "p1_0_0", {"embed": {"prefill": buf}})[2].get("arena")
            got = rx.get("0", "1", "p1_0_0")[0]
            tx.release_request("p1")
            del buf, got
            rx.get("0", "1", "none")  # the receiver takes the chain's end ...
            gc.collect()
            arena.reap()  # ... and, with no view left, gives the slab back on its ring
            again = tx.stage_rows("0", "1", "p2", "embed.prefill", torch.bfloat16, (256,), 64)
            assert again.data_ptr() == first
            del again
            tx.release_request("p2")
        assert _all_pages_back(tx, rx)
    finally:
        tx.close()
        rx.close()


def test_released_chain_space_is_reused_over_many_requests(vo, arena_name):
    """A thousand requests of growing chains through a 1 MiB arena: space comes back as requests end,
    so no put ever falls back for lack of it, and the page map ends empty."""
    from omni_accum.engine import Receiver
    from omni_accum.policy import load_policy

    rx, tx = _connector(1, arena_name, arena_bytes="1MiB"), _connector(0, arena_name)
    recv = Receiver(load_policy("qwen3-omni"))
    try:
        assert rx.get("0", "1", "prime") is None
        g = torch.Generator().manual_seed(1)
        with _sending():
            for r in range(1000):
                rid = f"q{r}"
                parts = []
                for i, rows in enumerate([50] + [1] * 5):
                    row = torch.randn(rows, 256, generator=g).bfloat16()
                    parts.append(row)
                    assert tx.put("0", "1", f"{rid}_0_{i}", {"embed": {"prefill": row}})[2].get("arena")
                    recv.merge(rid, rx.get("0", "1", f"{rid}_0_{i}")[0])
                held = recv.view(rid)["embed"]["prefill"]
                assert getattr(held, ARENA_TAG, None) is None and torch.equal(held, torch.cat(parts)), rid
                recv.release(rid)
                tx.release_request(rid)
                del held
        h = tx.health()
        assert h["fallbacks"] == {} and h["inner_puts"] == 0 and h["chain_appends"] == 1000 * 6
        assert _all_pages_back(tx, rx)
    finally:
        tx.close()
        rx.close()


def test_a_release_during_a_put_never_waits_and_the_next_put_ends_the_chains(vo, arena_name):
    """vllm-omni cleans a sender's request up on the scheduler's thread, which must not wait for a put in
    progress: ``release_request`` then leaves the chains' end to the connector's next put."""
    rx, tx = _connector(1, arena_name), _connector(0, arena_name)
    try:
        assert rx.get("0", "1", "prime") is None
        with _sending():
            rows = torch.ones(3, 8).bfloat16()
            assert tx.put("0", "1", "a_0_0", {"embed": {"prefill": rows}})[2].get("arena")
            assert torch.equal(rx.get("0", "1", "a_0_0")[0]["embed"]["prefill"], rows)
            arena = rx._rx[("0", "1")]
            assert "a" in arena._chains_of
            with tx._tx_lock:  # a put in progress on another thread
                tx.release_request("a")  # returns at once
                assert list(tx._to_release) == ["a"]
            assert tx.put("0", "1", "b_0_0", {"embed": {"prefill": rows}})[2].get("arena")
            assert not tx._to_release
            rx.get("0", "1", "b_0_0")
            assert "a" not in arena._chains_of and "b" in arena._chains_of
    finally:
        tx.close()
        rx.close()


def killed_main(conn: Any, name: str) -> None:
    """A sender (forked: ``tests/forked.py``) with two requests' chains in flight: ``k0`` ends and is released,
    ``k1`` is not; then SIGKILL (no close, no release of ``k1``)."""
    tx = _connector(0, name)
    g = torch.Generator().manual_seed(4)
    with _sending():
        for i in range(40):  # request k: a 20-row prefill, then rows; k0 ends, k1 is in flight
            for rid in ("k0", "k1"):
                if rid == "k0" and i >= 20:
                    continue
                rows = torch.randn(20 if i == 0 else 1, 32, generator=g).bfloat16()
                while not tx.put("0", "1", f"{rid}_0_{i}", {"embed": {"prefill": rows}})[2].get("arena"):
                    pass  # the first put waits for the region
            if i == 19:
                tx.release_request("k0")
    os.kill(os.getpid(), 9)


@pytest.mark.once
def test_a_sender_killed_mid_chain_leaves_views_valid_and_gives_every_page_back(vo, arena_name):
    """kill -9 of a sender with chains in flight: what it published stays readable bit for bit (prealloc
    views over the shared pages), the receiver resets the region for a new sender without giving it the
    pages those views show, and they come back once the views are gone."""
    from omni_accum.engine import Receiver
    from omni_accum.policy import load_policy

    rx = _connector(1, arena_name)
    recv = Receiver(load_policy("qwen3-omni"))
    try:
        assert rx.get("0", "1", "prime") is None
        arena = rx._rx[("0", "1")]
        rc = Forked(f"{__name__}.killed_main", arena_name).end(600)
        assert rc == -9, f"the sender ended with {rc}, not SIGKILL (its error above)"
        g = torch.Generator().manual_seed(4)
        want: dict[str, list[torch.Tensor]] = {"k0": [], "k1": []}
        for i in range(40):
            for rid in ("k0", "k1"):
                if rid == "k0" and i >= 20:
                    continue
                want[rid].append(torch.randn(20 if i == 0 else 1, 32, generator=g).bfloat16())
                got = rx.get("0", "1", f"{rid}_0_{i}")
                assert got is not None, (rid, i)
                recv.merge(rid, got[0])
        views = {rid: recv.view(rid)["embed"]["prefill"] for rid in want}
        for rid, parts in want.items():
            assert torch.equal(views[rid], torch.cat(parts)) and _inside(views[rid], arena), rid
        notice_dead_sender(arena)
        held = dict(arena._live_slabs)
        assert held  # k1's slab (and k0's, whose views live on) stay out of a new sender's reach
        tx = _connector(0, arena_name)
        try:
            big = {"x": torch.arange(300_000, dtype=torch.int32)}
            assert tx.put("0", "1", "n_0_0", big)[2].get("arena")
            assert_same(rx.get("0", "1", "n_0_0")[0], big)
            for rid, parts in want.items():  # the new sender's pages did not land on the views
                assert torch.equal(views[rid], torch.cat(parts)), rid
            for rid in want:
                recv.release(rid)
            del views, got
            assert _all_pages_back(tx, rx)
        finally:
            tx.close()
    finally:
        rx.close()


def test_a_payload_struct_is_chained_as_the_map_its_encoding_is(vo, arena_name):
    """vllm-omni's adapter may put an ``OmniPayloadStruct``: its append keys go as chains too, and the
    receiver gets exactly what vllm-omni's own encoding of the struct decodes to."""
    from vllm_omni.data_entry_keys import EmbeddingsStruct, MetaStruct, OmniPayloadStruct
    from vllm_omni.distributed.omni_connectors.utils.serialization import OmniMsgpackDecoder, OmniMsgpackEncoder

    rx, tx = _connector(1, arena_name), _connector(0, arena_name)
    try:
        assert rx.get("0", "1", "prime") is None
        rows = torch.arange(24, dtype=torch.float32).view(4, 6).bfloat16()
        s = OmniPayloadStruct(embed=EmbeddingsStruct(prefill=rows), meta=MetaStruct(finished=torch.tensor(False)))
        want = OmniMsgpackDecoder().decode(OmniMsgpackEncoder().encode(s))
        with _sending():
            assert tx.put("0", "1", "s_0_0", s)[2].get("arena")
        got = rx.get("0", "1", "s_0_0")[0]
        assert_same(got, want, "struct")
        assert getattr(got["embed"]["prefill"], ARENA_TAG)[1] == 0 and tx.health()["chain_appends"] == 1
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("receiver_saw_sender", [True, False], ids=["sender-seen", "sender-unseen"])
def test_chains_end_after_a_failed_put_a_late_put_and_a_sender_that_closed(vo, arena_name, monkeypatch, receiver_saw_sender):
    """The request's end still reaches the receiver after a put of it fell back (a full arena); a put of
    a request already ended goes without chains (none would end); and when a sender closes without
    ending its chains, the receiver ends them itself once it notices, also when no liveness check ran
    while the sender was attached (it attached, sent and closed between two checks: failed at random in CI)."""
    import omni_accum.arena.receiver as receiver_mod

    if not receiver_saw_sender:
        monkeypatch.setattr(receiver_mod, "LIVENESS_EVERY_S", 1e9)  # no periodic check while it sends
    rx, tx = _connector(1, arena_name, arena_bytes="1MiB"), _connector(0, arena_name)
    try:
        assert rx.get("0", "1", "prime") is None
        arena = rx._rx[("0", "1")]
        f = f"f{os.getpid()}"  # the request (its chunk through the inner connector is /dev/shm/<key>)
        small, big = torch.ones(4, 16).bfloat16(), torch.ones(1024, 1024).bfloat16()  # big: 2 MiB
        with _sending():
            assert tx.put("0", "1", f"{f}_0_0", {"embed": {"prefill": small}})[2].get("arena")
            assert tx.put("0", "1", f"{f}_0_1", {"embed": {"prefill": big}})[0]  # arena_full: the inner connector
            assert tx.health()["fallbacks"] == {"arena_full": 1}
            for k in (f"{f}_0_0", f"{f}_0_1"):
                assert rx.get("0", "1", k) is not None
            assert f in arena._chains_of
            tx.release_request(f)
            before = tx.health()["chain_appends"]
            assert tx.put("0", "1", f"{f}_0_2", {"embed": {"prefill": small}})[2].get("arena")  # after its end
            assert tx.health()["chain_appends"] == before
            got = rx.get("0", "1", f"{f}_0_2")[0]["embed"]["prefill"]
            assert torch.equal(got, small) and getattr(got, ARENA_TAG, None) is None
            assert f not in arena._chains_of
            assert tx.put("0", "1", "g_0_0", {"embed": {"prefill": small}})[2].get("arena")
            assert rx.get("0", "1", "g_0_0") is not None and "g" in arena._chains_of
        if receiver_saw_sender:
            arena.check_sender()
            assert arena._sender_pid == os.getpid()
        else:
            assert arena._sender_pid == 0
        tx._tx[("0", "1")].region.close()  # the sender's side closes, its chains not ended
        arena.check_sender()  # as the receiver does every few ms while taking messages
        assert "g" not in arena._chains_of
    finally:
        tx.close()
        rx.close()
