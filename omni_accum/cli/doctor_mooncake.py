"""``omni-accum doctor --deploy``'s Mooncake checks: every ``MooncakeStoreConnector`` / ``OmniAccumMooncakeConnector``
``extra`` read as vllm-omni 0.30.0's ``MooncakeStoreConnector`` reads it (``host``, ``metadata_server``, ``master``,
``segment``, ``localbuf``, ``proto``, ``rdma``, with its defaults where absent) and hands it to Mooncake's
``MooncakeDistributedStore.setup``.

Problems (the stage does not start, or hangs ~90 s and then fails): a ``segment`` or ``localbuf`` that is not a whole
number of bytes (``512MiB``, ``-1``: Mooncake's setup refuses the arguments), a ``segment`` from 1 byte to under 16 MiB
or larger than this host's memory (Mooncake's setup fails with rc -600), a ``master`` without ``HOST:PORT`` (port 1 to 65535), a ``metadata_server``
that is an HTTP address without ``http://`` (Mooncake then takes it for an etcd address and waits for it), a ``proto``
Mooncake does not know, a ``host``, ``proto`` or ``rdma`` left empty (None: Mooncake's setup raises ``TypeError``), a
misspelt key (``mastr``) or another name for one (Mooncake's own ``master_server_address``, ``local_hostname``, ...;
``hostname``, ``transport``, ...): vllm-omni reads ``master``, finds none, and uses its loopback default. Notes (it
starts, but not as meant across hosts): no ``host`` (127.0.0.1: no other host reaches this stage), no
``metadata_server`` while the master is elsewhere (127.0.0.1's), ``host`` on loopback while the master is elsewhere,
``proto: rdma`` without ``rdma`` devices, a ``metadata_server`` without a scheme (an etcd address), ``mooncake_*``
keys on a plain ``MooncakeStoreConnector`` (ignored there), a ``localbuf`` smaller than the largest chunk or than
``mooncake_buffer_bytes``, a staging buffer larger than ``segment``, another name for a key given beside it
(ignored), and addresses of other hosts without one ``OMNI_ACCUM_DEPLOYMENT`` in the environment.
"""

from __future__ import annotations

import os
from typing import Any

from omni_accum.cli.doctor_policy import Check, _connector_nodes, _deploy_or_none
from omni_accum.integrations.vllm_omni.mooncake_settings import STORE_KEYS

MOONCAKE_NAMES = ("MooncakeStoreConnector", "OmniAccumMooncakeConnector")
#: Bytes per prompt token of Qwen3-Omni's largest chunk (the thinker's prefill to the talker: embeddings and hidden
#: states, ``[P+1, 2048]`` bf16 each) and the prompt length assumed without ``omni_accum_context_len``.
CHUNK_BYTES_PER_TOKEN = 2 * 2048 * 2
REFERENCE_TOKENS = 8192
LOOPBACK = ("localhost", "::1", "[::1]")


def _loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


def _host_of(address: str) -> str:
    """The host part of ``HOST:PORT`` or of a URL."""
    rest = address.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        return rest[: rest.find("]") + 1]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest


def _nodes(node: Any) -> list[tuple[str, dict[str, Any]]]:
    """``(where, connector)`` for every mapping whose ``name`` is a Mooncake connector's."""
    return _connector_nodes(node, keep=lambda n: n.get("name") in MOONCAKE_NAMES)


def check_mooncake(deploy: str | None) -> list[Check]:
    """The checks of every Mooncake connector of the deploy YAML (see the module docstring)."""
    data = _deploy_or_none(deploy)
    if data is None:
        return []
    out: list[Check] = []
    remote = False
    found = _nodes(data)
    for where, node in found:
        place = f"{deploy}: {where}.extra" if where else f"{deploy}: extra"
        extra = node.get("extra", {})
        if not isinstance(extra, dict):
            detail = (f"{place} is {extra!r}, not a mapping: vllm-omni's MooncakeStoreConnector reads its settings "
                      "from it and fails")
            out.append(Check("mooncake", False, detail, "give the connector's settings (host, master, "
                             "metadata_server, ...) as a mapping"))  # fmt: skip
            continue
        problems, notes, is_remote = _check_extra(place, node["name"], extra)
        remote = remote or is_remote
        out += [Check("mooncake", False, d, f) for d, f in problems]
        out += [Check("mooncake", True, d, f, warning=True) for d, f in notes]
    if remote and not os.environ.get("OMNI_ACCUM_DEPLOYMENT", "").strip():
        detail = (f"{deploy}: its Mooncake connectors name other hosts' addresses, and OMNI_ACCUM_DEPLOYMENT is not "
                  "set here: stages started on separate hosts each draw their own, never find each other's peer hello, "
                  "and the senders send vllm-omni's own payloads (nothing left off; the log says 'has not heard')")
        fix = ("export the same OMNI_ACCUM_DEPLOYMENT (any token, e.g. `openssl rand -hex 6`) to every stage process "
               "of the server, on every host (docs/mooncake.md, 'Across hosts, step by step')")
        out.append(Check("mooncake", True, detail, fix, warning=True))
    if found and not any(not c.ok for c in out):
        out.append(Check("mooncake", True, f"{deploy}: {len(found)} Mooncake connector(s) read as vllm-omni 0.30.0's "
                         "MooncakeStoreConnector reads them"))  # fmt: skip
    return out


def _check_extra(place: str, name: str, extra: dict[str, Any]) -> tuple[list[tuple[str, str]], list[tuple[str, str]],
                                                                         bool]:  # fmt: skip
    """(problems, notes, whether it names another host's address) of one connector's ``extra``."""
    from omni_accum.integrations.vllm_omni import mooncake_settings

    problems, notes = mooncake_settings.store_checks(extra, place)
    master = extra.get("master", STORE_KEYS["master"])
    host = extra.get("host")
    remote_master = isinstance(master, str) and not _loopback(_host_of(master))
    if "host" not in extra:  # (``host:`` left empty is a problem of store_checks')
        notes.append((f"{place}: no host, so this stage registers as 127.0.0.1: only processes on its own machine "
                      "reach it", "give each host its own copy of the deploy whose host is that host's address, as "
                      "the others reach it"))  # fmt: skip
    elif isinstance(host, str) and host.strip() and _loopback(host) and remote_master:
        notes.append((f"{place}.host = {host!r} while the master is at {master!r}: other hosts cannot reach this "
                      "stage's memory", "give this host's own address (each host its own copy of the deploy)"))
    given = {mooncake_settings.STORE_ALIASES.get(k.strip().lower().replace("-", "_")) for k in map(str, extra)}
    if remote_master and "metadata_server" not in extra and "metadata_server" not in given:  # (an alias: a problem)
        notes.append((f"{place}: no metadata_server, so this stage asks {STORE_KEYS['metadata_server']!r} while the "
                      f"master is at {master!r}: unless a metadata server answers on this machine, Mooncake's setup "
                      "hangs ~90 s and the stage does not start", "give the master's HTTP metadata server, e.g. "
                      f"http://{_host_of(master)}:8080/metadata (the same on every host)"))  # fmt: skip
    remote = remote_master or (isinstance(host, str) and bool(host.strip()) and not _loopback(host))
    ours = [k for k in map(str, extra) if k.startswith("mooncake_")]
    if name == "MooncakeStoreConnector" and ours:
        notes.append((f"{place}: {', '.join(ours)} are OmniAccumMooncakeConnector's settings; MooncakeStoreConnector "
                      "ignores them", "select OmniAccumMooncakeConnector (config/deploy/qwen3_omni_mooncake_fast.yaml) "
                      "in every stage of the connector, or remove them"))  # fmt: skip
    localbuf = extra.get("localbuf", STORE_KEYS["localbuf"])
    if type(localbuf) is int and localbuf > 0:
        ctx = extra.get("omni_accum_context_len")
        tokens = ctx if type(ctx) is int and ctx > 0 else REFERENCE_TOKENS
        chunk = (tokens + 1) * CHUNK_BYTES_PER_TOKEN
        if localbuf < chunk:
            what = ("every chunk goes through it" if name == "MooncakeStoreConnector" else
                    "a chunk that goes serialized (a fallback, or a tensor the policy does not append) goes through it")
            notes.append((f"{place}.localbuf = {localbuf} bytes is smaller than Qwen3-Omni's prefill chunk at "
                          f"{tokens} prompt tokens (~{chunk} bytes): {what}, and a larger one fails its put or get",
                          f"give localbuf more than the largest chunk (at least {chunk})"))  # fmt: skip
    if name == "OmniAccumMooncakeConnector":
        try:
            settings = mooncake_settings.parse_settings(extra)
        except ValueError:  # check_connectors names it
            return problems, notes, remote
        for note in mooncake_settings.notes(extra, settings):
            notes.append((f"{place}: {note}", "lower mooncake_buffer_bytes or raise segment"))
        if type(localbuf) is int and 0 < localbuf < settings.buffer_bytes:
            notes.append((f"{place}.localbuf = {localbuf} bytes is smaller than mooncake_buffer_bytes "
                          f"({settings.buffer_bytes}): a part read with the store's plain get (when a receive buffer "
                          "cannot be registered) does not fit it", "give localbuf at least mooncake_buffer_bytes"))
    return problems, notes, remote
