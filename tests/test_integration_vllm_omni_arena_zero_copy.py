"""``OmniAccumArenaConnector`` hands a chunk-0 payload's large tensors to the receiving stage as tensors
over the arena's pages (no copy on the receiving side), bit for bit what was put; their pages go back to
the sender once no tensor over them is left, not before; a consumer writing into them changes nothing
another request or the sender sees; held pages fill the arena, and later puts then fall back (counted)."""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import pytest
import torch

from tests.test_integration_vllm_omni import assert_same
from tests.test_integration_vllm_omni_arena_connector import _connector, arena_name, notice_dead_sender  # noqa: F401

pytestmark = pytest.mark.vllm
PAIR = ("0", "1")
P = 1500  # rows of the chunk-0 tensors ([P, 2048] bf16: 6 MB each; the real ones are 33 MB at 8k)


def chunk0(seed: int, rows: int = P, *, full: bool = False) -> Any:
    """A thinker -> talker first chunk as vllm-omni 0.30.0's Qwen3-Omni processors build it: the async-chunk
    one an ``OmniPayloadStruct`` (``thinker2talker_async_chunk``), the full-payload one a dict
    (``thinker2talker_full_payload``); ``embed.prefill`` and ``hidden_states.output`` ``[rows, 2048]`` bf16,
    the tts embeddings one row each, token ids, the finished flag, the speaker."""
    from vllm_omni.data_entry_keys import EmbeddingsStruct, HiddenStatesStruct, IdsStruct, MetaStruct, OmniPayloadStruct

    g = torch.Generator().manual_seed(seed)
    bf = lambda *shape: torch.randn(*shape, generator=g).bfloat16()  # noqa: E731
    prefill, output, bos, eos, pad = bf(rows, 2048), bf(rows, 2048), bf(1, 2048), bf(1, 2048), bf(1, 2048)
    ids = torch.randint(0, 150000, (rows,), generator=g).tolist()
    if full:
        return {
            "embed": {"prefill": prefill, "tts_bos": bos, "tts_eos": eos, "tts_pad": pad},
            "hidden_states": {"output": output},
            "ids": {"all": ids + [7], "prompt": ids},
            "meta": {"finished": torch.tensor(True)},
            "speaker": "Ethan",
        }
    return OmniPayloadStruct(
        embed=EmbeddingsStruct(prefill=prefill, tts_bos=bos, tts_eos=eos, tts_pad=pad),
        hidden_states=HiddenStatesStruct(output=output),
        ids=IdsStruct(all=ids, prompt=ids),
        meta=MetaStruct(finished=torch.tensor(False)),
        speaker="Ethan",
    )


def decoded(payload: Any) -> Any:
    """What vllm-omni's own encoding of ``payload`` decodes to (what SharedMemoryConnector hands over)."""
    from vllm_omni.distributed.omni_connectors.utils.serialization import OmniMsgpackDecoder, OmniMsgpackEncoder

    return OmniMsgpackDecoder().decode(OmniMsgpackEncoder().encode(payload))


def in_arena(arena: Any, t: torch.Tensor) -> bool:
    base = arena._u8.data_ptr()
    return base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= base + len(arena.region.mm)


def used_pages(arena: Any) -> int:
    """Data pages the page map (shared by both sides) says are taken."""
    pages = arena.region.pages.tobytes()
    return len(pages) - pages.count(0)


# The sending stage: another process, driven line by line (put / drain / check / die / quit).
def sender_main(conn: Any, name: str) -> None:
    """A sender in a process of its own (:class:`Sender`): one command per message on ``conn``, one answer each."""
    from tests.test_integration_vllm_omni_arena_connector import _connector

    tx = _connector(0, name)
    for _ in range(5000):  # attach first (a put before that goes through the inner connector); ~5 min at most
        if tx._sender(("0", "1")) is not None:
            break
        time.sleep(0.06)
    else:
        raise SystemExit("the sender never attached to the receiver's region")
    sent = {}
    while True:
        try:
            cmd, *args = conn.recv().split()
        except EOFError:  # the test process is gone
            return
        out: dict[str, Any] = {}
        if cmd == "put":
            key, seed, full = args[0], int(args[1]), args[2] == "full"
            sent[key] = (seed, full, chunk0(seed, full=full))
            ok, size, meta = tx.put("0", "1", key, sent[key][2])
            out = {"ok": ok, "arena": bool(meta.get("arena")), "health": tx.health()}
        elif cmd == "drain":  # take back the pages the receiver gave back (a put does this first)
            tx._tx[("0", "1")]._drain()
        elif cmd == "check":  # the sender's own tensors are as they were built
            for key, (seed, full, p) in sent.items():
                assert_same(decoded(p), decoded(chunk0(seed, full=full)), key)
        elif cmd == "die":
            os.kill(os.getpid(), 9)
        elif cmd == "quit":
            tx.close()
        conn.send(out)
        if cmd == "quit":
            return


class Sender:
    """:func:`sender_main` forked from the vllm-omni server of ``tests/forked.py`` (a fresh interpreter takes ~25 s
    to import vllm-omni here)."""

    def __init__(self, name: str) -> None:
        from tests.forked import Forked

        self.proc = Forked(f"{__name__}.sender_main", name)

    def send(self, *cmd: Any) -> None:
        self.proc.conn.send(" ".join(map(str, cmd)))

    def __call__(self, *cmd: Any) -> dict[str, Any]:
        self.send(*cmd)
        try:
            if self.proc.conn.poll(600):
                return self.proc.conn.recv()
        except EOFError:
            pass
        raise AssertionError(f"the sender ended ({self.proc.poll()}); its output is pytest's")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self("quit")
            finally:
                self.proc.end(60)  # killed past that: one left running would hang the test process at exit
        self.proc.conn.close()


@pytest.fixture
def sender(arena_name):
    made: list[Sender] = []

    def make() -> Sender:
        made.append(Sender(arena_name))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("mode", ["async_chunk", "full"])
def test_chunk0_from_another_process_is_a_view_over_the_arena(vo, arena_name, sender, mode):
    rx = _connector(1, arena_name)
    try:
        assert rx.get(*PAIR, "prime") is None  # the receiving stage creates the pair's region
        arena = rx._rx[PAIR]
        tx = sender()
        got = tx("put", "r1_0_0", 11, mode)
        assert got["ok"] and got["arena"] and got["health"]["inner_puts"] == 0
        payload, _ = rx.get(*PAIR, "r1_0_0")
        want = decoded(chunk0(11, full=mode == "full"))
        assert_same(payload, want, "chunk 0")
        big = [payload["embed"]["prefill"], payload["hidden_states"]["output"]]
        assert all(in_arena(arena, t) for t in big)  # no copy on the receiving side
        assert not in_arena(arena, payload["embed"]["tts_bos"]) and not in_arena(arena, payload["meta"]["finished"])
        h = rx.health()
        assert h["tensor_views"] == 2 and h["tensor_copies"] == 4 and h["view_bytes_held"] == 2 * P * 4096
        tx("drain")
        assert used_pages(arena) == 2 * P  # the small tensors' pages went back with the get; each big one holds its own

        # the pages stay while any tensor over them lives (a slice of one included) ...
        part = payload["hidden_states"]["output"][10:20]
        del payload, big
        gc.collect()
        tx("drain")
        assert used_pages(arena) == P and rx.health()["view_bytes_held"] == P * 4096
        assert torch.equal(part, want["hidden_states"]["output"][10:20])
        # ... and go back once none does (in whichever thread drops the last one)
        box = [part]
        del part
        dropper = threading.Thread(target=box.clear)
        dropper.start()
        dropper.join()
        tx("drain")
        assert used_pages(arena) == 0 and rx.health()["view_bytes_held"] == 0
        tx("check")
    finally:
        rx.close()


def test_a_consumer_writing_into_its_tensors_changes_nothing_anyone_else_sees(vo, arena_name):
    """vllm-omni 0.30.0's talker only reads chunk 0's tensors (``talker_preprocess_prefill``: ``.to`` and
    slices) and keeps them in the request's ``additional_information`` for the request's life; a consumer
    that wrote into them would write into pages that are its tensor's alone until it dies."""
    rx, tx = _connector(1, arena_name), _connector(0, arena_name)
    try:
        assert rx.get(*PAIR, "prime") is None
        arena = rx._rx[PAIR]
        sent = {seed: chunk0(seed) for seed in (21, 22)}
        assert tx.put(*PAIR, "a_0_0", sent[21])[2].get("arena")
        a = rx.get(*PAIR, "a_0_0")[0]
        assert in_arena(arena, a["embed"]["prefill"])
        a["embed"]["prefill"].fill_(7)
        a["hidden_states"]["output"].mul_(-1)
        assert tx.put(*PAIR, "b_0_0", sent[22])[2].get("arena")  # another request while a's pages are held
        b = rx.get(*PAIR, "b_0_0")[0]
        assert_same(b, decoded(chunk0(22)), "the next request")
        assert all(in_arena(arena, t) for t in (b["embed"]["prefill"], b["hidden_states"]["output"]))
        pages = a["embed"]["prefill"].data_ptr()
        del a
        gc.collect()
        tx._tx[PAIR]._drain()  # the sender takes the pages back (its put does when it finds no room)
        assert tx.put(*PAIR, "c_0_0", sent[21])[2].get("arena")
        c = rx.get(*PAIR, "c_0_0")[0]
        assert c["embed"]["prefill"].data_ptr() == pages  # the pages a wrote into, reused (first fit)
        assert_same(c, decoded(chunk0(21)), "a request on the reused pages")
        for seed, p in sent.items():  # the sender's own tensors are untouched
            assert_same(decoded(p), decoded(chunk0(seed)), f"sent {seed}")
    finally:
        tx.close()
        rx.close()


def test_held_views_fill_the_arena_then_puts_fall_back_counted(vo, arena_name):
    """Held tensors keep their pages; other requests go on through the arena until it is full, then their
    puts go through the inner connector (``arena_full``, counted), never waiting; once the tensors are
    dropped the arena takes puts again."""
    rows = 256  # [256, 2048] bf16: 1 MiB per tensor, 2 MiB per chunk 0
    rx = _connector(1, arena_name, arena_bytes="5MiB")
    tx = _connector(0, arena_name)
    try:
        assert rx.get(*PAIR, "prime") is None
        held = []
        for i in range(2):  # 4 MiB held
            assert tx.put(*PAIR, f"h{i}_0_0", chunk0(i, rows))[2].get("arena")
            held.append(rx.get(*PAIR, f"h{i}_0_0")[0])
        assert tx.health()["fallbacks"] == {}
        full = chunk0(9, rows)
        ok, _, meta = tx.put(*PAIR, "h9_0_0", full)
        assert ok and not meta.get("arena")  # 2 MiB do not fit in the 1 MiB left
        assert tx.health()["fallbacks"] == {"arena_full": 1} and tx.health()["inner_puts"] == 1
        got = rx.get(*PAIR, "h9_0_0")[0]
        assert_same(got, decoded(full), "through the inner connector")
        assert rx.health()["inner_gets"] == 1
        for i, p in enumerate(held):
            assert_same(p, decoded(chunk0(i, rows)), f"held {i}")  # still intact
        del held, p, got
        gc.collect()
        assert tx.put(*PAIR, "h10_0_0", chunk0(10, rows))[2].get("arena")
        assert_same(rx.get(*PAIR, "h10_0_0")[0], decoded(chunk0(10, rows)), "after the drop")
        assert tx.health()["fallbacks"] == {"arena_full": 1}
    finally:
        tx.close()
        rx.close()


def test_views_outlive_their_sender_and_their_pages_come_back_to_the_next(vo, arena_name, sender):
    """A sender killed while the receiving stage holds views: the views stay valid, bit for bit; their
    pages stay taken for the next sender until they are dropped, then come back to it."""
    rx = _connector(1, arena_name)
    try:
        assert rx.get(*PAIR, "prime") is None
        arena = rx._rx[PAIR]
        first = sender()
        assert first("put", "k_0_0", 31, "full")["arena"]
        kept = rx.get(*PAIR, "k_0_0")[0]
        first.send("die")
        assert first.proc.wait(timeout=60) == -9
        notice_dead_sender(arena)
        assert used_pages(arena) == 2 * P  # the held views' pages, kept from the next sender
        second = sender()
        assert second("put", "n_0_0", 32, "full")["arena"]
        n = rx.get(*PAIR, "n_0_0")[0]
        assert_same(n, decoded(chunk0(32, full=True)), "the next sender's")
        assert_same(kept, decoded(chunk0(31, full=True)), "kept")
        del n
        gc.collect()
        second("drain")
        assert used_pages(arena) == 2 * P
        del kept
        gc.collect()
        second("drain")
        assert used_pages(arena) == 0
    finally:
        rx.close()


@pytest.mark.parametrize("value", ["off", "1MiB"])
def test_arena_view_bytes_sets_which_tensors_are_copied(vo, arena_name, value):
    rx, tx = _connector(1, arena_name, arena_view_bytes=value), _connector(0, arena_name)
    try:
        assert rx.get(*PAIR, "prime") is None
        arena = rx._rx[PAIR]
        sent = chunk0(3, 512)  # 2 MiB per big tensor
        assert tx.put(*PAIR, "v_0_0", sent)[2].get("arena")
        got = rx.get(*PAIR, "v_0_0")[0]
        assert_same(got, decoded(sent), "payload")
        viewed = in_arena(arena, got["embed"]["prefill"])
        assert viewed == (value != "off") and rx.health()["tensor_views"] == (2 if viewed else 0)
        assert rx.health()["view_bytes_held"] == (2 * 512 * 4096 if viewed else 0)
    finally:
        tx.close()
        rx.close()


def test_a_bad_arena_view_bytes_is_named(vo):
    with pytest.raises(ValueError, match="arena_view_bytes = 'some'"):
        _connector(1, "bad", arena_view_bytes="some")
