"""Metrics, status and activation switches of the vllm-omni integration (real classes, CPU)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from importlib.metadata import version

import pytest
import torch

pytestmark = pytest.mark.vllm


def _sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_exact_metric_values_for_a_known_stream(vo):
    from omni_accum.integrations.vllm_omni.binding import Binding
    from omni_accum.integrations.vllm_omni.binding_settings import DEFAULT_ADAPTER_KEYS
    from omni_accum.integrations.vllm_omni.send import encode_payload
    from omni_accum.policy import load_policy

    b = Binding(load_policy("qwen3-omni"), DEFAULT_ADAPTER_KEYS, "test")
    bos = torch.ones(1, 1, 64, dtype=torch.bfloat16)
    dec = b.strategy_name("embed.decode", torch.zeros(1))
    once = b.strategy_name("embed.tts_bos", bos)
    assert once == "send_once"
    before = {
        "dec": _sample("omni_accum_chunks_total", role="send", key="embed.decode", strategy=dec),
        "bos": _sample("omni_accum_chunks_total", role="send", key="embed.tts_bos", strategy=once),
        "saved": _sample("omni_accum_wire_bytes_saved_total", key="embed.tts_bos", strategy=once),
        "wire": _sample("omni_accum_wire_bytes_total", role="send", key="embed.decode"),
        "req": _sample("omni_accum_requests_total", role="send", context_bucket="none", concurrency_bucket="none"),
    }
    for i in range(3):
        chunk = {"embed": {"decode": torch.full((1, 32), float(i), dtype=torch.bfloat16), "tts_bos": bos}}
        encode_payload(b, "m-1", chunk)
    b.publish()
    assert _sample("omni_accum_chunks_total", role="send", key="embed.decode", strategy=dec) - before["dec"] == 3
    assert _sample("omni_accum_chunks_total", role="send", key="embed.tts_bos", strategy=once) - before["bos"] == 1
    assert _sample("omni_accum_wire_bytes_saved_total", key="embed.tts_bos", strategy=once) - before["saved"] == 2 * 128
    assert _sample("omni_accum_wire_bytes_total", role="send", key="embed.decode") - before["wire"] == 3 * 64
    assert (
        _sample("omni_accum_requests_total", role="send", context_bucket="none", concurrency_bucket="none")
        - before["req"]
        == 1
    )
    assert _sample("omni_accum_policy_info", source="test", fingerprint=b.fingerprint, version=_version()) == 1


def test_the_full_payload_accumulator_is_metered(vo, runner):
    """async_chunk off: each step the producing stage accumulates counts under role ``accumulate``, its
    time goes into the merge histogram, and the counts reach Prometheus when the payload is handed over."""
    vo.install("qwen3-omni")
    r = runner()
    r.accumulate_full_payload_output("warm", {"embed.prefill": torch.zeros(1, 8)}, "REQ")  # binds the runner
    r._materialize_full_payload_entry(r._pending_full_payload_send.pop("warm"))
    b = r._omni_accum_binding
    pre = b.strategy_name("embed.prefill", torch.zeros(2, 8))
    audio = b.strategy_name("codes.audio", torch.zeros(1, 4))
    keys = {
        "pre": ("omni_accum_chunks_total", dict(role="accumulate", key="embed.prefill", strategy=pre)),
        "audio": ("omni_accum_chunks_total", dict(role="accumulate", key="codes.audio", strategy=audio)),
        "wire": ("omni_accum_wire_bytes_total", dict(role="accumulate", key="embed.prefill")),
        "req": ("omni_accum_requests_total", dict(role="accumulate", context_bucket="none", concurrency_bucket="none")),
        "merges": ("omni_accum_merge_seconds_count", dict(strategy=pre)),
    }
    before = {k: _sample(name, **labels) for k, (name, labels) in keys.items()}
    steps = [
        {"embed.prefill": torch.zeros(5, 8), "codes.audio": torch.zeros(1, 4, dtype=torch.long)},  # 160 B
        {"embed.prefill": torch.zeros(1, 8), "codes.audio": torch.zeros(1, 4, dtype=torch.long)},  # 32 B
        {"embed.prefill": torch.zeros(2, 8)},  # 64 B
    ]
    for step in steps:
        r.accumulate_full_payload_output("fp-1", dict(step), "REQ")
    assert _sample(*keys["pre"][:1], **keys["pre"][1]) == before["pre"]  # published when handed over
    r._materialize_full_payload_entry(r._pending_full_payload_send.pop("fp-1"))
    got = {k: _sample(name, **labels) - before[k] for k, (name, labels) in keys.items()}
    assert got == {"pre": 3, "audio": 2, "wire": (5 + 1 + 2) * 8 * 4, "req": 1, "merges": 3}


def _version() -> str:
    from omni_accum import __version__

    return __version__


def test_metrics_off_records_nothing(vo, monkeypatch):
    from omni_accum.integrations.vllm_omni.binding import Binding
    from omni_accum.integrations.vllm_omni.binding_settings import DEFAULT_ADAPTER_KEYS
    from omni_accum.integrations.vllm_omni.send import encode_payload
    from omni_accum.policy import load_policy

    monkeypatch.setenv("OMNI_ACCUM_METRICS", "0")
    b = Binding(load_policy("qwen3-omni"), DEFAULT_ADAPTER_KEYS, "off-test")
    assert not b.metrics.on
    key = dict(role="send", key="embed.decode", strategy=b.strategy_name("embed.decode", torch.zeros(1)))
    before = _sample("omni_accum_chunks_total", **key)
    encode_payload(b, "m-off", {"embed": {"decode": torch.zeros(1, 8)}})
    b.publish()
    assert _sample("omni_accum_chunks_total", **key) == before


_CHILD = """
import sys
import torch
from omni_accum.integrations.vllm_omni import metrics
r = metrics.Recorder()
assert r.on
row = torch.zeros(1, 2048, dtype=torch.bfloat16)  # 4096 bytes
for _ in range(int(sys.argv[1])):
    r.received({"embed": {"decode": row}}, 1e-5, lambda path, value: "prealloc", ())
r.flush()
"""


def test_two_processes_collected_together_in_multiprocess_mode(tmp_path):
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for n in (3, 4):
        subprocess.run([sys.executable, "-c", _CHILD, str(n)], env=env, check=True, timeout=600)
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(tmp_path))
    labels = {"role": "receive", "key": "embed.decode", "strategy": "prealloc"}
    assert reg.get_sample_value("omni_accum_chunks_total", labels) == 7
    assert reg.get_sample_value("omni_accum_wire_bytes_total", {"role": "receive", "key": "embed.decode"}) == 7 * 4096


def test_status_is_a_typed_record(vo, adapters):
    from tests.test_integration_vllm_omni import run_thinker_to_talker

    st = vo.status()
    assert isinstance(st, vo.Status) and not st.installed and st.bindings == ()
    assert st.vllm_omni_version == version("vllm-omni")  # the installed release (0.30.0, or 0.28.0 in .venv-028)
    vo.install("qwen3-omni")
    run_thinker_to_talker(adapters, f"oa-st-{os.getpid()}")
    st = vo.status()
    assert st.installed and st.policy_source == "qwen3-omni" and st.fingerprint
    owners = sorted(b.owner for b in st.bindings)
    assert owners == ["OmniChunkTransferAdapter", "OmniChunkTransferAdapter"]
    assert sum(b.chunks_sent for b in st.bindings) == 6 and sum(b.chunks_received for b in st.bindings) == 6
    assert all(b.fingerprint == st.fingerprint for b in st.bindings)  # every binding runs the installed policy
    assert st.live_requests == 0


def test_required_makes_a_failed_activation_fatal(vo, monkeypatch):
    monkeypatch.setenv("OMNI_ACCUM_POLICY", "no-such-preset")
    monkeypatch.setenv("OMNI_ACCUM_REQUIRED", "1")
    with pytest.raises(SystemExit, match="OMNI_ACCUM_REQUIRED=1 and activation failed.*no-such-preset"):
        vo.activate()
    assert not vo.is_installed()
    monkeypatch.delenv("OMNI_ACCUM_REQUIRED")
    vo.activate()  # without it: logged, vllm-omni carries on unpatched
    assert not vo.is_installed()


def test_policy_off_in_the_environment(vo, monkeypatch, caplog):
    monkeypatch.setenv("OMNI_ACCUM_POLICY", "off")
    with caplog.at_level(logging.INFO, logger="omni_accum"):
        vo.activate()
    assert not vo.is_installed()
    assert any("OMNI_ACCUM_POLICY=off" in m for m in caplog.messages), caplog.messages


@pytest.mark.parametrize(
    ("context_env", "context_words"),
    [({}, "context unused (no tuned table)"),
     ({"OMNI_ACCUM_CONTEXT_LEN": "8k", "OMNI_ACCUM_CONCURRENCY": "4"},
      "deployment context 8000 tokens x 4 from OMNI_ACCUM_CONTEXT_LEN=8k, OMNI_ACCUM_CONCURRENCY=4")],
)
def test_the_activation_line_names_source_fingerprint_per_key_choices_and_context(
    vo, monkeypatch, caplog, context_env, context_words
):
    from omni_accum.integrations.vllm_omni.binding import policy_fingerprint
    from omni_accum.integrations.vllm_omni.binding_settings import Settings

    monkeypatch.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    for k in ("OMNI_ACCUM_CONTEXT_LEN", "OMNI_ACCUM_CONCURRENCY"):
        monkeypatch.delenv(k, raising=False)
    for k, v in context_env.items():
        monkeypatch.setenv(k, v)
    with caplog.at_level(logging.INFO, logger="omni_accum"):
        vo.activate()
    assert vo.is_installed()
    (line,) = [m for m in caplog.messages if "omni-accum installed into vllm-omni" in m]
    assert "policy from OMNI_ACCUM_POLICY" in line and policy_fingerprint(Settings.policy) in line
    assert "default cat" in line and "embed.decode -> prealloc" in line and "speaker -> send_once" in line, line
    assert context_words in line, line


def test_a_tuned_policys_activation_line_says_the_sender_decides_per_request(vo, monkeypatch, caplog, tmp_path):
    import json

    from tests.test_integration_vllm_omni_handshake import _tuned

    tuned = _tuned("thinker_embeddings", "prealloc", "prealloc")["tuned"]
    (tmp_path / "t.json").write_text(json.dumps({"tuned": tuned}))
    monkeypatch.setenv("OMNI_ACCUM_POLICY", str(tmp_path / "t.json"))
    for k in ("OMNI_ACCUM_CONTEXT_LEN", "OMNI_ACCUM_CONCURRENCY"):
        monkeypatch.delenv(k, raising=False)
    with caplog.at_level(logging.INFO, logger="omni_accum"):
        vo.activate()
    (line,) = [m for m in caplog.messages if "omni-accum installed into vllm-omni" in m]
    assert "rules none, tuned table of 2x1 buckets (2 cells)" in line, line
    assert "context per request (the sending stage decides each request's bucket)" in line, line


def test_policy_info_names_the_policy_an_operator_set(vo, monkeypatch):
    # A binding of the process-wide policy labels omni_accum_policy_info with where that policy came
    # from, as the operator wrote it (not the internal "install()").
    from omni_accum.integrations.vllm_omni.binding import Binding
    from omni_accum.integrations.vllm_omni.binding_settings import DEFAULT_ADAPTER_KEYS, Settings

    monkeypatch.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    vo.activate()
    assert vo.is_installed()
    b = Binding(Settings.policy, DEFAULT_ADAPTER_KEYS, "install()")
    labels = dict(fingerprint=b.fingerprint, version=_version())
    assert _sample("omni_accum_policy_info", source="OMNI_ACCUM_POLICY=qwen3-omni", **labels) == 1
    assert _sample("omni_accum_policy_info", source="install()", **labels) == 0
    vo.uninstall()
    vo.install("qwen3-omni-flat")
    b = Binding(Settings.policy, DEFAULT_ADAPTER_KEYS, "install()")
    assert (
        _sample("omni_accum_policy_info", source="qwen3-omni-flat", fingerprint=b.fingerprint, version=_version()) == 1
    )


def _by_key(role: str) -> dict[tuple[str, str], float]:
    """``{(metric, key): value}`` of the per-key counters of ``role`` (chunks summed over strategies)."""
    from prometheus_client import REGISTRY

    out: dict[tuple[str, str], float] = {}
    for fam in REGISTRY.collect():
        if fam.name not in ("omni_accum_chunks", "omni_accum_wire_bytes"):
            continue
        for s in fam.samples:
            if s.name.endswith("_total") and s.labels.get("role") == role:
                k = (fam.name, s.labels["key"])
                out[k] = out.get(k, 0.0) + s.value
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def test_receive_hooks_count_every_key_once_as_sent(vo, adapters):
    """The adapter receive hook counts in its own pass over the chunk (the merge it runs does not count
    again): per key, the receiving side counts exactly the chunks and bytes the sending side put, and
    one merge-time observation per chunk."""
    from prometheus_client import REGISTRY

    from tests.test_integration_vllm_omni import run_thinker_to_talker

    vo.install("qwen3-omni")
    merges = lambda: sum(  # noqa: E731
        s.value for s in REGISTRY.collect() for s in s.samples if s.name == "omni_accum_merge_seconds_count"
    )
    tx0, rx0, m0 = _by_key("send"), _by_key("receive"), merges()
    handed, _, (tx, rx) = run_thinker_to_talker(adapters, f"oa-metrics-{os.getpid()}")
    tx._omni_accum_binding.publish()
    rx._omni_accum_binding.publish()
    sent, got = _delta(_by_key("send"), tx0), _delta(_by_key("receive"), rx0)
    assert sent and got == sent
    assert merges() - m0 == len(handed) == rx._omni_accum_binding.stats["chunks_received"]


def test_runner_hook_counts_in_the_merge_pass(vo, runner):
    """The runner transport's hook lets the merge count each key (Receiver.on_merge): exact counts and
    bytes per key and strategy, a chunk refused and handed to 0.30.0's code counts as a fallback only."""
    from omni_accum.integrations.vllm_omni.binding import Binding
    from omni_accum.integrations.vllm_omni.binding_settings import DEFAULT_ADAPTER_KEYS
    from omni_accum.integrations.vllm_omni.send import encode_payload
    from omni_accum.policy import load_policy

    policy = load_policy("qwen3-omni")
    vo.install(policy)
    tx = Binding(policy, DEFAULT_ADAPTER_KEYS, "test")
    r = runner()
    rid = f"oa-run-{os.getpid()}"
    bos = torch.ones(1, 1, 64, dtype=torch.bfloat16)
    r._accumulate_payload("warm", encode_payload(tx, "warm", {"embed": {"decode": torch.zeros(1, 32)}}))
    b = r._omni_accum_binding
    dec = b.strategy_name("embed.decode", torch.zeros(1, 32, dtype=torch.bfloat16))
    b.publish()  # the warm-up chunk's counts
    before = _by_key("receive")
    fb0 = _sample("omni_accum_fallbacks_total", reason="refused_chunk")
    for i in range(4):
        chunk = {"embed": {"decode": torch.full((2, 32), float(i), dtype=torch.bfloat16), "tts_bos": bos}}
        chunk["meta"] = {"finished": torch.tensor(i == 3)}
        r._accumulate_payload(rid, encode_payload(tx, rid, chunk))
    # the merge's own pass counted (the engine slot holds its metrics slot), not a second walk
    assert b.receiver.on_merge == b.metrics.merged
    assert b.receiver._lookup(rid).entries["embed"]["decode"].meter[0] >= 4
    bad = {"embed": {"decode": torch.zeros(1, 32, dtype=torch.float32)}}  # a dtype change: refused
    r._accumulate_payload(rid, bad)
    b.publish()
    got = _delta(_by_key("receive"), before)
    assert got == {
        ("omni_accum_chunks", "embed.decode"): 4,
        ("omni_accum_wire_bytes", "embed.decode"): 4 * 2 * 32 * 2,
        ("omni_accum_chunks", "embed.tts_bos"): 1,  # left off the wire after the first chunk
        ("omni_accum_wire_bytes", "embed.tts_bos"): 128,
        ("omni_accum_chunks", "meta.finished"): 4,
        ("omni_accum_wire_bytes", "meta.finished"): 4,
    }
    assert _sample("omni_accum_chunks_total", role="receive", key="embed.decode", strategy=dec) >= 4
    assert _sample("omni_accum_fallbacks_total", reason="refused_chunk") - fb0 == 1


def test_adapter_hook_counts_a_refused_chunk_once_and_never_the_reseed(vo, adapters):
    """The adapter's receive hook: a chunk refused after its pass counted the keys is counted once; one
    refused before that pass (a mask naming keys this receiver never got) is counted by the hook's walk,
    as it came; the fallback's re-seeding merge is never counted (real OmniChunkTransferAdapter)."""
    from omni_accum.integrations.vllm_omni.marker import OMITTED_KEY
    from tests.test_integration_vllm_omni import _request

    vo.install("qwen3-omni")
    rx = adapters(1)
    rid = f"oa-refuse-{os.getpid()}"
    req = _request(rid, [], internal=rid)

    def commit(payload: dict, i: int) -> None:
        rx._commit_received_chunk(req, (payload, 0), stage_id=0, req_id=rid, chunk_id=i, connector_get_key=f"k{i}")

    row = lambda v, dt=torch.bfloat16: torch.full((2, 16), float(v), dtype=dt)  # noqa: E731
    first = {"embed": {"prefill": row(0)}, "meta": {"finished": torch.tensor(False)}}
    commit(first, 0)  # binds the adapter; a sender without a hello: counted by the walk
    b = rx._omni_accum_binding
    b.publish()
    before = _by_key("receive")
    fb0 = _sample("omni_accum_fallbacks_total", reason="refused_chunk")
    commit({"embed": {"prefill": row(1)}, "meta": {"finished": torch.tensor(False)}}, 1)  # accepted
    commit({"embed": {"prefill": row(2, torch.float32)}}, 2)  # dtype change: refused in the merge
    commit({"embed": {"prefill": row(3)}, OMITTED_KEY: 1 << 9}, 3)  # a mask beyond the keys: refused first
    b.publish()
    got = _delta(_by_key("receive"), before)
    assert got == {
        ("omni_accum_chunks", "embed.prefill"): 3,
        ("omni_accum_wire_bytes", "embed.prefill"): 2 * 16 * 2 + 2 * 16 * 4 + 2 * 16 * 2,
        ("omni_accum_chunks", "meta.finished"): 1,
        ("omni_accum_wire_bytes", "meta.finished"): 1,
    }, got
    assert _sample("omni_accum_fallbacks_total", reason="refused_chunk") - fb0 == 2


def test_a_release_publishes_on_a_thread_of_its_own_not_under_the_adapters_lock(vo, adapters, monkeypatch):
    """vllm-omni 0.30.0 calls the release hooks under the adapter's state locks, which its receiving and
    saving threads take for every chunk: publishing there (every binding's held bytes, Prometheus, the
    status file) held them up. A release marks its binding; the publisher thread publishes it."""
    import threading

    from omni_accum.integrations.vllm_omni import binding as binding_mod

    from tests.test_integration_vllm_omni import run_thinker_to_talker

    vo.install("qwen3-omni")
    threads: list[str] = []
    published = threading.Event()
    real = binding_mod.Binding.publish

    def publish(self):
        threads.append(threading.current_thread().name)
        real(self)
        published.set()

    monkeypatch.setattr(binding_mod.Binding, "publish", publish)
    before = _sample("omni_accum_requests_total", role="send", context_bucket="none", concurrency_bucket="none")
    handed, _, (tx, rx) = run_thinker_to_talker(adapters, f"oa-publisher-{os.getpid()}")
    assert handed and tx._omni_accum_binding.sender.active_requests == 0  # released at cleanup
    assert rx._omni_accum_binding.receiver.active_requests == 0
    assert published.wait(60), "no release was published"  # a hang guard, not a timing
    assert set(threads) == {"omni-accum-publish"}  # never on the thread that released (it holds the adapter's lock)
    binding_mod.publish_pending()  # returns once any publish under way is done, and publishes what is left
    after = _sample("omni_accum_requests_total", role="send", context_bucket="none", concurrency_bucket="none")
    assert after - before == 1  # what the sender counted reached Prometheus, once


def test_held_bytes_and_active_requests_gauges_follow_the_live_requests(vo, runner):
    """The per-process gauges: bytes the Receivers of this process hold and their live requests, set at each
    publish, back to zero once upstream released the requests."""
    from omni_accum.integrations.vllm_omni.binding import Binding, publish_pending
    from omni_accum.integrations.vllm_omni.binding_settings import DEFAULT_ADAPTER_KEYS
    from omni_accum.integrations.vllm_omni.send import encode_payload
    from omni_accum.policy import load_policy

    policy = load_policy("qwen3-omni")
    vo.install(policy)
    tx = Binding(policy, DEFAULT_ADAPTER_KEYS, "test")
    r = runner()
    rids = [f"oa-gauge-{n}-{os.getpid()}" for n in range(2)]
    for n, rid in enumerate(rids):
        for i in range(3):
            step = torch.full((1 + n, 32), float(i), dtype=torch.bfloat16)
            r._accumulate_payload(rid, encode_payload(tx, rid, {"embed": {"decode": step}}))
    b = r._omni_accum_binding
    b.publish()
    held = b.receiver.nbytes()
    assert held >= (3 * 1 + 3 * 2) * 32 * 2  # the decode rows of both requests, at least
    assert _sample("omni_accum_held_bytes") == held
    assert _sample("omni_accum_active_requests", role="receive") == 2
    r._send_side_request_payload.pop(rids[0])  # upstream releases one
    publish_pending()
    assert _sample("omni_accum_active_requests", role="receive") == 1
    assert 0 < _sample("omni_accum_held_bytes") < held
    r._send_side_request_payload.pop(rids[1])
    publish_pending()
    assert _sample("omni_accum_active_requests", role="receive") == 0
    assert _sample("omni_accum_held_bytes") == 0


_EXIT_CHILD = """
import torch
from omni_accum.integrations.vllm_omni.binding import Binding
from omni_accum.integrations.vllm_omni.binding_settings import DEFAULT_ADAPTER_KEYS
from omni_accum.integrations.vllm_omni.send import encode_payload
from omni_accum.policy import load_policy
b = Binding(load_policy("qwen3-omni"), DEFAULT_ADAPTER_KEYS, "test")
for i in range(5):  # a request never released (the server stops): no release publishes it, nor a 256th chunk
    encode_payload(b, "live-at-exit", {"embed": {"decode": torch.full((1, 32), float(i), dtype=torch.bfloat16)}})
"""  # then a normal exit: atexit


def test_counts_of_a_request_still_live_reach_prometheus_at_exit(tmp_path):
    """At exit only the bindings a release had marked were published: a request live at exit (SIGTERM at shutdown)
    left no omni_accum_chunks_total / wire / requests sample at all in the multiprocess folder."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", _EXIT_CHILD], env=env, check=True, timeout=600)
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(tmp_path))
    chunks = {
        s.labels["key"]: s.value
        for fam in reg.collect()
        if fam.name == "omni_accum_chunks"
        for s in fam.samples
        if s.name == "omni_accum_chunks_total" and s.labels["role"] == "send"
    }
    assert chunks.get("embed.decode") == 5, chunks
    assert reg.get_sample_value("omni_accum_wire_bytes_total", {"role": "send", "key": "embed.decode"}) == 5 * 64
    labels = {"role": "send", "context_bucket": "none", "concurrency_bucket": "none"}
    assert reg.get_sample_value("omni_accum_requests_total", labels) == 1


def _stream_live(tx, rx, rid: str, decode_steps: int = 3) -> int:
    """Thinker adapter ``tx`` -> talker adapter ``rx``: the prefill and ``decode_steps`` decode chunks of request
    ``rid``, never its last (the request stays live: not finished, not released); the chunks received."""
    from tests.test_integration_vllm_omni import _receive_and_hand_over, _request, _thinker_steps, _wait

    rreq = _request(rid, [], internal="rx-" + rid)
    out_ids: list[int] = []
    sent = 0
    for i, mm in enumerate(_thinker_steps(decode_steps=decode_steps + 1)[:-1]):  # never the finished step
        if i >= 3:
            out_ids.append(1000 + i)
        tx.save_async(multimodal_output=mm, request=_request(rid, out_ids))
        if i < 3:
            continue  # prefill rows stashed by the processor, nothing put
        sent += 1
        _wait(lambda: tx.put_req_chunk.get(rid, 0) >= sent, "put")
        _receive_and_hand_over(rx, rreq)
    return sent


def test_uninstall_publishes_the_counts_of_requests_still_live(vo, adapters):
    """uninstall() released every binding's state without publishing it: the chunks of a request still live (no
    release came, fewer than 256 chunks) never reached Prometheus. Real adapters."""
    from omni_accum.integrations.vllm_omni import publishing
    from tests.test_integration_vllm_omni import T2T, _hear

    vo.install("qwen3-omni")
    tx, rx = adapters(0, next_func=T2T), adapters(1)
    _hear(tx)
    publishing.publish_pending()
    tx0, rx0 = _by_key("send"), _by_key("receive")
    n = _stream_live(tx, rx, f"oa-live-uninstall-{os.getpid()}")
    assert rx._omni_accum_binding.receiver.active_requests == 1  # live: nothing released it
    vo.uninstall()  # no publish_pending: uninstall itself publishes
    sent, got = _delta(_by_key("send"), tx0), _delta(_by_key("receive"), rx0)
    assert sent and got == sent
    assert got[("omni_accum_chunks", "meta.finished")] == n


def test_the_periodic_flush_sets_the_gauges_of_requests_still_live(vo, runner):
    """The flush every 256 chunks set no gauge (only a release's publish did): ``omni_accum_held_bytes`` and
    ``omni_accum_active_requests`` stayed where they were while a long request streamed. It now goes to the
    publisher thread, which sets them with the counts."""
    from omni_accum.integrations.vllm_omni import metrics
    from omni_accum.integrations.vllm_omni.binding import Binding, publish_pending
    from omni_accum.integrations.vllm_omni.binding_settings import DEFAULT_ADAPTER_KEYS
    from omni_accum.integrations.vllm_omni.send import encode_payload
    from omni_accum.policy import load_policy

    policy = load_policy("qwen3-omni")
    vo.install(policy)
    tx = Binding(policy, DEFAULT_ADAPTER_KEYS, "test")
    r = runner()
    rid = f"oa-gauge-long-{os.getpid()}"
    m = metrics._registry_metrics()
    m["held"].set(-1)  # values no publish sets
    m["active"].labels("receive").set(-1)
    for i in range(metrics.FLUSH_EVERY):  # the last one is the 256th chunk: its flush is due
        step = torch.full((1, 32), float(i), dtype=torch.bfloat16)
        r._accumulate_payload(rid, encode_payload(tx, rid, {"embed": {"decode": step}}))
    publish_pending()  # at once what the 256th chunk marked (else soon, on the publisher thread)
    b = r._omni_accum_binding
    assert b.receiver.active_requests == 1  # still live: no release published anything
    assert _sample("omni_accum_held_bytes") == b.receiver.nbytes() >= metrics.FLUSH_EVERY * 32 * 2
    assert _sample("omni_accum_active_requests", role="receive") == 1


def test_a_middle_stage_counts_a_request_it_receives_and_sends_on_once(vo, adapters):
    """Stage 1's adapter receives request R (vllm-omni's internal id) and sends it on (its external id): status
    counted it twice (receiving + sending). The Prometheus gauge stays per role."""
    from tests.test_integration_vllm_omni import T2T, _hear, _request, _thinker_steps, _wait

    vo.install("qwen3-omni")
    tx, mid, _last = adapters(0, next_func=T2T), adapters(1, next_func=T2T), adapters(2)
    _hear(tx)
    _hear(mid)
    rid = f"oa-mid-{os.getpid()}"
    _stream_live(tx, mid, rid)  # stage 0 -> 1: live on stage 1's receiving side
    out_ids: list[int] = []
    for i, mm in enumerate(_thinker_steps()[:5]):  # stage 1 -> 2: the same request goes on
        if i >= 3:
            out_ids.append(2000 + i)
        mid.save_async(multimodal_output=mm, request=_request(rid, out_ids))
    _wait(lambda: mid.put_req_chunk.get(rid, 0) >= 2, "stage 1's puts")
    b = mid._omni_accum_binding
    assert b.receiver.active_requests == 1 and b.sender.active_requests == 1  # both roles hold it
    st = vo.status()
    (row,) = [x for x in st.bindings if x.chunks_sent and x.chunks_received]
    assert row.active_requests == 1
    assert st.live_requests == 2  # stage 0 sending it, stage 1 receiving and sending it on; stage 2 none yet
    b.publish()
    assert _sample("omni_accum_active_requests", role="receive") == 1
    assert _sample("omni_accum_active_requests", role="send") == 2


def test_the_adapters_merge_time_ends_with_its_merge_not_the_capture(vo, adapters, monkeypatch, tmp_path):
    """The adapter's receive hook stopped the merge timer after the hand-off bookkeeping and the capture's writing
    (a capture taking 20 ms made the merge mean 23 ms); the runner path timed the merge alone. On a clock that only
    the capture moves, the merges now take no time at all."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from omni_accum.integrations.vllm_omni import capture, publishing, receive
    from tests.test_integration_vllm_omni import run_thinker_to_talker

    now = [0.0]
    monkeypatch.setattr(receive, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    real = capture.received

    def slow(*a, **kw):
        now[0] += 10.0  # the capture's writing: 10 s on this clock
        return real(*a, **kw)

    monkeypatch.setattr(capture, "received", slow)
    monkeypatch.setenv("OMNI_ACCUM_CAPTURE", str(tmp_path / "cap"))
    vo.install("qwen3-omni")

    def merges() -> tuple[float, float]:
        publishing.publish_pending()
        samples = [s for fam in REGISTRY.collect() if fam.name == "omni_accum_merge_seconds" for s in fam.samples]
        return (
            sum(s.value for s in samples if s.name == "omni_accum_merge_seconds_count"),
            sum(s.value for s in samples if s.name == "omni_accum_merge_seconds_sum"),
        )

    n0, s0 = merges()
    handed, _, (tx, rx) = run_thinker_to_talker(adapters, f"oa-merge-cap-{os.getpid()}", heard=True)
    rx._omni_accum_binding.publish()
    n, s = merges()
    assert now[0] >= 10.0 * len(handed)  # the capture ran for every chunk received
    assert n - n0 == len(handed)
    assert s - s0 < 10.0  # no capture in any merge time (the merges themselves: 0 s on this clock)


def test_policy_info_of_inline_yaml_in_the_environment_is_one_bounded_label(vo, adapters, monkeypatch):
    """``OMNI_ACCUM_POLICY`` holding inline YAML made the whole policy, newlines and all, the ``source`` label; it
    is shortened as ``install(text)`` says it (``inline policy text``)."""
    from prometheus_client import REGISTRY

    from omni_accum.integrations.vllm_omni.binding import binding_for

    text = "default: cat\nrules:\n  - match: embed.decode\n    strategy: prealloc\n"
    vo.install(text)
    told = vo.status().policy_source  # how install(text) tells it
    assert told == "inline policy text"
    vo.uninstall()
    monkeypatch.setenv("OMNI_ACCUM_POLICY", text)
    vo.activate()
    assert vo.is_installed()
    b = binding_for(adapters(1))
    labels = dict(fingerprint=b.fingerprint, version=_version())
    assert _sample("omni_accum_policy_info", source=f"OMNI_ACCUM_POLICY ({told})", **labels) == 1
    fams = [fam for fam in REGISTRY.collect() if fam.name == "omni_accum_policy_info"]
    sources = [s.labels["source"] for fam in fams for s in fam.samples]
    assert sources and all("\n" not in x and len(x) <= 160 for x in sources), sources


def test_policy_info_of_a_policy_no_binding_runs_any_more_goes(vo, adapters):
    """uninstall() then install() of another policy left the old policy's series at 1: two policies appeared to run
    in the process. The series goes with the last binding running it."""
    from omni_accum.integrations.vllm_omni.binding import binding_for

    def policy(name: str) -> dict:  # a policy of this test's own (its fingerprint no other test's binding has)
        return {"default": "cat", "rules": [{"match": f"oa.reload.{name}{os.getpid()}", "strategy": "prealloc"}]}

    def info(fp: str) -> float:
        return _sample("omni_accum_policy_info", source="a mapping", fingerprint=fp, version=_version())

    vo.install(policy("a"))
    first = [binding_for(adapters(stage)) for stage in (0, 1)]
    fa = first[0].fingerprint
    assert info(fa) == 1
    vo.uninstall()
    vo.install(policy("b"))
    fb = binding_for(adapters(1)).fingerprint
    assert fb != fa and info(fb) == 1
    assert info(fa) == 0  # no binding runs it any more


def test_the_producing_stages_accumulator_steps_are_not_chunks_received(vo, runner):
    """``async_chunk: false``: each step of the producing stage's full-payload accumulator was counted as a chunk
    received (status, the status file), though nothing was received there; it is ``accumulated`` now."""
    vo.install("qwen3-omni")
    r = runner()
    for _ in range(3):
        r.accumulate_full_payload_output(f"oa-acc-{os.getpid()}", {"embed.prefill": torch.zeros(1, 8)}, "REQ")
    b = r._omni_accum_binding
    assert b.stats["chunks_received"] == 0 and b.stats["accumulated"] == 3
    (row,) = [x for x in vo.status().bindings if x.accumulated]
    assert row.chunks_received == 0 and row.accumulated == 3


def test_the_full_payload_accumulators_state_is_in_the_held_bytes_and_active_requests(vo, runner):
    """``async_chunk: false``: the producing stage's accumulator holds a request's rows until the payload is sent,
    and neither ``omni_accum_held_bytes``, ``omni_accum_active_requests`` nor the status's ``active_requests``
    counted them (a 32k prompt held ~260 MB there unseen). Counted now, role ``accumulate``, until handed over."""
    vo.install("qwen3-omni")
    r = runner()
    rid = f"oa-held-fp-{os.getpid()}"
    for _ in range(3):
        r.accumulate_full_payload_output(rid, {"embed.prefill": torch.zeros(4, 8), "hidden": torch.zeros(4, 16)}, "REQ")
    b = r._omni_accum_binding
    b.publish()
    held = _sample("omni_accum_held_bytes")
    assert held >= 3 * 4 * (8 + 16) * 4  # both keys' rows, float32 (a prealloc buffer's capacity: more)
    assert _sample("omni_accum_active_requests", role="accumulate") == 1
    (row,) = [x for x in vo.status().bindings if x.accumulated]
    assert row.active_requests == 1
    r._materialize_full_payload_entry(r._pending_full_payload_send.pop(rid))  # the payload handed over
    b.publish()
    assert _sample("omni_accum_active_requests", role="accumulate") == 0
    assert _sample("omni_accum_held_bytes") == 0
    (row,) = [x for x in vo.status().bindings if x.accumulated]
    assert row.active_requests == 0


_LIVE_CHILD = """
import os, sys
from omni_accum.integrations.vllm_omni import prometheus
m = prometheus._registry_metrics()
m["held"].inc(int(sys.argv[1]))
m["active"].labels("receive").inc(2)
prometheus.policy_info("qwen3-omni", sys.argv[1], "1")
prometheus.fallback("test")
sys.stdout.flush()
if sys.argv[2] == "kill":
    os._exit(0)  # as SIGKILL leaves it: no atexit
"""


def test_the_live_gauges_of_a_dead_stage_process_leave_metrics(tmp_path):
    """Nothing called prometheus_client's mark_process_dead for a stage process: after a stage exited (or was killed)
    /metrics still summed its held bytes and active requests and showed its policy as running, for good. A process
    exiting normally removes its own; the next one whose metrics start removes those of the dead; counters stay."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    def scrape():
        reg = CollectorRegistry()
        MultiProcessCollector(reg, path=str(tmp_path))
        info = [s for fam in reg.collect() if fam.name == "omni_accum_policy_info" for s in fam.samples if s.value]
        return (reg.get_sample_value("omni_accum_held_bytes"),
                reg.get_sample_value("omni_accum_active_requests", {"role": "receive"}), len(info),
                reg.get_sample_value("omni_accum_fallbacks_total", {"reason": "test"}))  # fmt: skip

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", _LIVE_CHILD, "1000", "kill"], env=env, check=True, timeout=600)
    assert scrape() == (1000, 2, 1, 1)  # the killed process's gauges, until another starts
    subprocess.run([sys.executable, "-c", _LIVE_CHILD, "500", "exit"], env=env, check=True, timeout=600)
    assert scrape() == (None, None, 0, 2)  # no series: both gone: the second removed the first's, then its own at exit
    assert not [f for f in os.listdir(tmp_path) if f.startswith("gauge_live")]



def test_a_live_gauge_file_that_cannot_be_removed_stops_nothing_else(tmp_path, monkeypatch):
    """A dead process's file another stage removed first (or another user's) made the clean-up stop there, before it
    had registered this process's own removal at exit: file by file now, the exit removal registered first."""
    from omni_accum.integrations.vllm_omni import prometheus

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / f"gauge_livesum_{pid}.db").mkdir()  # cannot be os.remove()d
    (tmp_path / f"gauge_liveall_{pid}.db").write_bytes(b"")
    (tmp_path / f"gauge_livesum_{os.getpid()}.db").write_bytes(b"")  # this process's: kept while it runs
    (tmp_path / f"counter_{pid}.db").write_bytes(b"")  # a total: kept
    at_exit = []
    monkeypatch.setattr(prometheus.atexit, "register", at_exit.append)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    prometheus._forget_dead_processes()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([f"gauge_livesum_{pid}.db", f"gauge_livesum_{os.getpid()}.db", f"counter_{pid}.db"])
    (fn,) = at_exit
    fn()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"gauge_livesum_{pid}.db", f"counter_{pid}.db"])
