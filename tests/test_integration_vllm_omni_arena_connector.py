"""``OmniAccumArenaConnector``: registered with vllm-omni's real connector factory, driven by real chunk
transfer adapters and across processes, bit-exact, falling back to the inner SharedMemoryConnector
whenever the arena cannot take a put (nothing lost), and leaving nothing in /dev/shm."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import time
from typing import Any

import pytest
import torch

from omni_accum.arena.region import W_SENDER_PID, PeerDied
from omni_accum.arena._common import LIVENESS_EVERY_S
from omni_accum.samehost import private_dir

from tests.test_arena import wait_exited
from tests.test_integration_vllm_omni import T2T, _thinker_steps, assert_same

pytestmark = pytest.mark.vllm
NAME = "OmniAccumArenaConnector"


@pytest.fixture
def arena_name(tmp_path):
    name = f"t{os.getpid()}_{int(time.monotonic_ns() % 10**9)}"
    yield name
    left = glob.glob(f"/dev/shm/omni_accum_arena_{name}*") + glob.glob(f"{private_dir()}/*{name}*")
    for p in left:
        os.unlink(p)
    assert not left, f"arena files left behind: {left}"


def notice_dead_sender(arena: Any) -> None:
    """Have the receiving side look at its sender now (it does every few ms while taking messages): a
    dead one is found, the region reset for a new sender."""
    try:
        arena.check_sender()
    except PeerDied:
        pass
    assert not arena.region.q[W_SENDER_PID]


def _connector(stage_id: int, name: str, **extra: Any) -> Any:
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec

    from omni_accum.integrations.vllm_omni import arena_plugin

    arena_plugin.register()
    return OmniConnectorFactory.create_connector(
        ConnectorSpec(name=NAME, extra={"stage_id": stage_id, "arena_name": name, **extra})
    )


def _payloads(seed: int, n: int) -> list[dict[str, Any]]:
    """Payloads as the adapters put them: nested dicts of tensors of several dtypes and shapes, a
    non-contiguous one, a 0-d one, an empty one, lists, strings, None."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        wide = torch.randn(6, 2 * 64, generator=g)
        out.append(
            {
                "embed": {"decode": torch.randn(1, 64, generator=g).bfloat16(), "strided": wide[:, ::2]},
                "codes": {"audio": torch.randint(0, 4096, (1, 16), generator=g)},
                "meta": {"finished": torch.tensor(i == n - 1), "left": torch.tensor(i), "empty": torch.zeros(0, 8)},
                "ids": {"prompt": list(range(i + 3))},
                "speaker": "Ethan",
                "none": None,
                "half": torch.randn(2, 3, generator=g).half(),
            }
        )
    return out


def test_registered_in_the_real_factory(vo, arena_name):
    from vllm_omni.distributed.omni_connectors.connectors.base import OmniConnectorBase
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    c = _connector(1, arena_name)
    try:
        assert NAME in OmniConnectorFactory.list_registered_connectors()
        assert isinstance(c, OmniConnectorBase) and c.stage_id == 1
        assert c.health()["status"] == "healthy"
    finally:
        c.close()
        c.close()  # idempotent


def test_health_while_another_thread_adds_a_stage_pair(vo, arena_name):
    """``health()`` (a monitoring thread's call) summed over the connector's tables while the receiving or sending
    thread may add a pair to them: "dictionary changed size during iteration" out of the call."""
    c = _connector(1, arena_name)

    class Receiver:  # a receiver whose numbers are read while a pair is added (as another thread would add one)
        view_bytes = staticmethod(lambda: 0)

        @property
        def chain_views(self):
            c._rx[("8", str(len(c._rx) + 9))] = None
            return 2

    try:
        c._rx[("7", "8")] = Receiver()
        h = c.health()
        assert h["chain_views"] == 2 and h["status"] == "healthy"
    finally:
        c._rx.clear()
        c.close()


@pytest.mark.parametrize(
    ("extra", "word"),
    [
        ({"arena_bytes": "lots"}, "arena_bytes"),
        ({"ring_bytes": -4}, "ring_bytes"),
        ({"arena_name": "a/b"}, "arena_name"),
        # each used to be taken as 0 or 1 byte (every put then fell back, or the ring's limit read -16)
        ({"arena_bytes": "0.5"}, "arena_bytes = '0.5' is not a whole number"),
        ({"arena_bytes": 1.5}, "arena_bytes = 1.5 is not a size"),
        ({"ring_bytes": "0.1"}, "ring_bytes"),
        ({"arena_bytes": 100}, "under the minimum of 4096"),
        # a mistyped key used to be ignored (the default 1 GiB used), a name 0 to become "omni"
        ({"arena_size": "8GiB"}, "unknown extra key.*'arena_size'.*arena_bytes"),
        ({"arena_warm": "lots"}, r"arena_warm = 'lots' is not a size.*\(or all, off\)"),
        ({"arena_warm": 100}, "arena_warm = 100 is 100 bytes, under the minimum"),
        ({"arena_stage_rows": "maybe"}, r"arena_stage_rows = 'maybe': use true or false"),
    ],
)
def test_bad_settings_are_named(vo, extra, word):
    with pytest.raises(ValueError, match=word):
        _connector(1, "bad", **extra)


def test_arena_warm_reads_a_size_all_or_off(vo):
    assert _connector(1, "w1", arena_bytes="64MiB").warm_bytes == 0  # the default: off
    assert _connector(1, "w2", arena_bytes="64MiB", arena_warm="16MiB").warm_bytes == 16 << 20
    assert _connector(1, "w3", arena_bytes="64MiB", arena_warm="all").warm_bytes == 64 << 20
    assert _connector(1, "w4", arena_bytes="64MiB", arena_warm="64MiB").warm_bytes == 64 << 20  # at most the region
    assert _connector(1, "w5", arena_bytes="64MiB", arena_warm="off").warm_bytes == 0


def test_a_warmed_region_serves_bit_exact_payloads(vo, arena_name):
    rx, tx = _connector(1, arena_name, arena_warm="8MiB"), _connector(0, arena_name, arena_warm="8MiB")
    try:
        assert rx.get("0", "1", "nothing yet") is None  # creates the region, warms it in the background
        sent = _payloads(1, 3)
        for i, p in enumerate(sent):
            ok, _, meta = tx.put("0", "1", f"k{i}", p)
            assert ok and meta["arena"] == f"{arena_name}_0_1"
        for i in range(3):
            got, _ = rx.get("0", "1", f"k{i}")
            assert_same(got, sent[i], f"payload {i}")
        for region in (rx._rx[("0", "1")].region, tx._tx[("0", "1")].region):
            region._warm_thread.join(timeout=60)
            assert region.warmed["bytes"] == 8 << 20 and region.warmed["stopped"] is None, region.warmed
    finally:
        tx.close()
        rx.close()


def test_one_process_round_trip_is_bit_exact_and_uses_the_arena(vo, arena_name):
    rx, tx = _connector(1, arena_name), _connector(0, arena_name)
    try:
        assert rx.get("0", "1", "nothing yet") is None  # the receiver creates the pair's region
        sent = _payloads(1, 5)
        keys = [f"k{os.getpid()}_{i}" for i in range(5)]  # a get the arena cannot serve reads /dev/shm/<key>
        for k, p in zip(keys, sent):
            ok, size, meta = tx.put("0", "1", k, p)
            assert ok and size > 0 and meta["arena"] == f"{arena_name}_0_1"
        for i in reversed(range(5)):  # any order: a keyed mailbox
            got, size = rx.get("0", "1", keys[i])
            assert_same(got, sent[i], f"payload {i}")
            assert got["embed"]["strided"].is_contiguous()
        assert tx.health()["arena_puts"] == 5 and tx.health()["inner_puts"] == 0
        assert rx.health()["arena_gets"] == 5
        assert rx.get("0", "1", keys[0]) is None  # taken once
    finally:
        tx.close()
        rx.close()


def test_a_message_no_get_takes_is_dropped_after_the_orphan_time_and_its_pages_go_back(vo, arena_name, monkeypatch):
    """vllm-omni 0.30.0 removes an aborted request's unread chunks only for a SharedMemoryConnector: in the arena
    they held their pages for good (113 aborted requests filled a 4 MiB arena, every later put went the inner way).
    A message older than the orphan time is dropped at a later get; one taken in time never is."""
    from omni_accum.integrations.vllm_omni import arena_connector

    monkeypatch.setattr(arena_connector, "ORPHAN_CHECK_S", 0.0)
    monkeypatch.setenv("VLLM_OMNI_INPUT_WAIT_TIMEOUT_S", "45")
    rx, tx = _connector(1, arena_name, arena_bytes="256KiB"), _connector(0, arena_name)
    try:
        assert rx.orphan_s == 90.0  # twice vllm-omni's input wait (at least a minute)
        assert rx.get("0", "1", "nothing yet") is None
        big = {"x": torch.arange(40 * 1024, dtype=torch.int32)}  # 160 KiB of the 256 KiB: one at a time
        assert tx.put("0", "1", "aborted_0_0", big)[2]["arena"]  # never taken: its request was aborted downstream
        clock = [time.monotonic()]
        monkeypatch.setattr(arena_connector, "_now", lambda: clock[0])
        assert rx.get("0", "1", "other") is None  # a look: seen waiting
        clock[0] += 60  # within the orphan time: kept
        assert rx.get("0", "1", "other") is None and rx.health()["orphans_dropped"] == 0
        assert rx._rx[("0", "1")].pending_keys() == ["aborted_0_0"]
        clock[0] += 31  # past it: dropped, its pages back
        assert rx.get("0", "1", "other") is None
        assert rx.health()["orphans_dropped"] == 1 and not rx._rx[("0", "1")].pending_keys()
        assert rx.status_row()["orphans_dropped"] == 1
        tx._tx[("0", "1")].reclaim()
        ok, _, meta = tx.put("0", "1", "next_0_0", big)  # room again: through the arena, not the inner connector
        assert ok and meta is not None and meta.get("arena") and tx.health()["inner_puts"] == 0
        got, _ = rx.get("0", "1", "next_0_0")
        assert torch.equal(got["x"], big["x"])
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("value", ["abc", "inf", "-5"])  # (0: no deadline, never: test_arena_settings_refusals.py)
def test_an_input_wait_vllm_omni_does_not_take_gives_the_default_orphan_time(monkeypatch, value):
    from omni_accum.integrations.vllm_omni import arena_connector

    monkeypatch.setenv("VLLM_OMNI_INPUT_WAIT_TIMEOUT_S", value)
    assert arena_connector.orphan_after_s() == 1200.0
    monkeypatch.setenv("VLLM_OMNI_INPUT_WAIT_TIMEOUT_S", "10")
    assert arena_connector.orphan_after_s() == 60.0  # at least a minute


def test_puts_before_the_region_exists_and_into_a_full_arena_go_through_shm(vo, arena_name):
    tx = _connector(0, arena_name)
    rx = None
    try:
        early = _payloads(2, 1)[0]
        assert tx.put("0", "1", f"{arena_name}-early", early)[0]  # no receiver yet: the inner connector
        assert tx.health()["inner_puts"] == 1
        rx = _connector(1, arena_name, arena_bytes="64KiB")
        got, _ = rx.get("0", "1", f"{arena_name}-early")
        assert_same(got, early, "early")
        tx._tx_retry.clear()  # the sender's next put attaches (it retries every ATTACH_RETRY_S)
        big = {"x": torch.arange(64 * 1024, dtype=torch.int32)}  # 256 KiB: over the 64 KiB arena
        assert tx.put("0", "1", f"{arena_name}-big", big)[0]
        small = {"x": torch.arange(16)}
        assert tx.put("0", "1", f"{arena_name}-small", small)[0]
        h = tx.health()
        assert h["fallbacks"] == {"arena_full": 1} and h["arena_puts"] == 1 and h["inner_puts"] == 2
        assert_same(rx.get("0", "1", f"{arena_name}-big")[0], big, "big")
        assert_same(rx.get("0", "1", f"{arena_name}-small")[0], small, "small")
        # cleanup drops an unconsumed message (the adapter cleans keys it will never read)
        assert tx.put("0", "1", f"{arena_name}-dropped", small)[0]
        rx.cleanup(f"{arena_name}-dropped")
        assert rx.get("0", "1", f"{arena_name}-dropped") is None
    finally:
        tx.close()
        if rx is not None:
            rx.close()
    assert not glob.glob(f"/dev/shm/*{arena_name}*")


def sender_main(conn: Any, name: str, n: int, die: bool) -> None:
    """A sender in a process of its own (:func:`_sender`): ``n`` payloads, then SIGKILL (``die``) or its health."""
    tx = _connector(0, name)
    for i, p in enumerate(_payloads(7, n)):
        while True:
            ok, size, meta = tx.put("0", "1", f"{name}-k{i}", p)
            assert ok
            if meta.get("arena") or i > 0:  # the first put waits until it goes through the arena
                break
    if die:
        os.kill(os.getpid(), 9)
    conn.send(json.dumps(tx.health()))
    tx.close()


def _sender(name: str, n: int, die: bool = False) -> subprocess.CompletedProcess:
    """:func:`sender_main` forked from the vllm-omni server of ``tests/forked.py``: its exit status, and its health as
    the last line of stdout (an exception's text, when it raised, is pytest's output)."""
    from tests.forked import Forked

    out, rc = Forked(f"{__name__}.sender_main", name, n, die).finish(600)
    out = out or ""  # nothing: it was killed, or raised (its error is pytest's output)
    return subprocess.CompletedProcess(["sender_main", name, n, die], rc, out, f"exit status {rc}")


@pytest.mark.once
def test_across_processes_and_a_sender_killed_mid_stream(vo, arena_name):
    rx = _connector(1, arena_name)
    try:
        assert rx.get("0", "1", "prime") is None
        done = _sender(arena_name, 4)
        assert done.returncode == 0, done.stderr[-2000:]
        health = json.loads(done.stdout.strip().splitlines()[-1])
        assert health["arena_puts"] >= 3
        want = _payloads(7, 4)
        for i in range(4):
            got = rx.get("0", "1", f"{arena_name}-k{i}")
            assert got is not None, i
            assert_same(got[0], want[i], f"payload {i}")
        # kill -9 after three puts: what it published stays readable, and a new sender attaches
        killed = _sender(arena_name, 3, die=True)
        assert killed.returncode == -9
        want = _payloads(7, 3)
        for i in range(3):
            assert_same(rx.get("0", "1", f"{arena_name}-k{i}")[0], want[i], f"after kill, payload {i}")
        notice_dead_sender(rx._rx[("0", "1")])
        again = _sender(arena_name, 2)
        assert again.returncode == 0, again.stderr[-2000:]
        assert json.loads(again.stdout.strip().splitlines()[-1])["arena_puts"] >= 1
        want = _payloads(7, 2)
        for i in range(2):
            assert_same(rx.get("0", "1", f"{arena_name}-k{i}")[0], want[i], f"new sender, payload {i}")
    finally:
        rx.close()


@pytest.mark.parametrize("policy", [None, "qwen3-omni"])
def test_real_adapters_over_the_arena_hand_over_what_shm_does(vo, arena_name, adapters, policy):
    from tests.test_integration_vllm_omni_lifecycle import drive

    pid = os.getpid()
    steps = _thinker_steps(seed=9, decode_steps=6)
    if policy:
        vo.install(policy)
    base = drive(adapters(0, next_func=T2T), adapters(1), f"oa-ar-base-{pid}", steps)
    extra = {"arena_name": arena_name}
    tx = adapters(0, next_func=T2T, connector=NAME, extra=extra)
    rx = adapters(1, connector=NAME, extra=extra)
    assert type(tx.connector).__name__ == "ArenaConnector"
    assert rx.connector.get("0", "1", "prime") is None
    handed = drive(tx, rx, f"oa-ar-{pid}", steps)
    assert_same(handed, base, "handed")
    assert tx.connector.health()["arena_puts"] == len(handed) and tx.connector.health()["inner_puts"] == 0
    assert rx.connector.health()["arena_gets"] == len(handed)


def receiver_dies_main(conn: Any, name: str) -> None:
    """A receiver (forked: ``tests/forked.py``) that creates its region, tells the test the regions and its reaper's
    pid, and ends by SIGKILL without closing the connector (vllm-omni's stages end so on SIGTERM)."""
    rx = _connector(1, name)
    assert rx.get("0", "1", "nothing") is None  # creates the region
    from omni_accum import samehost

    conn.send((rx.health()["regions"], samehost._reaper[0].pid))
    os.kill(os.getpid(), 9)


@pytest.mark.once
def test_a_receiver_killed_without_closing_leaves_no_region(vo, arena_name):
    from tests.forked import Forked

    said, rc = Forked(f"{__name__}.receiver_dies_main", arena_name).finish(600)  # said None: no word (error above)
    assert rc == -9 and said is not None, f"the receiver ended with {rc}, not SIGKILL, having said {said}"
    regions, reaper = said
    assert f"{arena_name}_0_1" in str(regions)  # it did create one
    # omni-accum's reaper process removes it (and the pair's pointer file) once the process is gone, then exits
    wait_exited(reaper)
    assert not glob.glob(f"{private_dir()}/*{arena_name}*")


def staged_rows_main(conn: Any, name: str) -> None:
    """A sender whose prompt rows the stage input processor built in the arena (``arena_stage_rows``), its receiver
    closed: the next put falls back to SharedMemoryConnector, reading those rows. In a process of its own: it
    segfaulted there (the sender dropped with the receiver unmapped the pages under the staged tensor)."""
    from tests.waiting import poll

    key = f"req{os.getpid()}_0_0"  # (the inner way's file is /dev/shm/<key>)
    tx, rx = _connector(0, name), _connector(1, name)
    assert rx.get("0", "1", "prime") is None  # the receiver's region
    for n in range(200):  # until the sender attaches (each put taken: one the inner way leaves a file until then)
        meta = tx.put("0", "1", f"{key}w{n}", {"x": torch.zeros(4)})[2] or {}
        assert poll(lambda: rx.get("0", "1", f"{key}w{n}"), 30) is not None  # noqa: B023 - called at once
        if meta.get("arena"):
            break
    attached = bool(meta.get("arena"))
    staged = tx.stage_rows("0", "1", "reqA", "embed.prefill", torch.bfloat16, (64,), 11)
    rows = torch.randn(11, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    staged.copy_(rows)
    rx.close()
    time.sleep(2 * LIVENESS_EVERY_S)  # the put's liveness look then finds the receiver gone and drops the sender
    ok, _, meta = tx.put("0", "1", key, {"embed": {"prefill": staged}})
    died = tx.fallbacks.get("receiver_died")
    rx2 = _connector(1, name)
    got = poll(lambda: rx2.get("0", "1", key), 30)  # the inner way: the get unlinks its file
    same = got is not None and torch.equal(got[0]["embed"]["prefill"], rows)
    arena = bool(meta and meta.get("arena"))
    conn.send({"attached": attached, "died": died, "ok": ok, "arena": arena, "staged": torch.equal(staged, rows),
               "got": same})
    tx.close()
    rx2.close()


def test_prompt_rows_staged_in_the_arena_outlive_a_receiver_that_goes(vo, arena_name):
    from tests.forked import Forked

    out, rc = Forked(f"{__name__}.staged_rows_main", arena_name).finish(600)
    assert rc == 0 and out is not None, f"the sender's process ended with {rc} (-11: a segfault), answer {out}"
    assert out == {"attached": True, "died": 1, "ok": True, "arena": False, "staged": True, "got": True}, out


def test_a_put_that_falls_back_is_counted_in_the_metrics(vo, arena_name, monkeypatch):
    """``omni_accum_fallbacks_total{reason="arena_full"}``: a put the arena could not take (it went
    through the inner connector) is counted where an operator looks, not only in ``health()``."""
    from prometheus_client import REGISTRY

    monkeypatch.delenv("OMNI_ACCUM_METRICS", raising=False)

    def count() -> float:
        return REGISTRY.get_sample_value("omni_accum_fallbacks_total", {"reason": "arena_full"}) or 0.0

    tx, rx = _connector(0, arena_name), _connector(1, arena_name, arena_bytes="64KiB")
    try:
        assert rx.get("0", "1", "prime") is None
        before = count()
        big = {"x": torch.arange(64 * 1024, dtype=torch.int32)}  # 256 KiB: over the 64 KiB arena
        assert tx.put("0", "1", f"{arena_name}-big", big)[0]
        assert tx.health()["fallbacks"] == {"arena_full": 1}
        assert count() - before == 1
        assert_same(rx.get("0", "1", f"{arena_name}-big")[0], big, "big")
    finally:
        tx.close()
        rx.close()
    assert not glob.glob(f"/dev/shm/*{arena_name}*")


# ------------------------------------------------------------------------------ faults (issue 33, item 4)
# Both ends of a pair as separate processes driven line by line (_PEER): one is killed with SIGKILL in the
# middle of a stream, twice; the survivor keeps serving new peers bit-exactly, holds no more
# regions, file descriptors or pages after each kill than after the first, and once every process has ended
# omni-accum's reaper has left nothing in the private directory or /dev/shm.
def peer_main(conn: Any, role: int, name: str, extra: str) -> None:
    """A connector peer (:class:`_Peer`): one command per message on ``conn``, one answer each."""
    from tests.waiting import poll
    from omni_accum import samehost

    c = _connector(role, name, **json.loads(extra))
    want = _payloads(11, 8) + [{"x": torch.arange(64 * 1024, dtype=torch.int32) + k} for k in (8, 9)]  # 8, 9: 256 KiB
    conn.send({"pid": os.getpid()})
    while True:
        try:
            line = conn.recv()
        except EOFError:  # the test process is gone
            return
        op, *a = line.split()
        try:
            if op == "put":
                ok, size, meta = c.put("0", "1", a[0], want[int(a[1])])
                out = {"ok": ok, "arena": bool(meta and meta.get("arena"))}
            elif op == "get":
                before = c.counts["arena_gets"]
                got = poll(lambda: c.get("0", "1", a[0]), 60, 0.005)
                assert got is not None, f"{a[0]} never arrived"
                assert_same(got[0], want[int(a[1])], a[0])
                out = {"ok": True, "arena": c.counts["arena_gets"] > before}
            elif op == "prime":  # the receiver creates its region
                assert c.get("0", "1", "prime") is None
                out = {"regions": c.health()["regions"], "reaper": samehost._reaper[0].pid if samehost._reaper[0] else 0}
            elif op == "reclaim":
                for tx in c._tx.values():
                    tx.reclaim()
                out = {}
            elif op == "mem":
                out = _held(c)
            elif op == "health":
                out = c.health()
            elif op == "quit":
                c.close()
                out = {"reaper": samehost._reaper[0].pid if samehost._reaper[0] else 0}
            else:
                out = {"error": f"unknown op {op}"}
        except Exception as e:  # noqa: BLE001 - reported to the test, the process goes on
            import traceback

            out = {"error": repr(e) + " | " + traceback.format_exc()[-2500:]}
        conn.send(out)
        if op == "quit":
            return


def _held(c: Any) -> dict[str, int]:
    """What a connector's process holds of omni-accum's same-host files (counts, not bytes): the regions it
    maps and the descriptors it has open in the private directory, the data pages marked in use in the page
    map of the regions it receives on, the messages waiting there, the pairs it sends on."""
    d = str(private_dir()) + "/"
    maps = {ln.split()[4] for ln in open("/proc/self/maps") if d in ln}  # distinct inodes
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith(d)
        except OSError:
            pass
    rxs = [rx for rx in c._rx.values() if rx is not None]
    with c._rx_lock:  # waiting: published and not taken, the ring read first (pending_keys alone depended on
        # whether the connector's liveness check had read the ring since the puts: the test failed at random)
        waiting = sum(len(rx.waiting_keys()) for rx in rxs)
    return {
        "maps": len(maps),
        "fds": fds,
        "held_pages": sum(len(rx.region.pages) - bytes(rx.region.pages).count(0) for rx in rxs),
        "waiting": waiting,
        "senders": len(c._tx),
    }


class _Peer:
    """A connector in a process of its own (:func:`peer_main`), forked from a server that imported vllm-omni once
    (``tests/forked.py``: a fresh interpreter takes ~25 s to import it here); killed by pid at the end."""

    def __init__(self, role: int, name: str, env: dict[str, str] | None = None, **extra: Any) -> None:
        from tests.forked import Forked

        self.proc = Forked(f"{__name__}.peer_main", role, name, json.dumps(extra), env=env)
        self.pid = self._read()["pid"]

    def _read(self) -> dict[str, Any]:
        try:
            if self.proc.conn.poll(600):
                return self.proc.conn.recv()
        except EOFError:
            pass
        raise AssertionError(f"peer {self.proc.pid} gave no answer (rc {self.proc.poll()}); its output is pytest's")

    def __call__(self, *words: Any) -> dict[str, Any]:
        self.proc.conn.send(" ".join(map(str, words)))
        out = self._read()
        assert "error" not in out, f"{words}: {out['error']}"
        return out

    def kill9(self) -> None:
        self.proc.kill()  # SIGKILL
        assert self.proc.wait() == -9

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.conn.close()


def _until_arena(tx: _Peer, rx: _Peer, tag: str, first: int = 0) -> int:
    """Put and get payloads until one goes through the arena (the sender attaches within ~50 ms of the
    receiver's region, or of finding its old receiver dead); each is taken bit-exactly; the puts made."""
    for n in range(200):
        put = tx("put", f"{tag}-w{n}", (first + n) % 8)
        assert put["ok"]
        got = rx("get", f"{tag}-w{n}", (first + n) % 8)
        if put["arena"]:
            assert got["arena"]
            return n + 1
    raise AssertionError(f"{tag}: no put went through the arena")


def _nothing_left(name: str, base: str = "/dev/shm") -> None:
    left = glob.glob(f"{private_dir()}/*{name}*") + glob.glob(f"{base}/*{name}*")
    assert not left, f"left behind: {left}"


@pytest.mark.once
def test_receivers_killed_mid_stream_the_sender_serves_the_next_and_holds_nothing_more(vo, arena_name):
    tx = _Peer(0, arena_name)
    rx = None
    seen: list[dict[str, int]] = []
    try:
        for cycle in range(3):
            rx = _Peer(1, arena_name)
            reaper = rx("prime")["reaper"]
            _until_arena(tx, rx, f"{arena_name}-c{cycle}", first=cycle)
            for i in range(3):  # mid-stream: three published, one taken
                assert tx("put", f"{arena_name}-c{cycle}-m{i}", i + 3)["arena"]
            assert rx("get", f"{arena_name}-c{cycle}-m0", 3)["arena"]
            seen.append(tx("mem"))
            if cycle == 2:
                break
            rx.kill9()
            wait_exited(reaper)  # its reaper removed its region and the pointer file, then ended
            _nothing_left(arena_name)
        # one region mapped (two descriptors: the region's and the mapping's own) after every kill: the dead
        # receivers' regions are let go
        assert seen == [{"maps": 1, "fds": 2, "held_pages": 0, "waiting": 0, "senders": 1}] * 3, seen
        health = tx("health")
        assert health["fallbacks"] == {"receiver_died": 2}, health  # the first put after each kill
        rx_reaper = rx("quit")["reaper"]
        tx("quit")
        for p in (rx, tx):
            assert p.proc.wait(timeout=120) == 0
        wait_exited(rx_reaper)
    finally:
        for p in (tx, rx):
            if p is not None:
                p.stop()
    _nothing_left(arena_name)


@pytest.mark.once
def test_senders_killed_mid_stream_the_receiver_serves_the_next_and_holds_nothing_more(vo, arena_name):
    rx = _Peer(1, arena_name)
    tx = None
    seen: list[dict[str, int]] = []
    try:
        rx_reaper = rx("prime")["reaper"]
        for cycle in range(3):
            tx = _Peer(0, arena_name)
            _until_arena(tx, rx, f"{arena_name}-c{cycle}", first=cycle)
            for i in range(3):  # mid-stream: three published, one taken before the kill
                assert tx("put", f"{arena_name}-c{cycle}-m{i}", i + 3)["arena"]
            assert rx("get", f"{arena_name}-c{cycle}-m0", 3)["arena"]
            tx("reclaim")  # the pages given back so far are the sender's again
            seen.append(rx("mem"))
            if cycle == 2:
                break
            tx.kill9()
            for i in (1, 2):  # what the dead sender published stays readable, bit-exact
                assert rx("get", f"{arena_name}-c{cycle}-m{i}", i + 3)["arena"]
        # after every kill the receiver maps one region, holds no page of the dead senders, waits for nothing
        first = {"maps": 1, "fds": 2, "held_pages": seen[0]["held_pages"], "waiting": 2, "senders": 0}
        assert seen == [first] * 3, seen
        assert first["held_pages"] <= 2 * 8  # the two untaken messages' pages (at most 8 tensors each)
        assert rx("mem") == first
        tx("quit")
        assert rx("get", f"{arena_name}-c2-m1", 4)["arena"] and rx("get", f"{arena_name}-c2-m2", 5)["arena"]
        held = rx("mem")
        assert held["held_pages"] == 0 and held["waiting"] == 0, held  # no sender: the receiver frees them
        rx("quit")
        for p in (rx, tx):
            assert p.proc.wait(timeout=120) == 0
        wait_exited(rx_reaper)
    finally:
        for p in (rx, tx):
            if p is not None:
                p.stop()
    _nothing_left(arena_name)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs as the private directory's base (``OMNI_ACCUM_ARENA_DIR``): a /dev/shm that fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the full-/dev/shm case)")
    d = tmp_path / "shm"
    d.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=1777", "tmpfs", str(d)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield d
    finally:
        if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(d)], check=True)


def _fill(d: Any) -> Any:
    """Fill file system ``d`` to the last block; the filler's path."""
    f = d / "filler"
    fd = os.open(f, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\xa5" * 4096)
    except OSError as e:
        assert e.errno == 28, e  # ENOSPC
    finally:
        os.close(fd)
    return f


def test_a_full_dev_shm_gives_counted_fallbacks_and_bit_exact_payloads_never_a_crash(vo, arena_name, small_tmpfs):
    env = {"OMNI_ACCUM_ARENA_DIR": str(small_tmpfs)}
    extra = {"arena_bytes": "1MiB", "ring_bytes": "64KiB"}
    rx = _Peer(1, arena_name, env, **extra)
    tx = _Peer(0, arena_name, env, **extra)
    try:
        filler = _fill(small_tmpfs)
        # full before the receiver creates its region: it receives through the inner connector, counted
        rx("prime")
        assert rx("health")["fallbacks"] == {"no_space": 1}
        for i in range(3):
            assert not tx("put", f"{arena_name}-a{i}", i)["arena"]
            assert not rx("get", f"{arena_name}-a{i}", i)["arena"]  # bit-exact, through the inner connector
        filler.unlink()
        time.sleep(5.5)  # the receiver tries to create its region again 5 s after it found no room
        _until_arena(tx, rx, f"{arena_name}-b")
        # full once the region exists: its header, page map and rings were reserved at creation, the
        # slabs' pages are not; each put that finds no room falls back (counted), nothing is lost
        filler = _fill(small_tmpfs)
        for i in range(3):  # payload 8: 256 KiB, pages the arena has not used yet
            assert not tx("put", f"{arena_name}-c{i}", 8)["arena"]
            assert not rx("get", f"{arena_name}-c{i}", 8)["arena"]  # bit-exact, through the inner connector
        assert tx("put", f"{arena_name}-c3", 0)["arena"]  # small: pages used before (kept) are room enough
        assert rx("get", f"{arena_name}-c3", 0)["arena"]
        assert tx("health")["fallbacks"] == {"arena_full": 3}
        for p in (tx, rx):
            assert p.proc.poll() is None  # no SIGBUS
        filler.unlink()
        assert tx("put", f"{arena_name}-d", 9)["arena"] and rx("get", f"{arena_name}-d", 9)["arena"]  # room again
        rx_reaper = rx("quit")["reaper"]
        tx("quit")
        for p in (rx, tx):
            assert p.proc.wait(timeout=120) == 0
        wait_exited(rx_reaper)
        assert os.listdir(small_tmpfs) == []  # the region, its pointer and the private directory are gone
    finally:
        for p in (rx, tx):
            p.stop()
    _nothing_left(arena_name)


def test_a_warm_that_finds_no_room_stops_there_and_the_region_still_serves(small_tmpfs, monkeypatch):
    """``arena_warm`` larger than what ``/dev/shm`` has left: the warm stops at the first step with no room
    (said in ``warmed``), raises nothing, and the region is left as usable as an unwarmed one."""
    from omni_accum.arena import ArenaReceiver, ArenaSender

    monkeypatch.setenv("OMNI_ACCUM_ARENA_DIR", str(small_tmpfs))
    name = f"warmfull{os.getpid()}"
    rx = ArenaReceiver(name, 4 << 20, ring_bytes=64 << 10)
    try:
        rx.region.warm(4 << 20, background=False, step_bytes=256 << 10)
        w = rx.region.warmed
        assert w["stopped"] is not None and w["stopped"].startswith("no room"), w
        assert 0 < w["bytes"] < 4 << 20, w  # what fitted was warmed
        tx = ArenaSender(name, {"emb": "append"}, timeout_s=30)
        try:
            page, n = tx._alloc(4096)  # a slab in the warmed pages: served
            assert page == 0 and n == 1
        finally:
            tx.close()
    finally:
        rx.close()
