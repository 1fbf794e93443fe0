"""The Mooncake settings an audit found taken silently or blamed on the wrong thing, and the objects left behind.

* another name for a key of vllm-omni 0.30.0's ``MooncakeStoreConnector`` (Mooncake's own ``master_server_address``,
  ``local_hostname``, ...; ``hostname``, ``transport``, ...) was ignored and the stage used the loopback default;
* a ``segment`` from 1 byte to under 16 MiB fails Mooncake's setup (rc -600): doctor said ready, the connector blamed
  the master, the bench started its services and then said "exit None, said 'setup failed: -600\\n'";
* ``host:``/``proto:``/``rdma:`` left empty (None) make Mooncake's setup raise ``TypeError``;
* finished background reads no get took stayed soft-pinned in the store at ``close()`` and when dropped for a request
  that was gone;
* the bench's ``MB`` was 2^20 bytes, the connector's 10^6.

No Mooncake is needed but in the tests that take the ``mooncake`` fixture (a real master and holder on free 127.0.0.1
ports, stopped by their pids)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from mooncake_fixtures import *  # noqa: F403 - the fixtures (mooncake, stage_host)

pytest.importorskip("vllm_omni")

NAME = "OmniAccumMooncakeConnector"
ROOT = Path(__file__).resolve().parents[1]
GOOD = {"host": "10.0.0.2", "master": "10.0.0.1:50151", "metadata_server": "http://10.0.0.1:8080/metadata",
        "proto": "tcp", "segment": 536870912, "localbuf": 268435456}  # fmt: skip
#: (another name, the key vllm-omni reads, whether it is Mooncake's own name)
ALIASES = [
    ("master_server_address", "master", True), ("master_address", "master", False), ("master_addr", "master", False),
    ("master_server", "master", False), ("metadata", "metadata_server", False),
    ("metadata_url", "metadata_server", False), ("local_hostname", "host", True), ("hostname", "host", False),
    ("host_ip", "host", False), ("transport", "proto", False), ("global_segment_size", "segment", True),
    ("segment_size", "segment", False), ("local_buffer_size", "localbuf", True), ("device_name", "rdma", True),
    ("rdma_devices", "rdma", False),
]  # fmt: skip


def _stub(monkeypatch, built: list | None = None):
    """The connector module with vllm-omni's connector replaced: ``built`` records what reached Mooncake's setup
    (None: reaching it fails the test, as a real setup would hang or fail)."""
    from omni_accum.integrations.vllm_omni import mooncake_connector as mc

    class Inner:
        def __init__(self, config):
            if built is None:
                pytest.fail(f"Mooncake's setup reached with {config!r}")
            built.append(config)

        def close(self):
            pass

    monkeypatch.setattr(mc, "_prepare", lambda: None)
    monkeypatch.setattr(mc, "_inner_class", lambda: Inner)
    return mc


def _refused(monkeypatch, extra: dict) -> str:
    mc = _stub(monkeypatch)
    with pytest.raises(ValueError) as e:
        mc.MooncakeFastConnector({**extra, "stage_id": 1})
    return str(e.value)


def _deploy(tmp_path: Path, name: str, extra: dict) -> str:
    import yaml

    doc = {"connectors": {"connector_of_mooncake": {"name": name, "extra": extra}},
           "stages": [{"stage_id": 1, "input_connectors": {"from_stage_0": "connector_of_mooncake"}}]}  # fmt: skip
    f = tmp_path / "deploy.yaml"
    f.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(f)


def _doctor(monkeypatch, tmp_path: Path, name: str, extra: dict) -> tuple[list[str], list[str]]:
    """(problems, notes) of ``doctor --deploy``'s Mooncake checks of one connector."""
    from omni_accum.cli.doctor_mooncake import check_mooncake

    monkeypatch.setenv("OMNI_ACCUM_DEPLOYMENT", "audit-test")
    checks = check_mooncake(_deploy(tmp_path, name, extra))
    return [c.detail for c in checks if not c.ok], [c.detail for c in checks if c.warning]


# ---------------------------------------------------------------------------------------------- #
# 1. Another name for a key vllm-omni reads
# ---------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("alias, right, mooncakes", ALIASES)
def test_another_name_for_a_store_key_is_refused_naming_the_key_vllm_omni_reads(monkeypatch, alias, right,
                                                                                 mooncakes):  # fmt: skip
    extra = {k: v for k, v in GOOD.items() if k != right}
    said = _refused(monkeypatch, {**extra, alias: "mlx5_0" if right == "rdma" else GOOD.get(right, "x")})
    whose = f"{alias!r} is Mooncake's name; vllm-omni reads {right!r}" if mooncakes else (
        f"vllm-omni's MooncakeStoreConnector reads no {alias!r}; it reads {right!r}")
    assert said.startswith(f"{NAME}: extra.{alias}: {whose}; without {right} it uses "), said
    assert f"rename it to {right}" in said, said


@pytest.mark.parametrize("name", ["MooncakeStoreConnector", NAME])
@pytest.mark.parametrize("alias, right, mooncakes", ALIASES)
def test_doctor_calls_another_name_for_a_store_key_a_problem_for_both_connectors(monkeypatch, tmp_path, name, alias,
                                                                                 right, mooncakes):  # fmt: skip
    extra = {**{k: v for k, v in GOOD.items() if k != right}, alias: "mlx5_0" if right == "rdma" else GOOD[right]}
    problems, _ = _doctor(monkeypatch, tmp_path, name, extra)
    assert len(problems) == 1 and f"extra.{alias}: " in problems[0] and f"reads {right!r}" in problems[0], problems


def test_another_name_beside_the_key_it_stands_for_is_a_note_and_builds(monkeypatch, tmp_path):
    """vllm-omni reads the key; the other name is only ignored."""
    extra = {**GOOD, "master_server_address": "10.0.0.9:50151"}
    built: list = []
    _stub(monkeypatch, built).MooncakeFastConnector({**extra, "stage_id": 1}).close()
    assert built and "master_server_address" in built[0]  # handed on unchanged, as every other key
    problems, notes = _doctor(monkeypatch, tmp_path, NAME, extra)
    assert problems == [] and [n for n in notes if "master_server_address: 'master_server_address' is Mooncake's "
                                                  "name; vllm-omni reads 'master' (given: '10.0.0.1:50151')" in n]


def test_no_metadata_server_while_the_master_is_elsewhere_is_noted(monkeypatch, tmp_path):
    """vllm-omni then asks http://127.0.0.1:8080/metadata, where no metadata server runs across hosts (as ``host``)."""
    extra = {k: v for k, v in GOOD.items() if k != "metadata_server"}
    for name in ("MooncakeStoreConnector", NAME):
        problems, notes = _doctor(monkeypatch, tmp_path, name, extra)
        assert problems == [] and [n for n in notes if "no metadata_server, so this stage asks "
                                                       "'http://127.0.0.1:8080/metadata' while the master is at "
                                                       "'10.0.0.1:50151'" in n], notes
    local = {**extra, "host": "127.0.0.1", "master": "127.0.0.1:50151"}
    assert not [n for n in _doctor(monkeypatch, tmp_path, NAME, local)[1] if "metadata_server" in n]
    assert not [n for n in _doctor(monkeypatch, tmp_path, NAME, GOOD)[1] if "metadata_server" in n]


# ---------------------------------------------------------------------------------------------- #
# 2. A segment Mooncake's setup refuses (rc -600)
# ---------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("segment", [1, 8 << 20, (16 << 20) - 1])
def test_a_segment_under_16_mib_is_refused_naming_the_key_the_value_and_the_rule(monkeypatch, tmp_path, segment):
    said = _refused(monkeypatch, {**GOOD, "segment": segment})
    assert said.startswith(f"{NAME}: extra.segment = {segment} bytes is under Mooncake's smallest segment: its setup "
                           "fails with rc -600"), said
    assert "give segment 0 (this stage contributes no memory) or at least 16777216 (16 MiB)" in said
    assert "master" not in said, said  # not blamed on the master
    for name in ("MooncakeStoreConnector", NAME):
        problems, _ = _doctor(monkeypatch, tmp_path, name, {**GOOD, "segment": segment})
        assert len(problems) == 1 and f"extra.segment = {segment} bytes is under" in problems[0], problems


@pytest.mark.parametrize("segment", [0, 16 << 20])
def test_a_segment_of_0_or_16_mib_reaches_mooncake_s_setup(monkeypatch, segment):
    built: list = []
    _stub(monkeypatch, built).MooncakeFastConnector({**GOOD, "segment": segment, "stage_id": 1}).close()
    assert built[0]["segment"] == segment


def test_the_bench_refuses_a_segment_under_16_mib_before_it_starts_anything():
    """It started a master and a holder, and 82 s later said "exit None, said 'setup failed: -600\\n'"."""
    from omni_accum.bench.mooncake import _cli_problem

    args = SimpleNamespace(view_hop=None, through="direct", plot=None, mooncake_metadata=None,
                           mooncake_occupancy=None, mooncake_master=None, mooncake_segment="8MiB")  # fmt: skip
    said = _cli_problem(args)
    assert said.startswith("--mooncake-segment '8MiB' is 8388608 bytes, under Mooncake's smallest segment"), said
    assert "give at least 16MiB (16777216 bytes)" in said


def test_the_holder_that_does_not_start_says_why_in_one_clean_line(tmp_path):
    """A holder that said why and exited: its words and exit status (not "exit None", not a raw "\\n")."""
    from omni_accum.bench.mooncake_services import MooncakeServices, MooncakeUnavailable

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho \"Mooncake's setup of a 8388608-byte segment failed with rc -600\"\n"
                    "sleep 0.5\nexit 1\n")  # fmt: skip
    fake.chmod(0o755)
    svc = MooncakeServices(segment_bytes=8 << 20, master="127.0.0.1:1", metadata="http://127.0.0.1:1/metadata",
                           python=str(fake))  # fmt: skip
    with pytest.raises(MooncakeUnavailable) as e:
        svc.start(timeout=60)
    said = str(e.value)
    assert "(it said: Mooncake's setup of a 8388608-byte segment failed with rc -600, exit status 1)" in said, said
    assert "exit None" not in said and "\\n" not in said and "\n" not in said, said


def test_a_real_holder_with_a_segment_under_16_mib_says_mooncake_s_rc(tmp_path):
    """The bench's own services (a master on free 127.0.0.1 ports and the holder), stopped by their pids."""
    from mooncake_fixtures import require_mooncake

    from omni_accum.bench.mooncake_services import MooncakeServices, MooncakeUnavailable, _alive

    require_mooncake()
    svc = MooncakeServices(segment_bytes=8 << 20, log_dir=str(tmp_path))
    try:
        with pytest.raises(MooncakeUnavailable) as e:
            svc.start(timeout=120)
    finally:
        svc.stop()
    said = str(e.value)
    assert said == ("the Mooncake holder process did not start (it said: Mooncake's setup of a 8388608-byte segment "
                    "failed with rc -600, exit status 1)"), said
    assert not [p for p in svc.pids if _alive(p)]


# ---------------------------------------------------------------------------------------------- #
# 3. host / proto / rdma left empty (None): Mooncake's setup raises TypeError
# ---------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("key, value, said", [
    ("host", None, "extra.host = None is not an address: vllm-omni passes it to Mooncake's setup, which refuses it"),
    ("proto", None, "extra.proto = None is not text: vllm-omni passes it to Mooncake's setup, which refuses it"),
    ("proto", 5, "extra.proto = 5 is not text"),
    ("rdma", None, "extra.rdma = None is not text (the RDMA device names): vllm-omni passes it to Mooncake's setup"),
    ("rdma", ["mlx5_0"], "extra.rdma = ['mlx5_0'] is not text"),
])  # fmt: skip
def test_a_store_key_left_empty_is_refused_and_a_doctor_problem(monkeypatch, tmp_path, key, value, said):
    extra = {**GOOD, key: value}
    got = _refused(monkeypatch, extra)
    assert got.startswith(f"{NAME}: {said}"), got
    for name in ("MooncakeStoreConnector", NAME):
        problems, notes = _doctor(monkeypatch, tmp_path, name, extra)
        assert len(problems) == 1 and said in problems[0], problems
        assert not [n for n in notes if "no host" in n], notes  # written, though empty: not "no host"


# ---------------------------------------------------------------------------------------------- #
# 4. A staging buffer larger than the segment: what Mooncake does
# ---------------------------------------------------------------------------------------------- #


def test_the_warning_of_a_buffer_larger_than_the_segment_says_where_the_parts_go():
    """It said the parts were refused and went serialized; Mooncake puts them into another segment with room."""
    from omni_accum.integrations.vllm_omni.mooncake_settings import notes, parse_settings

    extra = {**GOOD, "segment": 16 << 20, "mooncake_buffer_bytes": "32MiB"}
    (said,) = notes(extra, parse_settings(extra))
    assert "refused and go serialized" not in said
    assert "so Mooncake puts it into another stage's (or holder's) segment that has room" in said
    assert "only when no segment has room is the part refused (mooncake_put_error)" in said
    docs = (ROOT / "docs" / "mooncake.md").read_text()
    assert "is put by Mooncake into another process's segment that has room" in docs
    assert "a part larger than the segment it is\nput in is refused by the store" not in docs


def oversized_parts_job(*, pipes, extra: dict) -> dict:
    """A 16 MiB stage segment, 32 MiB parts: put, read back, from the holder's segment."""
    import torch
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec

    from omni_accum.integrations.vllm_omni import mooncake_compat

    mooncake_compat.activate()  # what the omni_accum_mooncake entry point does in a vllm-omni process
    extra = {**extra, "segment": 16 << 20, "mooncake_buffer_bytes": "32MiB", "stage_id": 1}
    conn = OmniConnectorFactory.create_connector(ConnectorSpec(name=NAME, extra=extra))
    conn.append_test = lambda path, value: path == "hidden"
    g = torch.Generator().manual_seed(4)
    data = {"hidden": torch.randn(8193, 2048, generator=g).to(torch.bfloat16), "ids": [1, 2]}
    try:
        ok, _, meta = conn.put("0", "1", "audit-big_0_0", data)
        got = conn.get("0", "1", "audit-big_0_0")
        return {"ok": ok, "parts": len((meta or {}).get("mooncake_parts", [])), "fallbacks": dict(conn.fallbacks),
                "same": got is not None and torch.equal(got[0]["hidden"], data["hidden"]),
                "local": conn.local_segment}  # fmt: skip
    finally:
        conn.close()


def test_parts_larger_than_the_stage_s_segment_go_to_another_segment(stage_host, mooncake):
    """What the warning and the docs now say (the holder's 256 MiB segment has room; this stage's 16 MiB has not)."""
    from omni_accum.bench.mooncake import Job

    (out,) = stage_host.run([Job("test_mooncake_audit:oversized_parts_job", {"extra": mooncake.connector_extra()})],
                            timeout=300)  # fmt: skip
    assert out["local"] and out["ok"] and out["parts"] == 2 and out["fallbacks"] == {} and out["same"], out


# ---------------------------------------------------------------------------------------------- #
# 5. Finished background reads no get took: removed at close, and when their request is gone
# ---------------------------------------------------------------------------------------------- #


class _Adapter:
    """Stands in for vllm-omni 0.30.0's receiving chunk adapter: what the connector reads of it."""

    def __init__(self, mapping: dict[str, str]) -> None:
        self.request_ids_mapping = mapping  # internal request id -> external (the chunk keys' prefix)
        self._receiver_state_lock = threading.Lock()

    def record_receive_failure(self, request_id: str, reason: str) -> None:
        pass


def untaken_reads_job(*, pipes, extra: dict, tag: str) -> dict:
    from omni_accum.integrations.vllm_omni import mooncake_reads as mr
    from test_mooncake_fast import APPENDS, _connector, _log_lines, _payload

    def read_started(conn, get_key: str) -> list[str]:
        ok, _, meta = conn.put("0", "1", get_key, _payload(7, 640))
        key = conn._make_key(get_key, "0", "1")
        assert ok and conn.get("0", "1", get_key) is None  # the read started on the reader thread
        conn.reads._reads[key][0].result(timeout=60)  # and finished; no get takes it
        return [key, *meta["mooncake_parts"]]

    def left(conn, keys: list[str]) -> list[str]:
        return [k for k, e in zip(keys, conn.store.batch_is_exist(keys)) if e != 0]

    lines = _log_lines()
    out: dict = {}
    conn = _connector(1, {**extra, "mooncake_read_threads": 1})
    conn.append_test = lambda path, value: path in APPENDS
    adapter = _Adapter({"int-live": f"{tag}live"})  # {tag}gone was aborted: the adapter let go of it
    conn.attach_receiver(adapter)
    try:
        gone = read_started(conn, f"{tag}gone_0_0")
        live = read_started(conn, f"{tag}live_0_0")
        with conn.reads._lock:  # vllm-omni's receive loop did not take them within RESULT_TTL_S
            dropped = conn.reads._expire(time.monotonic() + mr.RESULT_TTL_S + 1)
        conn.reads._let_go_of(dropped)  # outside the lock, as a take does
        out["dropped"] = conn.reads.dropped
        out["gone_left"] = left(conn, gone)
        out["live_left"] = len(left(conn, live))  # a request still waiting: kept for its next get
        conn.store.batch_remove(live, True)
        closing = read_started(conn, f"{tag}closing_0_0")
    finally:
        conn.close()
    check = _connector(1, extra)  # the closed connector's store is gone: ask through another
    try:
        out["closing_left"] = left(check, closing)
        out["closing_parts"] = len(closing)
    finally:
        check.close()
    out["said"] = [m for _, m in lines if "dropped the finished read" in m or "closing: removed" in m]
    return out


def test_finished_reads_no_get_took_are_removed_at_close_and_when_their_request_is_gone(stage_host, mooncake):
    """They stayed soft-pinned in the store (7 of 7 objects after close; the dropped read's too) for 30 minutes."""
    from omni_accum.bench.mooncake import Job

    tag = f"untaken{os.getpid()}-"
    (out,) = stage_host.run([Job("test_mooncake_audit:untaken_reads_job", {"extra": mooncake.connector_extra(),
                                                                            "tag": tag})], timeout=300)  # fmt: skip
    assert out["dropped"] == 2
    assert out["gone_left"] == [] and out["live_left"] == 6, out
    assert out["closing_parts"] == 6 and out["closing_left"] == [], out
    said = out["said"]
    assert [m for m in said if f"{tag}gone_0_0@0_1" in m and "the key and its parts are removed" in m], said
    assert [m for m in said if f"{tag}live_0_0@0_1" in m and "stay in the store" in m], said
    assert [m for m in said if "closing: removed 1 finished read(s)" in m], said


def test_letting_go_of_a_read_never_raises_into_vllm_omni(monkeypatch, caplog):
    """A store that fails the removal: logged, the read let go all the same."""
    import logging

    from omni_accum.integrations.vllm_omni import mooncake_get as mg

    mc = _stub(monkeypatch, [])
    conn = mc.MooncakeFastConnector({**GOOD, "stage_id": 1, "mooncake_read_threads": 1})

    class Failing:
        def batch_remove(self, keys, force):
            raise RuntimeError("master gone")

    conn.inner.store = Failing()
    dec = SimpleNamespace(todo=[(None, [("k@0_1#oa1.0.0", 4)])])
    read = mg._Read("k@0_1", b"", dec, None, 0.0, 0.0, 0.0, 4, 0)
    with caplog.at_level(logging.WARNING, logger="omni_accum.vllm_omni"):
        assert conn._let_go("k@0_1", read, closing=True) is False
    assert "could not remove k@0_1 and its parts: master gone" in caplog.text
    conn.close()


# ---------------------------------------------------------------------------------------------- #
# 6-8. The fast-path hand-off script, and the bench's sizes
# ---------------------------------------------------------------------------------------------- #


def _handoff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mooncake" / "fast_path_handoff.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip


def test_the_hand_off_script_says_a_bad_stage_segment_in_one_line():
    from omni_accum.bench.mooncake import mooncake_problem

    if mooncake_problem():
        pytest.skip(mooncake_problem())
    bad = _handoff("--stage-segment", "256XB")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "fast_path_handoff: --stage-segment: not a size: '256XB' (give bytes, or a number with B, KiB, MiB, GiB, KB, "
        "MB, GB: KB, MB, GB are 10^3, 10^6, 10^9 bytes; KiB, MiB, GiB (and K, M, G) 2^10, 2^20, 2^30)"]
    small = _handoff("--stage-segment", "8MiB")
    assert small.returncode == 2 and small.stderr.strip().splitlines() == [
        "fast_path_handoff: --stage-segment '8MiB' is 8388608 bytes, under Mooncake's smallest segment: its setup "
        "fails (rc -600, 'Total size must be at least 16777216'); give 0 or at least 16MiB (16777216 bytes)"], small.stderr


def test_the_hand_off_script_s_help_counts_the_parts_right():
    """8000 x 2048 bf16 = 32,768,000 bytes: 2 parts of a 16 MiB buffer, not 3."""
    got = _handoff("--help")
    text = " ".join(got.stdout.split())
    assert got.returncode == 0 and "goes in 2 parts of at most 16 MiB" in text and "3 parts" not in text, text


def test_the_bench_reads_sizes_as_the_connector_does():
    """``MB`` was 2^20 bytes to ``--mooncake-segment`` and 10^6 to ``mooncake_buffer_bytes``."""
    from omni_accum.bench.mooncake import DEFAULT_SEGMENT
    from omni_accum.bench.mooncake_services import parse_size
    from omni_accum.integrations.vllm_omni.arena_settings import parse_size as connectors

    for text in ("512MB", "1GB", "256KB", "512MiB", "1GiB", "256M", "1g", "1.5GiB", "4096", " 64 MiB "):
        assert parse_size(text) == connectors(text, "x", minimum=1), text
    assert parse_size("512MB") == 512 * 10**6 and parse_size("512MiB") == 512 << 20
    assert parse_size(DEFAULT_SEGMENT) == 1 << 30  # the default unchanged


# ---------------------------------------------------------------------------------------------- #
# 9. A get poll in a unit it does not take
# ---------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("value", ["10us", "5 min", "fast"])
def test_a_poll_in_a_unit_it_does_not_take_is_told_the_units_and_the_range(value):
    """It said "not 'blocking' or a duration such as 5ms or 0.005s": no units, no range."""
    from omni_accum.integrations.vllm_omni.mooncake_wait import parse_poll

    with pytest.raises(ValueError) as e:
        parse_poll(value)
    assert str(e.value) == (f"extra.mooncake_get_poll = {value!r} is not 'blocking' or a duration: the units taken "
                            "are s (0.005s; a number without a unit is seconds too) and ms (5ms), from 0.1 ms to 1 s")


def test_a_dropped_read_is_let_go_outside_the_reads_lock(monkeypatch):
    """Letting go of a dropped read may reach the store and wait for the adapter's lock: a take that found no read of
    its key (the common get) did it under the reads' lock, and a start under the connector's receive lock."""
    from omni_accum.integrations.vllm_omni import mooncake_reads

    seen: list[tuple[str, bool]] = []
    reads = mooncake_reads.BackgroundReads(1, lambda: None, lambda key, got, closing: seen.append(
        (key, reads._lock.locked())) or False)  # fmt: skip
    clock = [time.monotonic()]
    monkeypatch.setattr(mooncake_reads, "_now", lambda: clock[0])
    try:
        for name in ("a_0_0", "b_0_0"):
            reads.start(name, lambda buf: bytearray(4))
            reads._reads[name][0].result(timeout=60)
            while not reads._reads[name][1]:
                time.sleep(0.01)  # (its finish time, set on the read's thread)
        clock[0] += mooncake_reads.RESULT_TTL_S + 2
        reads.start("c_0_0", lambda buf: bytearray(4))  # drops a and b, lets go of neither here
        assert seen == [] and reads.dropped == 2
        assert reads.take("other") == (mooncake_reads.NONE, None)  # no read of its key: lets go of both, unlocked
        assert sorted(seen) == [("a_0_0", False), ("b_0_0", False)]
    finally:
        monkeypatch.undo()
        reads.close()


@pytest.mark.parametrize("over", [1, 8 << 30])
def test_a_segment_larger_than_the_host_s_memory_is_refused_by_the_connector_doctor_and_the_bench(
        monkeypatch, tmp_path, over):
    """Mooncake's setup refuses a segment larger than the host's memory with rc -600 (measured on this VM: 0.97 of its
    24 GiB set up, 1.01 failed; the stage does not start): ``doctor`` said ready, the connector reached the setup."""
    from omni_accum.bench.mooncake_services import segment_problem
    from omni_accum.integrations.vllm_omni.mooncake_settings import host_memory

    mem = host_memory()
    assert mem is not None and mem > 16 << 20
    segment = mem + over
    said = _refused(monkeypatch, {**GOOD, "segment": segment})
    assert said.startswith(
        f"{NAME}: extra.segment = {segment} bytes is larger than this host's memory ({mem} bytes"), said
    assert "rc -600 and the stage does not start" in said and "give a segment under the memory of the host" in said
    for name in ("MooncakeStoreConnector", NAME):
        problems, _ = _doctor(monkeypatch, tmp_path, name, {**GOOD, "segment": segment})
        assert len(problems) == 1, problems
        assert f"extra.segment = {segment} bytes is larger than this host's memory" in problems[0], problems
    assert segment_problem(segment, "--mooncake-segment '1TiB'") == (
        f"--mooncake-segment '1TiB' is {segment} bytes, which is larger than this host's memory ({mem} bytes, "
        f"{mem / (1 << 30):.1f} GiB): Mooncake's setup fails with rc -600 and the stage does not start; "
        "give a smaller one")
    built: list = []  # the memory itself (under it: 0.97 set up on this VM) reaches the setup
    _stub(monkeypatch, built).MooncakeFastConnector({**GOOD, "segment": mem, "stage_id": 1}).close()
    assert built[0]["segment"] == mem
