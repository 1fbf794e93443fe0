"""A bad deploy setting of omni-accum's connectors is refused when the connector is built, in one message naming the
``extra`` key, the value and what it takes: never taken silently, never a misleading message later."""

from __future__ import annotations

import errno
import glob
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from omni_accum.integrations.vllm_omni import arena_settings, mooncake_settings

from tests.test_integration_vllm_omni_arena_connector import _connector, arena_name  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parent.parent
ARENA = "OmniAccumArenaConnector"
MOONCAKE = "OmniAccumMooncakeConnector"


# ------------------------------------------------------------------ sizes larger than the file system
@pytest.mark.vllm
@pytest.mark.parametrize(("key", "value"), [("ring_bytes", "1000000GB"), ("arena_bytes", 10**18)])
def test_a_size_whose_reserved_part_exceeds_the_whole_file_system_is_refused_at_construction(vo, monkeypatch, key,
                                                                                             value):  # fmt: skip
    """Such a size used to be taken: the first get then said 'no room ... the file system is full', fell back and
    tried again every 5 s for good, never naming the setting (a region reserves its rings and page map)."""
    monkeypatch.delenv("OMNI_ACCUM_ARENA_DIR", raising=False)
    total = os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize
    with pytest.raises(ValueError) as e:
        _connector(1, "toolarge", **{key: value})
    said = str(e.value)  # (vllm-omni's factory says "Failed to create connector ...: " before it)
    assert f"{ARENA}: extra.{key} = {value!r}: a region reserves " in said, said
    assert (f"more than the whole file system of /dev/shm (/dev/shm (OMNI_ACCUM_ARENA_DIR is not set): {total} bytes"
            in said and said.endswith("; give sizes that fit there")), said


def test_the_file_system_is_the_arena_dir_s_and_only_the_reserved_part_is_compared(tmp_path, monkeypatch):
    """The data pages are given as they are used (a sparse file): an arena_bytes larger than the file system works
    until the pages in use fill it, as the default 1 GiB does in docker's 64 MiB /dev/shm; a shipped deploy's 4 GiB
    on a 2 GiB /dev/shm must still start. What a region reserves when it is made must fit."""
    monkeypatch.setenv("OMNI_ACCUM_ARENA_DIR", str(tmp_path))
    real = os.statvfs
    small = SimpleNamespace(f_blocks=16384, f_frsize=4096)  # 64 MiB: docker's default /dev/shm
    seen = []
    monkeypatch.setattr(arena_settings.os, "statvfs", lambda p: seen.append(p) or small)
    assert arena_settings.parse_settings({"arena_bytes": "4GiB"}).arena_bytes == 4 << 30  # 1 MiB of page map
    assert seen == [tmp_path]
    reserved = (64 << 20) + (256 << 10) + (1 << 30) // 4096  # the ring, the back ring, the default arena's page map
    with pytest.raises(ValueError) as e:
        arena_settings.parse_settings({"ring_bytes": "64MiB"})
    said = str(e.value)
    assert f"extra.ring_bytes = '64MiB': a region reserves {reserved} bytes when it is made" in said, said
    assert f"more than the whole file system of {tmp_path} (OMNI_ACCUM_ARENA_DIR='{tmp_path}': {64 << 20} bytes, " \
        "64 MiB)" in said, said
    with pytest.raises(ValueError, match="extra.arena_bytes = '1024GiB': a region reserves"):  # a 256 MiB page map
        arena_settings.parse_settings({"arena_bytes": "1024GiB"})
    assert arena_settings.parse_settings({}).arena_bytes == 1 << 30  # the default: taken until the tmpfs is full
    monkeypatch.setenv("OMNI_ACCUM_ARENA_DIR", str(tmp_path / "missing"))
    monkeypatch.setattr(arena_settings.os, "statvfs", real)
    assert arena_settings.parse_settings({"ring_bytes": "8GiB"}).ring_bytes == 8 << 30  # unreadable: the get says


def test_no_room_for_a_region_names_the_settings_that_sized_it(monkeypatch):
    from omni_accum.arena import region

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(region.os, "posix_fallocate", full)
    name = f"noroom{os.getpid()}"
    with pytest.raises(OSError, match=r"no room for \d+ bytes \(its header, page map and rings: 65536 ring bytes "
                                      r"\(ring_bytes\) and a byte per page of 1048576 data bytes \(arena_bytes\)\)"):
        region.Region.create(name, 1 << 20, ring_bytes=64 << 10)
    assert not os.path.lexists(region.path_for(name))  # nothing left in /dev/shm


# ------------------------------------------------------------------ keys that look meant for a connector
@pytest.mark.parametrize(
    ("key", "said"),
    [
        ("Arena_bytes", "'Arena_bytes': did you mean 'arena_bytes'?"),
        ("arena-bytes", "'arena-bytes': did you mean 'arena_bytes'?"),
        ("ARENA_BYTES", "'ARENA_BYTES': did you mean 'arena_bytes'?"),
        ("arenabytes", "'arenabytes': did you mean 'arena_bytes'?"),
        ("view_bytes", "'view_bytes': did you mean 'arena_view_bytes'?"),
        ("stage_rows", "'stage_rows': did you mean 'arena_stage_rows'?"),
        ("warm", "'warm': did you mean 'arena_warm'?"),
        ("Ring-Bytes", "'Ring-Bytes': did you mean 'ring_bytes'?"),
        ("arena_veiw_bytes", "'arena_veiw_bytes': did you mean 'arena_view_bytes'?"),
        ("arena_size", "'arena_size': none of them"),  # (not arena_name: a suggestion must be close)
        ("mooncake_buffer_bytes", f"'mooncake_buffer_bytes': a key of {MOONCAKE}, not of this connector"),
        ("Mooncake-Get-Poll", f"'Mooncake-Get-Poll': a key of {MOONCAKE}, not of this connector"),
    ],
)
def test_a_key_that_looks_meant_for_the_arena_connector_is_refused(key, said):
    """Only an exact lowercase ``arena_`` / ``ring_`` prefix used to be refused: each of these was ignored."""
    with pytest.raises(ValueError) as e:
        arena_settings.parse_settings({key: "1MiB", "codec_chunk_frames": 25})
    assert str(e.value) == (f"{ARENA}: unknown extra key(s) {key!r}; it reads arena_name, arena_bytes, ring_bytes, "
                            f"arena_view_bytes, arena_warm, arena_stage_rows ({said})")


@pytest.mark.parametrize(
    ("key", "said"),
    [
        ("Mooncake_buffer_bytes", "did you mean 'mooncake_buffer_bytes'?"),
        ("mooncake-buffer-bytes", "did you mean 'mooncake_buffer_bytes'?"),
        ("mooncakebufferbytes", "did you mean 'mooncake_buffer_bytes'?"),
        ("buffer_bytes", "did you mean 'mooncake_buffer_bytes'?"),
        ("read_threads", "did you mean 'mooncake_read_threads'?"),
        ("mooncake_poll", "did you mean 'mooncake_get_poll'?"),
        ("arena_bytes", f"a key of {ARENA}, not of this connector"),
        ("Ring_Bytes", f"a key of {ARENA}, not of this connector"),
    ],
)
def test_a_key_that_looks_meant_for_the_mooncake_connector_is_refused(key, said):
    with pytest.raises(ValueError, match=rf"^{MOONCAKE}: unknown extra key\(s\) {key!r}; it reads "
                                         rf"mooncake_buffer_bytes, .* \({key!r}: {said.replace('?', '[?]')}\)$"):
        mooncake_settings.parse_settings({key: "1MiB", "master": "127.0.0.1:50051"})


def test_other_keys_of_the_extra_are_left_alone_and_one_function_checks_both_connectors():
    theirs = {"codec_chunk_frames": 25, "codec_left_context_frames": 25, "initial_codec_chunk_frames": 5,
              "shm_threshold_bytes": 65536, "stage_id": 1, "omni_accum_policy": "x", "omni_accum_adapter_keys": [],
              "name": "n", "bytes": 1, "warmup": 3, "segment": 1 << 29, "host": "h", "num_threads": 2, 7: "int key"}
    assert arena_settings.parse_settings(theirs).arena_name == "omni"
    mooncake_settings.parse_settings(theirs)
    assert mooncake_settings.check_keys is arena_settings.check_keys
    with pytest.raises(ValueError, match=r"unknown extra key\(s\) 'arena-name', 'mooncake_x', 'warm'; it reads "):
        arena_settings.parse_settings({"arena-name": "a", "warm": "1MiB", "mooncake_x": 1})  # all in one message


def test_every_shipped_deploy_passes_its_connector_s_settings():
    def extras(o):
        if isinstance(o, dict):
            if isinstance(o.get("extra"), dict):
                yield o.get("name"), o["extra"]
            for v in o.values():
                yield from extras(v)
        elif isinstance(o, list):
            for v in o:
                yield from extras(v)

    parsed = {ARENA: 0, MOONCAKE: 0}
    files = glob.glob(f"{ROOT}/config/**/*.yaml", recursive=True)
    files += glob.glob(f"{ROOT}/benchmarks/e2e/configs/**/*.yaml", recursive=True)
    for f in sorted(files):
        for name, extra in extras(yaml.safe_load(Path(f).read_text())):
            if name == ARENA:
                arena_settings.parse_settings(extra)
            elif name == MOONCAKE:
                mooncake_settings.parse_settings(extra)
            else:
                continue
            parsed[name] += 1
    assert parsed[ARENA] >= 7 and parsed[MOONCAKE] >= 6, parsed


# ------------------------------------------------------------------ VLLM_OMNI_INPUT_WAIT_TIMEOUT_S=0
@pytest.mark.parametrize("value", ["0", "0.0", " 0 ", "-0"])
def test_an_input_wait_of_0_orphans_after_an_hour_not_twenty_minutes(monkeypatch, value):
    """vllm-omni 0.30.0 takes exactly 0 as 'no deadline'; the arena took it as invalid (its 20 min default). With no
    deadline no request is failed for waiting, so a message waits an hour for its get (a receiving stage looks for
    its requests' chunks all the time); never would keep every aborted request's messages, which fill the arena."""
    from omni_accum.integrations.vllm_omni import arena_connector

    monkeypatch.setenv("VLLM_OMNI_INPUT_WAIT_TIMEOUT_S", value)
    assert arena_connector.orphan_after_s() == arena_settings.NO_DEADLINE_ORPHAN_S == 3600.0
    monkeypatch.setenv("VLLM_OMNI_INPUT_WAIT_TIMEOUT_S", "nan")
    assert arena_connector.orphan_after_s() == 1200.0  # a value vllm-omni does not take: its default, doubled


# ------------------------------------------------------------------ arena_warm, arena_name
@pytest.mark.vllm
def test_an_arena_warm_larger_than_arena_bytes_is_refused_naming_both(vo):
    """It used to be cut to arena_bytes silently."""
    with pytest.raises(ValueError, match=r"OmniAccumArenaConnector: extra.arena_warm = '1GiB' is 1073741824 bytes, "
                                         r"more than the region's data pages \(extra.arena_bytes = '64MiB': 67108864 "
                                         r"bytes\); give at most arena_bytes, or all, or off$"):
        _connector(1, "warmbig", arena_bytes="64MiB", arena_warm="1GiB")
    with pytest.raises(ValueError, match=r"arena_warm = '2GiB' .*\(the default arena_bytes: 1073741824 bytes\)"):
        arena_settings.parse_settings({"arena_warm": "2GiB"})
    assert arena_settings.parse_settings({"arena_bytes": "64MiB", "arena_warm": "64MiB"}).warm_bytes == 64 << 20


@pytest.mark.parametrize("value", [True, False, 1.5, ["a"]])
def test_an_arena_name_that_is_no_text_is_refused(monkeypatch, value):
    """``arena_name: yes`` used to become the name 'True'. (An empty value, None or '' or blanks, is the key left
    out, as docs/arena.md says, and a whole number its digits: ``arena_name: 2024`` is a name.)"""
    monkeypatch.setenv("OMNI_ACCUM_ARENA_NAME", "from-env")
    with pytest.raises(ValueError) as e:
        arena_settings.parse_settings({"arena_name": value})
    assert str(e.value).startswith(f"{ARENA}: extra.arena_name = {value!r}: use letters, digits, '_', '.', '-' (1 to "
                                   "120)"), e.value
    assert str(e.value).endswith("; leave the key out for $OMNI_ACCUM_ARENA_NAME, else 'omni'")
    assert ("quote it" in str(e.value)) == (not isinstance(value, str))
    absent = arena_settings.parse_settings({})
    assert (absent.arena_name, absent.arena_name_from) == ("from-env", "OMNI_ACCUM_ARENA_NAME")
    assert arena_settings.parse_settings({"arena_name": None}).arena_name == "from-env"
    assert arena_settings.parse_settings({"arena_name": 2024}).arena_name == "2024"
    monkeypatch.delenv("OMNI_ACCUM_ARENA_NAME")
    assert arena_settings.parse_settings({"codec_chunk_frames": 2}).arena_name == "omni"
