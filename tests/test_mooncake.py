"""Stages in separate OS processes over Mooncake (vllm-omni 0.30.0's ``MooncakeStoreConnector``), real services.

A master and a holder process own the store (``mooncake`` fixture); the stage processes have no
segment of their own, so every chunk crosses TCP. The thinker stage and the talker stage are two
processes forked from one host that imported vllm-omni; each installs omni-accum only through vllm-omni's
plugin loading (``load_omni_general_plugins()`` with ``OMNI_ACCUM_POLICY``), as a deployment does.
"""

from __future__ import annotations

import os

import pytest

from mooncake_fixtures import *  # noqa: F403 - the fixtures (mooncake, stage_host)
from mooncake_fixtures import deploy_connector
from test_integration_vllm_omni import D, P, assert_same

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

DECODE = 5
RIDS = 3
DELTA_POLICY = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "mooncake", "qwen3-omni-delta.yaml")


def _run(stage_host, mooncake, label: str, env: dict[str, str], keep_policy: bool = False) -> tuple[dict, dict]:
    from omni_accum.bench.mooncake import Job

    rids = [f"mc-{label}-{os.getpid()}-{n}" for n in range(RIDS)]
    connector = deploy_connector(mooncake, keep_policy=keep_policy)
    assert connector["name"] == "MooncakeStoreConnector"
    # both stage processes of one deployment share its token, as those a server starts inherit it (peer hello)
    base_env = {"OMNI_ACCUM_VLLM_OMNI": "1", "OMNI_ACCUM_POLICY": "", "OMNI_ACCUM_METRICS": "0",
                "OMNI_ACCUM_DEPLOYMENT": f"mc-{label}-{os.getpid()}"}  # fmt: skip
    jobs = [
        Job(
            "mooncake_fixtures:thinker_stage",
            {"connector": connector, "rids": rids, "decode_steps": DECODE},
            {**base_env, **env},
        ),
        Job(
            "mooncake_fixtures:talker_stage",
            {"connector": connector, "rids": rids, "chunks": DECODE},
            {**base_env, **env},
        ),
    ]
    tx, rx = stage_host.run(jobs, timeout=300)
    assert tx["pid"] != rx["pid"] != os.getpid()  # two stage processes, neither of them the test's
    assert tx["connector"] == "MooncakeStoreConnector" and tx["errors"] == 0
    assert tx["puts"] == RIDS * DECODE
    rx["handed"] = {rid.split("-", 3)[-1]: v for rid, v in rx["handed"].items()}  # by request number
    return tx, rx


@pytest.fixture(scope="module")
def upstream(stage_host, mooncake):
    """vllm-omni 0.30.0 alone (``OMNI_ACCUM_VLLM_OMNI=0``): the views and the bytes to compare with."""
    tx, rx = _run(stage_host, mooncake, "up", {"OMNI_ACCUM_VLLM_OMNI": "0", "OMNI_ACCUM_POLICY": "qwen3-omni"})
    assert not tx["installed"] and not rx["installed"]
    return tx, rx


def test_compat_is_what_makes_the_connector_work(stage_host, mooncake):
    """Without the compatibility step vllm-omni 0.30.0's connector cannot be built on Mooncake 0.3.13.post1
    (and the chunk adapter cannot read its stage id); with it, a put and a get cross the store."""
    from omni_accum.bench.mooncake import Job

    (out,) = stage_host.run([Job("test_mooncake:_compat_probe", {"extra": mooncake.connector_extra()})], pipes=0)
    assert "with_soft_pin" in out["without"], out
    assert out["stage_id_without"] is False
    assert out["with"] == {"put": True, "got": [1, 2, 3], "stage_id": 1, "soft_pin": True}


def _compat_probe(*, pipes, extra):
    import torch

    from omni_accum.bench.mooncake import make_connector
    from omni_accum.integrations.vllm_omni import mooncake_compat

    mooncake_compat.remove()
    from vllm_omni.distributed.omni_connectors.connectors.mooncake_store_connector import MooncakeStoreConnector

    out = {"stage_id_without": hasattr(MooncakeStoreConnector, "stage_id")}
    try:
        MooncakeStoreConnector({**extra, "stage_id": 1}).close()
        out["without"] = "constructed"
    except AttributeError as e:
        out["without"] = str(e)
    conn = make_connector(1, extra)  # applies the compatibility step, then vllm-omni's own factory
    try:
        ok, size, _ = conn.put("0", "1", f"probe-{os.getpid()}", {"x": torch.tensor([1, 2, 3])})
        got, n = conn.get("0", "1", f"probe-{os.getpid()}")
        out["with"] = {
            "put": ok and size == n,
            "got": got["x"].tolist(),
            "stage_id": conn.stage_id,
            "soft_pin": conn.pin.with_soft_pin,
        }
    finally:
        conn.close()
    return out


def test_upstream_stream_crosses(upstream):
    _, rx = upstream
    h = rx["handed"]["0"]
    assert len(rx["handed"]) == RIDS and all(len(v) == DECODE for v in rx["handed"].values())
    assert h[0]["embed"]["prefill"].shape == (P + 1, D)
    assert all(x["embed"]["decode"].shape == (1, D) for x in h[1:])


@pytest.mark.parametrize(
    "label,policy,fewer",
    [
        ("def", "default", False),
        ("q3", "qwen3-omni", True),
        # delta: views equal; on this short stream (3 requests, a few steps) its suffix-only ids save fewer
        # bytes than each request's handshake marker costs, so bytes are not compared here
        ("delta", DELTA_POLICY, None),
    ],
)
def test_views_equal_upstream_through_the_store(stage_host, mooncake, upstream, label, policy, fewer):
    up_tx, up_rx = upstream
    tx, rx = _run(stage_host, mooncake, label, {"OMNI_ACCUM_POLICY": policy})
    assert not tx["installed_before"] and tx["installed"] and rx["installed"]  # through the entry point
    if fewer:
        assert tx["omitted"] > 0
        assert tx["bytes"] < up_tx["bytes"], (tx["bytes"], up_tx["bytes"])
    elif fewer is None:
        assert tx["omitted"] > 0
    else:
        assert tx["omitted"] == 0 and tx["bytes"] == up_tx["bytes"]
    assert tx["binding_wire_bytes"] == tx["bytes"]  # the connector's put results are what the binding counted
    assert_same(rx["handed"], up_rx["handed"], "handed")  # bit for bit, every request, every step
    assert rx["active_after_cleanup"] == 0


def test_policy_from_the_deploy_fragment(stage_host, mooncake, upstream):
    """No OMNI_ACCUM_POLICY: the fragment's ``omni_accum_policy: qwen3-omni`` (connector extra) turns it on."""
    up_tx, up_rx = upstream
    tx, rx = _run(stage_host, mooncake, "yaml", {"OMNI_ACCUM_POLICY": ""}, keep_policy=True)
    assert not tx["installed_before"] and tx["installed"] and rx["installed"]
    assert tx["omitted"] > 0 and tx["bytes"] < up_tx["bytes"]
    assert_same(rx["handed"], up_rx["handed"], "handed")


def test_bench_pair_through_the_store(stage_host, mooncake):
    """The bench's process pair: every arm's views equal the cat reference, the preset ships fewer bytes on the
    override-ids workload (send_once constants), delta fewer still (cumulative ids)."""
    from omni_accum.bench.arms import build_arms
    from omni_accum.bench.mooncake import measure_mooncake
    from omni_accum.bench.workloads import load_workload

    wl = load_workload("qwen3-omni-override-ids").model_copy(update={"decode_steps": 60})
    arms = build_arms(wl, ["upstream", "qwen3-omni", DELTA_POLICY])
    res, store = measure_mooncake(
        stage_host, mooncake, wl, arms, context_len=64, concurrency=2, repeats=1, warmup=False
    )
    assert [r.correct for r in res] == [True, True, True], [r.mismatch for r in res]
    up, q3, dl = (s.store_bytes_per_request for s in store)
    assert dl < q3 < up, (up, q3, dl)
    assert all(s.failed_puts == 0 and s.puts == 2 * wl.n_chunks(64) for s in store)
    assert all(len(r.samples_us[0]) == 2 * wl.n_chunks(64) for r in res)


def test_store_keeps_what_0_30_0_leaves(stage_host):
    """Occupancy: nothing is removed (0.30.0's cleanup() is a no-op), so the segment fills request after request;
    then the master evicts soft-pinned objects or refuses puts. What a request leaves is the bytes it put."""
    from omni_accum.bench.arms import build_arms
    from omni_accum.bench.mooncake import occupancy
    from omni_accum.bench.workloads import load_workload

    wl = load_workload("qwen3-omni-override-ids").model_copy(update={"decode_steps": 4})
    arms = build_arms(wl, ["upstream", "qwen3-omni"])
    occ = occupancy(stage_host, wl, arms, context_len=1000, requests=8, segment_bytes=32 << 20)
    for o in occ:
        first = min(x for x in (o.first_failure, o.first_eviction, len(o.rows) + 1) if x)
        allocated = [r["allocated"] for r in o.rows[: first - 1]]
        assert allocated and allocated == sorted(allocated) and allocated[0] > 0  # until then it only grows
        assert o.pinned_bytes_per_request >= o.put_bytes_per_request * 0.99
        assert (o.first_failure or o.first_eviction) is not None  # 8 x ~8 MB do not fit in 32 MiB
    up, q3 = occ
    assert q3.put_bytes_per_request < up.put_bytes_per_request
