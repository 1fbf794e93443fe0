"""Real Mooncake services for the tests, and the two stage processes of the Qwen3-Omni thinker -> talker hop.

Import the fixtures into a test module (``from mooncake_fixtures import mooncake, stage_host``):

* ``mooncake``: ``mooncake_master`` (HTTP metadata, free 127.0.0.1 ports) and a holder process owning
  the store's memory, started once per module, waited for until they answer, and stopped by their
  process ids at the end (also when a test fails); the teardown asserts nothing they had is still
  listening and both processes are gone;
* ``stage_host``: a :class:`~omni_accum.bench.mooncake.StageHost` (vllm-omni imported once, stage
  processes forked from it), one for the whole test process (conftest's ``shared_stage_host``: each module, and
  each bench run of the doc examples, started one before, ~20 s of a busy core each), stopped at its end;
  :func:`bench_on_shared_host` hands it to a test's ``omni-accum bench --wire mooncake`` runs.

Without Mooncake (or the Debian ``libibverbs1`` it links) the tests skip saying exactly what is
missing; under ``CI=true`` that is a failure.

``thinker_stage`` and ``talker_stage`` run in the forked stage processes: each loads vllm-omni's general
plugins (``vllm_omni.plugins.load_omni_general_plugins()``, which runs omni-accum's entry points with
the ``OMNI_ACCUM_*`` variables of its job) and builds a real ``OmniChunkTransferAdapter`` on a
``MooncakeStoreConnector`` named by a deploy-style connector config.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import CI

__all__ = ["mooncake", "stage_host"]  # the fixtures, for ``from mooncake_fixtures import *``

TESTS = str(Path(__file__).resolve().parent)


def require_mooncake() -> None:
    """Skip (fail under CI=true) naming exactly what is missing for Mooncake."""
    from omni_accum.bench.mooncake import mooncake_problem

    problem = mooncake_problem()
    if problem is None:
        return
    if CI:
        pytest.fail(f"Mooncake is required when CI=true: {problem}")
    pytest.skip(problem)


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    require_mooncake()
    from omni_accum.bench.mooncake import MooncakeServices, _alive, listening_ports

    svc = MooncakeServices(segment_bytes=256 << 20, log_dir=str(tmp_path_factory.mktemp("mooncake-logs")))
    svc.start()
    pids = svc.pids
    try:
        assert {svc.rpc_port, svc.http_port} <= listening_ports(pids)  # it answers on the ports it was given
        yield svc
    finally:
        held = listening_ports(pids)
        svc.stop()  # waits for each process to exit: their sockets are closed then
        assert not [p for p in pids if _alive(p)], "a Mooncake service process is still running"
        # Only the services' own sockets: the ports were free ones, released now, and any process of the machine
        # (the other lane's master, a server on port 0, an outgoing connection) may be given one of them again.
        assert not listening_ports(pids), f"a Mooncake service still listens (held before stop: {sorted(held)})"


def start_shared_host() -> Any:
    """The ``StageHost`` of conftest's session fixture ``shared_stage_host`` (started there, at its first use)."""
    require_mooncake()
    from omni_accum.bench.mooncake import StageHost

    return StageHost(pythonpath=[TESTS]).start()


@pytest.fixture(scope="module")
def stage_host(mooncake, shared_stage_host):
    """The test process's one stage host (conftest's ``shared_stage_host``), for a module with Mooncake services."""
    return shared_stage_host


class _Kept:
    """A stage host handed to a bench run as if the run had started it: ``start()`` and ``stop()`` leave it as it
    is (the test session ends it)."""

    def __init__(self, host: Any) -> None:
        self._host = host

    def start(self, timeout: float = 600.0) -> _Kept:
        return self

    def stop(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)


def bench_on_shared_host(request: Any, monkeypatch: Any) -> None:
    """Make the ``omni-accum bench --wire mooncake`` runs of this test fork their stage processes from the session's
    stage host instead of starting one of their own (a process importing vllm-omni: ~20 s of a busy core). Their
    stage processes get the host's environment (the test process's when the host started, ``tests/`` on
    ``PYTHONPATH``) and the bench's own job variables, not the environment of the moment: a test that needs its
    own variables there starts its own host (``tests/test_bench_json.py``)."""
    host = request.getfixturevalue("shared_stage_host")
    monkeypatch.setattr("omni_accum.bench.mooncake.StageHost", lambda *a, **k: _Kept(host))


# ---------------------------------------------------------------------------------------------- #
# Stage processes (run forked from the stage host)
# ---------------------------------------------------------------------------------------------- #

T2T = "vllm_omni.model_executor.stage_input_processors.qwen3_omni.thinker2talker_async_chunk"


DEPLOY = Path(TESTS).parent / "config" / "deploy" / "qwen3_omni_mooncake.yaml"


def deploy_connector(services: Any, *, keep_policy: bool = False) -> dict[str, Any]:
    """The talker's input connector of ``config/deploy/qwen3_omni_mooncake.yaml``, pointed at the test's master
    (addresses, ``segment: 0``: the holder owns the memory); its ``omni_accum_policy`` only with ``keep_policy``."""
    import yaml

    doc = yaml.safe_load(DEPLOY.read_text())
    (stage,) = [s for s in doc["stages"] if s["stage_id"] == 1]
    conn = doc["connectors"][stage["input_connectors"]["from_stage_0"]]
    extra = {**conn["extra"], **services.connector_extra()}
    if not keep_policy:
        extra.pop("omni_accum_policy")
    return {"name": conn["name"], "extra": extra}


def _adapter(stage_id: int, connector: dict[str, Any], next_func: str | None = None) -> Any:
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
        OmniChunkTransferAdapter,
    )

    mc = SimpleNamespace(
        worker_type="ar",
        max_num_seqs=8,
        stage_id=stage_id,
        async_chunk=True,
        stage_connector_config=connector,
        custom_process_next_stage_input_func=next_func,
        hf_config=SimpleNamespace(talker_config=SimpleNamespace(accept_hidden_layer=24)),
    )
    return OmniChunkTransferAdapter(SimpleNamespace(model_config=mc, scheduler_config=SimpleNamespace(max_num_seqs=8)))


def _load_plugins() -> dict[str, Any]:
    """vllm-omni's own plugin loading, as every vllm-omni process does it."""
    import vllm_omni.plugins

    from omni_accum.integrations import vllm_omni as integration

    before = integration.is_installed()
    vllm_omni.plugins.load_omni_general_plugins()
    return {"installed_before": before, "pid": os.getpid()}


def _installed() -> bool:
    from omni_accum.integrations import vllm_omni as integration

    return integration.is_installed()


def thinker_stage(*, pipes: Any, connector: dict[str, Any], rids: list[str], decode_steps: int) -> dict[str, Any]:
    """Stage 0: vllm-omni's thinker -> talker processor on synthetic thinker outputs, several requests interleaved."""
    from test_integration_vllm_omni import _request, _thinker_steps, _wait

    for fd in (fd for p in pipes for fd in p):
        os.close(fd)
    info = _load_plugins()
    tx = _adapter(0, connector, next_func=T2T)
    info["installed"] = _installed()
    if info["installed"]:
        _wait_for_talker(tx)
    steps = {rid: _thinker_steps(seed=n, decode_steps=decode_steps) for n, rid in enumerate(rids)}
    out_ids: dict[str, list[int]] = {rid: [] for rid in rids}
    sent = 0
    n = len(next(iter(steps.values())))
    try:
        for i in range(n):
            last = i == n - 1
            for rid in rids:
                if i >= 3:
                    out_ids[rid].append(1000 + i)
                tx.save_async(multimodal_output=steps[rid][i], request=_request(rid, out_ids[rid], finished=last))
            if i >= 3:
                sent += 1
                for rid in rids:
                    _wait(
                        lambda r=rid: tx.put_req_chunk.get(r, 0) >= sent or (last and r not in tx.put_req_chunk),
                        f"put {rid} #{sent}",
                        timeout=120.0,
                    )
        expected = sent * len(rids)  # the last put may still be in the save thread when put_req_chunk is cleared
        _wait(
            lambda: tx.connector.health()["puts"] + tx.connector.health()["errors"] >= expected,
            "last puts",
            timeout=120.0,
        )
        health = tx.connector.health()
        b = getattr(tx, "_omni_accum_binding", None)
        info.update(
            connector=type(tx.connector).__name__,
            bytes=health["bytes_transferred"],
            puts=health["puts"],
            errors=health["errors"],
            omitted=b.stats["omitted"] if b is not None else 0,
            binding_wire_bytes=b.stats["wire_bytes"] if b is not None else None,
        )
        for rid in rids:
            tx.cleanup("int-" + rid, rid)
    finally:
        tx.shutdown()
    return info


def _wait_for_talker(tx: Any) -> None:
    """A server takes requests once every stage is up; here the thinker starts once the talker's adapter has
    said hello through the store (the peer hello: before it, the thinker would send 0.30.0's payloads)."""
    from test_integration_vllm_omni import _wait

    from omni_accum.integrations.vllm_omni.peer import hello_key

    _wait(lambda: tx.connector.get("0", "1", hello_key(0, 1)) is not None, "the talker's hello", timeout=120.0)
    if _installed():  # and the thinker's binding has heard it (its first look waits 50 ms: a loaded host misses that)
        from omni_accum.integrations.vllm_omni import peer
        from omni_accum.integrations.vllm_omni.binding import binding_for

        b = binding_for(tx)
        if b is not None:
            peer.watch(b, tx.connector)
            if b.__dict__.get("_peer") is not None:
                _wait(b._peer.ready, "the thinker's binding to hear the talker's hello", timeout=120.0)


def talker_stage(*, pipes: Any, connector: dict[str, Any], rids: list[str], chunks: int) -> dict[str, Any]:
    """Stage 1: the AR talker's receiving adapter; every hand-over (the consumer's view), per request."""
    from test_integration_vllm_omni import _receive_and_hand_over, _request

    for fd in (fd for p in pipes for fd in p):
        os.close(fd)
    info = _load_plugins()
    rx = _adapter(1, connector)
    info["installed"] = _installed()
    reqs = {rid: _request(rid, [], internal="rx-" + rid) for rid in rids}
    handed: dict[str, list[Any]] = {rid: [] for rid in rids}
    try:
        for _ in range(chunks):
            for rid in rids:
                handed[rid].append(_receive_and_hand_over_patient(rx, reqs[rid], _receive_and_hand_over))
        b = getattr(rx, "_omni_accum_binding", None)
        info.update(handed=handed, active=b.receiver.active_requests if b is not None else None)
        for rid in rids:
            rx.cleanup(reqs[rid].request_id, rid)
        if b is not None:
            info["active_after_cleanup"] = b.receiver.active_requests
    finally:
        rx.shutdown()
    return info


def _receive_and_hand_over_patient(rx: Any, rreq: Any, receive: Any) -> Any:
    """The test module's one scheduler step, with a longer wait: the sender is another process."""
    import test_integration_vllm_omni as t

    wait = t._wait
    t._wait = lambda cond, what, timeout=120.0: wait(cond, what, timeout=120.0)
    try:
        return receive(rx, rreq)
    finally:
        t._wait = wait
