"""``OmniAccumArenaConnector``: registered with vllm-omni's real connector factory, driven by real chunk
transfer adapters and across processes, bit-exact, falling back to the inner SharedMemoryConnector
whenever the arena cannot take a put (nothing lost), and leaving nothing in /dev/shm."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

from omni_accum.arena.region import W_SENDER_PID, PeerDied
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
    ],
)
def test_bad_settings_are_named(vo, extra, word):
    with pytest.raises(ValueError, match=word):
        _connector(1, "bad", **extra)


def test_one_process_round_trip_is_bit_exact_and_uses_the_arena(vo, arena_name):
    rx, tx = _connector(1, arena_name), _connector(0, arena_name)
    try:
        assert rx.get("0", "1", "nothing yet") is None  # the receiver creates the pair's region
        sent = _payloads(1, 5)
        for i, p in enumerate(sent):
            ok, size, meta = tx.put("0", "1", f"k{i}", p)
            assert ok and size > 0 and meta["arena"] == f"{arena_name}_0_1"
        for i in reversed(range(5)):  # any order: a keyed mailbox
            got, size = rx.get("0", "1", f"k{i}")
            assert_same(got, sent[i], f"payload {i}")
            assert got["embed"]["strided"].is_contiguous()
        assert tx.health()["arena_puts"] == 5 and tx.health()["inner_puts"] == 0
        assert rx.health()["arena_gets"] == 5
        assert rx.get("0", "1", "k0") is None  # taken once
    finally:
        tx.close()
        rx.close()


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


_SENDER = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, sys.argv[4])
    from tests.test_integration_vllm_omni_arena_connector import _connector, _payloads
    name, n, die = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "die"
    tx = _connector(0, name)
    for i, p in enumerate(_payloads(7, n)):
        while True:
            ok, size, meta = tx.put("0", "1", f"{name}-k{i}", p)
            assert ok
            if meta.get("arena") or i > 0:  # the first put waits until it goes through the arena
                break
    if die:
        os.kill(os.getpid(), 9)
    print(json.dumps(tx.health()))
    tx.close()
    """
)


def _sender(name: str, n: int, die: bool = False) -> subprocess.CompletedProcess:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(
        [sys.executable, "-c", _SENDER, name, str(n), "die" if die else "live", root],
        capture_output=True,
        text=True,
        timeout=600,
    )


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


_RECEIVER_DIES = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[2])
    from tests.test_integration_vllm_omni_arena_connector import _connector
    rx = _connector(1, sys.argv[1])
    assert rx.get("0", "1", "nothing") is None  # creates the region
    from omni_accum import samehost
    print(rx.health()["regions"], samehost._reaper[0].pid, flush=True)
    os.kill(os.getpid(), 9)  # ends without closing the connector (vllm-omni's stages end so on SIGTERM)
    """
)


def test_a_receiver_killed_without_closing_leaves_no_region(vo, arena_name):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", _RECEIVER_DIES, arena_name, root], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == -9, done.stderr[-2000:]
    assert f"{arena_name}_0_1" in done.stdout  # it did create one
    # omni-accum's reaper process removes it (and the pair's pointer file) once the process is gone, then exits
    wait_exited(int(done.stdout.split()[-1]))
    assert not glob.glob(f"{private_dir()}/*{arena_name}*")


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
