"""The ``extra`` settings of ``OmniAccumMooncakeConnector`` (:mod:`.mooncake_connector`): the five keys of its own,
each bad value refused with the key, the value and what it takes; every other key goes to vllm-omni 0.30.0's
``MooncakeStoreConnector`` unchanged, once :func:`store_checks` (``doctor --deploy``'s checks of those keys) finds
no problem in them."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omni_accum.errors import close_matches
from omni_accum.integrations.vllm_omni.arena_settings import check_keys, parse_size
from omni_accum.integrations.vllm_omni.mooncake_reads import MAX_THREADS
from omni_accum.integrations.vllm_omni.mooncake_wait import parse_poll

#: The name the ``omni_accum_mooncake`` entry point registers the connector under.
NAME = "OmniAccumMooncakeConnector"
DEFAULT_BUFFER_BYTES = 16 << 20
DEFAULT_TENSOR_MIN_BYTES = 256 << 10
KNOWN_KEYS = ("mooncake_buffer_bytes", "mooncake_tensor_min_bytes", "mooncake_get_poll", "mooncake_parts_segment",
              "mooncake_read_threads")
#: ``mooncake_parts_segment``: ``local`` (the sending process's own segment) or ``any`` (the master chooses).
PARTS_SEGMENTS = ("local", "any")
#: ``mooncake_buffer_bytes``: at least a page; at most 1 GiB (each process holds two such buffers plus one per reader
#: thread, and every part must fit in one segment).
MIN_BUFFER_BYTES = 4096
MAX_BUFFER_BYTES = 1 << 30
#: What vllm-omni 0.30.0's ``MooncakeStoreConnector.__init__`` reads from its ``extra``, and its defaults.
STORE_KEYS: dict[str, Any] = {
    "host": "127.0.0.1",
    "metadata_server": "http://127.0.0.1:8080/metadata",
    "master": "127.0.0.1:50051",
    "segment": 512 * 1024 * 1024,
    "localbuf": 64 * 1024 * 1024,
    "proto": "tcp",
    "rdma": "",
}
#: Its default ``segment`` (bytes), when the extra gives none.
DEFAULT_SEGMENT = STORE_KEYS["segment"]
#: The smallest ``segment`` Mooncake's setup takes other than 0 (no memory contributed): below it the setup fails
#: with rc -600 ("Total size must be at least 16777216", Mooncake 0.3.13.post1) and the stage does not start.
MIN_SEGMENT = 16 << 20


def host_memory() -> int | None:
    """This host's physical memory in bytes (None: unknown). Mooncake's setup refuses a segment larger than it (rc
    -600; measured on Mooncake 0.3.13.post1 with 24 GiB: 0.97 of the memory set up, 1.01 of it failed), so a stage
    asking for more does not start."""
    try:
        n = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None
    return n if n > 0 else None


def segment_too_large(segment: Any) -> str | None:
    """Why a ``segment`` of this many bytes cannot be set up on this host (larger than its memory), or None."""
    mem = host_memory()
    if type(segment) is not int or mem is None or segment <= mem:
        return None
    return (f"is larger than this host's memory ({mem} bytes, {mem / (1 << 30):.1f} GiB): Mooncake's setup fails with "
            "rc -600 and the stage does not start")
#: Names vllm-omni 0.30.0's connector does not read, each with the key it reads for that setting: Mooncake's own
#: config names (:data:`MOONCAKE_CONFIG_NAMES`, its ``MooncakeStoreConfig``'s) and others written for them. Too far
#: from the key for a typo's close match, each was ignored, and the stage took vllm-omni's loopback default.
STORE_ALIASES: dict[str, str] = {
    "master_server_address": "master", "master_address": "master", "master_addr": "master", "master_server": "master",
    "metadata": "metadata_server", "metadata_url": "metadata_server",
    "local_hostname": "host", "hostname": "host", "host_ip": "host",
    "protocol": "proto", "transport": "proto",
    "global_segment_size": "segment", "segment_size": "segment",
    "local_buffer_size": "localbuf",
    "device_name": "rdma", "rdma_devices": "rdma",
}  # fmt: skip
MOONCAKE_CONFIG_NAMES = ("master_server_address", "local_hostname", "protocol", "global_segment_size",
                         "local_buffer_size", "device_name")  # fmt: skip
#: The protocols of the CPU build omni-accum pins (``mooncake-transfer-engine-non-cuda``), and others Mooncake knows.
PROTOCOLS = ("tcp", "rdma")
OTHER_PROTOCOLS = ("nvlink", "nvlink_intra", "hip", "cxl", "ascend", "barex", "efa", "nvmeof", "ubshmem",
                   "sunrise_link")  # fmt: skip
METADATA_SCHEMES = ("http://", "https://", "etcd://", "redis://")


@dataclass(frozen=True)
class MooncakeFastSettings:
    #: The registered staging buffer per direction, and the largest part.
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    #: Smaller tensors stay in the serialized payload.
    tensor_min_bytes: int = DEFAULT_TENSOR_MIN_BYTES
    #: Seconds between two asks for a key not there yet; None: 0.30.0's blocking get.
    get_poll: float | None = None
    parts_segment: str = "local"
    #: Threads that read a payload's parts outside the get (:mod:`.mooncake_reads`); 0: in the get.
    read_threads: int = 0


def _size(extra: Mapping[str, Any], key: str, default: int, minimum: int, maximum: int | None = None) -> int:
    """Bytes of ``extra[key]`` (an int, or a size such as ``16MiB``): the same sizes whichever way they are written,
    from ``minimum`` to ``maximum`` (the arena connector's parser: one regex, unit table and whole-number check)."""
    return parse_size(extra.get(key, default), key, name=NAME, minimum=minimum, maximum=maximum, say_range=True)


def parse_settings(extra: Mapping[str, Any]) -> MooncakeFastSettings:
    """The connector's own settings from a deploy's ``extra``. ``ValueError`` names the key, the value and the
    choices: a key that looks meant for it (``Mooncake_buffer_bytes``, ``mooncake-buffer-bytes``, a ``mooncake_*``
    typo) or is the arena connector's (:func:`.arena_settings.check_keys`; 0.30.0's connector would ignore it)."""
    check_keys(extra, NAME, KNOWN_KEYS)  # a mooncake_* typo, an arena connector's key
    try:
        get_poll = parse_poll(extra.get("mooncake_get_poll"))
    except ValueError as e:
        raise ValueError(f"{NAME}: {e}") from None
    parts_segment = extra.get("mooncake_parts_segment", "local")
    if parts_segment not in PARTS_SEGMENTS:
        raise ValueError(f"{NAME}: extra.mooncake_parts_segment = {parts_segment!r} is not one of "
                         f"{', '.join(PARTS_SEGMENTS)}")
    threads = extra.get("mooncake_read_threads", 0)
    whole = (isinstance(threads, int) and not isinstance(threads, bool)) or (
        isinstance(threads, str) and re.fullmatch(r"[0-9]+", threads.strip()) is not None)  # ASCII digits only
    n_threads = int(threads) if whole else -1
    if not 0 <= n_threads <= MAX_THREADS:
        raise ValueError(f"{NAME}: extra.mooncake_read_threads = {threads!r} is not a whole number from 0 (reads in "
                         f"the get, the default) to {MAX_THREADS}")
    return MooncakeFastSettings(
        buffer_bytes=_size(extra, "mooncake_buffer_bytes", DEFAULT_BUFFER_BYTES, MIN_BUFFER_BYTES, MAX_BUFFER_BYTES),
        tensor_min_bytes=_size(extra, "mooncake_tensor_min_bytes", DEFAULT_TENSOR_MIN_BYTES, 1),
        get_poll=get_poll,
        parts_segment=parts_segment,
        read_threads=n_threads,
    )


def notes(extra: Mapping[str, Any], settings: MooncakeFastSettings) -> list[str]:
    """What the settings allow but will not work as meant (the connector logs each as a warning; ``doctor`` shows
    them): a staging buffer larger than this stage's segment. A part of the buffer's size does not fit that segment,
    so the master puts it into another process's segment that has room (measured on Mooncake 0.3.13.post1: a 16 MiB
    segment, 32 MiB parts, all put and read back); the store refuses it only when no segment has room."""
    out = []
    segment = extra.get("segment", DEFAULT_SEGMENT)
    if type(segment) is int and MIN_SEGMENT <= segment < settings.buffer_bytes:  # (a smaller one: store_checks')
        out.append(f"{NAME}: extra.mooncake_buffer_bytes ({settings.buffer_bytes} bytes) is larger than extra.segment "
                   f"({segment} bytes): a part of that size does not fit this stage's own segment, so Mooncake puts it "
                   "into another stage's (or holder's) segment that has room, a transfer where the put would have been "
                   "a local copy (mooncake_parts_segment: local); only when no segment has room is the part refused "
                   "(mooncake_put_error) and the payload sent serialized, which then needs a segment with room for "
                   "all of it. Give a buffer of at most the segment (16MiB, the default) to keep the parts in this "
                   "stage's segment")
    return out


def master_address_problem(address: Any, ha: bool = False) -> str | None:
    """Why ``address`` is not a Mooncake master's ``HOST:PORT`` (port 1 to 65535; an IPv6 host in brackets), or
    None. Mooncake's setup takes anything and retries for ~90 s before it fails naming no address. ``ha``: also take
    Mooncake's high-availability form, ``etcd://HOST:PORT`` (several separated by ``;`` or ``,``), where the client
    finds the master in etcd (a store's ``master``; not an address a master can be started on)."""
    if not isinstance(address, str):
        return "is not text (HOST:PORT)"
    text = address.strip()
    if ha and text.lower().startswith("etcd://"):
        ends = [e.strip() for e in re.split(r"[;,]", text[len("etcd://"):])]
        for end in ends:
            why = master_address_problem(end) if end else "has an empty etcd endpoint"
            if why:
                return f"(Mooncake's HA form, etcd://HOST:PORT[;HOST:PORT]): etcd endpoint {end!r} {why}"
        return None
    if "://" in text:
        scheme, _, rest = text.partition("://")
        return f"has a scheme ({scheme}://): give HOST:PORT alone ({rest.split('/', 1)[0] or 'HOST:PORT'})"
    if text.startswith("[") and text.endswith("]"):
        return "has no port ([HOST]:PORT)"
    host, sep, port = text.rpartition(":")
    if sep and ":" in host and not (host.startswith("[") and host.endswith("]")):
        return f"has an IPv6 host without brackets: write [HOST]:PORT ([{host}]:{port} if {port} is the port)"
    if not sep or not host:
        return "has no port (HOST:PORT)"
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        return f"has port {port!r}, not a number from 1 to 65535"
    return None


def store_checks(extra: Mapping[str, Any], place: str = "extra") -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(problems, notes), each ``(what, fix)``, of the keys vllm-omni 0.30.0's ``MooncakeStoreConnector`` reads from
    ``extra`` (its defaults where absent), ``place`` naming the mapping (``extra``, or a deploy's path to it).

    Problems are certain: the stage does not start, or Mooncake's setup hangs ~90 s and then fails naming no address
    (a ``segment``/``localbuf`` that is not a whole number of bytes, a ``segment`` from 1 byte to under
    :data:`MIN_SEGMENT`, a ``master`` without ``HOST:PORT``, an HTTP ``metadata_server`` without ``http://``, a
    ``proto`` Mooncake does not know, a ``host``, ``proto`` or ``rdma`` that is not text (``host:`` left empty: None),
    a ``host`` that is no address), or the stage uses vllm-omni's loopback default for a key written otherwise (a
    misspelt key, or another name for it: :data:`STORE_ALIASES`). ``doctor --deploy`` shows both; the connector
    refuses the problems when it is built."""
    problems: list[tuple[str, str]] = []
    notes: list[tuple[str, str]] = []
    # a misspelt key, or another name for one (Mooncake's own): vllm-omni reads the right one, finds none, and takes
    # its default
    for key in map(str, extra):
        if key in STORE_KEYS or key.startswith(("omni_accum_", "mooncake_")):
            continue
        alias = key.strip().lower().replace("-", "_")
        right = STORE_ALIASES.get(alias)
        if right is not None:
            said = (f"{key!r} is Mooncake's name; vllm-omni reads {right!r}" if alias in MOONCAKE_CONFIG_NAMES else
                    f"vllm-omni's MooncakeStoreConnector reads no {key!r}; it reads {right!r}")
            if right in extra:  # ignored beside the key read
                notes.append((f"{place}.{key}: {said} (given: {extra[right]!r}) and ignores this one",
                              f"remove {key}"))
            else:
                problems.append((f"{place}.{key}: {said}; without {right} it uses {STORE_KEYS[right]!r}",
                                 f"rename it to {right}"))
            continue
        close = close_matches(key, [k for k in STORE_KEYS if k not in extra], cutoff=0.75)
        if close:
            problems.append((f"{place}.{key}: vllm-omni's MooncakeStoreConnector reads no {key!r} (did you mean "
                             f"{close[0]}?); without {close[0]} it uses {STORE_KEYS[close[0]]!r}",
                             f"rename it to {close[0]}"))  # fmt: skip
    for key in ("segment", "localbuf"):
        v = extra.get(key, STORE_KEYS[key])
        if type(v) is not int or v < (0 if key == "segment" else 1):
            problems.append((f"{place}.{key} = {v!r}: vllm-omni passes it to Mooncake's setup as a whole number of "
                             "bytes, which refuses this value (incompatible function arguments) and the stage does not "
                             "start", f"give {key} in bytes, e.g. {STORE_KEYS[key]} "
                             f"({'512 MiB' if key == 'segment' else '64 MiB'}); "
                             + ("0: this stage contributes no memory" if key == "segment" else "at least the largest "
                                "chunk")))  # fmt: skip
    segment = extra.get("segment", STORE_KEYS["segment"])
    if type(segment) is int and 0 < segment < MIN_SEGMENT:
        problems.append((f"{place}.segment = {segment!r} bytes is under Mooncake's smallest segment: its setup fails "
                         f"with rc -600 ('Total size must be at least {MIN_SEGMENT}') and the stage does not start",
                         f"give segment 0 (this stage contributes no memory) or at least {MIN_SEGMENT} (16 MiB)"))
    elif (too_large := segment_too_large(segment)) is not None:
        problems.append((f"{place}.segment = {segment!r} bytes {too_large}",
                         "give a segment under the memory of the host the stage runs on (checked against this host's; "
                         "0: this stage contributes no memory)"))
    master = extra.get("master", STORE_KEYS["master"])
    why = master_address_problem(master, ha=True)
    if why:
        problems.append((f"{place}.master = {master!r} {why}: Mooncake's setup retries for ~90 s and fails with "
                         "'Mooncake setup failed: -1'", "give the master's HOST:PORT (its --rpc_port, e.g. "
                         "10.0.0.1:50151)"))  # fmt: skip
    meta = extra.get("metadata_server", STORE_KEYS["metadata_server"])
    if not isinstance(meta, str) or not meta.strip():
        problems.append((f"{place}.metadata_server = {meta!r} is not an address", "give the master's HTTP metadata "
                         "server, e.g. http://10.0.0.1:8080/metadata"))  # fmt: skip
    elif not meta.startswith(METADATA_SCHEMES) and meta != "P2PHANDSHAKE":
        text = (f"{place}.metadata_server = {meta!r} has no scheme: Mooncake takes it for an etcd address and waits "
                "for etcd there")
        fix = f"for the master's HTTP metadata server write http://{meta.split('://')[-1]}"
        if "/" in meta:  # a URL's path: meant for HTTP, not an etcd endpoint
            problems.append((text + " (the stage hangs, then fails)", fix))
        else:
            notes.append((text + "; right only if etcd runs there", fix))
    proto = extra.get("proto", STORE_KEYS["proto"])
    if not isinstance(proto, str):  # ``proto:`` left empty is None here, which Mooncake's setup refuses
        problems.append((f"{place}.proto = {proto!r} is not text: vllm-omni passes it to Mooncake's setup, which "
                         "refuses it (TypeError: incompatible function arguments) and the stage does not start",
                         f"one of: {', '.join(PROTOCOLS)}"))  # fmt: skip
    elif proto not in PROTOCOLS:
        if proto in OTHER_PROTOCOLS:
            notes.append((f"{place}.proto = {proto!r}: not in the CPU build of Mooncake omni-accum pins (tcp, rdma)",
                          "use a Mooncake build with that transport"))  # fmt: skip
        elif close := close_matches(proto, (*PROTOCOLS, *OTHER_PROTOCOLS)):
            problems.append((f"{place}.proto = {proto!r} is not a protocol Mooncake knows (did you mean {close[0]}?): "
                             "the stage does not start", f"one of: {', '.join(PROTOCOLS)}"))  # fmt: skip
        else:  # a transport of a Mooncake build newer than the one omni-accum knows, maybe
            notes.append((f"{place}.proto = {proto!r} is not a protocol omni-accum knows of Mooncake's (tcp, rdma, "
                          f"{', '.join(OTHER_PROTOCOLS)}): the stage does not start unless its Mooncake build has it",
                          f"one of: {', '.join(PROTOCOLS)}"))  # fmt: skip
    rdma = extra.get("rdma", STORE_KEYS["rdma"])
    if not isinstance(rdma, str):
        problems.append((f"{place}.rdma = {rdma!r} is not text (the RDMA device names): vllm-omni passes it to "
                         "Mooncake's setup, which refuses it (TypeError: incompatible function arguments) and the "
                         "stage does not start", "name the devices (rdma: mlx5_0), or leave rdma out where there is "
                         "no RDMA"))  # fmt: skip
    elif proto == "rdma" and not rdma:
        notes.append((f"{place}: proto rdma without rdma (the RDMA devices to use, e.g. mlx5_0)",
                      "name the devices in rdma:, or use proto: tcp where there is no RDMA"))
    host = extra.get("host")
    if "host" in extra and (not isinstance(host, str) or not host.strip()):  # ``host:`` left empty is None
        why = "" if isinstance(host, str) else (": vllm-omni passes it to Mooncake's setup, which refuses it "
                                                "(TypeError: incompatible function arguments) and the stage does not "
                                                "start")  # fmt: skip
        problems.append((f"{place}.host = {host!r} is not an address{why}", "give this host's address, as the "
                         "others reach it"))  # fmt: skip
    return problems, notes


def store_problem(extra: Mapping[str, Any]) -> str | None:
    """The problems of :func:`store_checks` as one message (each names the key, its value and what it takes), or
    None: what the connector refuses when it is built, before Mooncake's setup (which would hang or blame the
    master)."""
    problems, _ = store_checks(extra)
    if not problems:
        return None
    return f"{NAME}: " + "; also ".join(f"{what}; {fix}" for what, fix in problems)
