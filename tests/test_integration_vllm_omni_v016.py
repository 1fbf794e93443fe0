"""vllm-omni 0.16 (its own environment, .venv-016): the receiving adapter's whole-payload merge.

Lockstep against 0.16.0's own ``OmniChunkTransferAdapter._update_request_payload``: every chunk of a
seeded random stream of flat keys (tensors of two dtypes, lists, ``finished``, values replaced, keys
that come and go, a 0-d tensor and a dtype change where 0.16.0's ``torch.cat`` raises or promotes, a
key whose kind changes) goes through the release's own method on one real adapter and through the
wrapped method of another (omni-accum installed, ``default`` policy): the payload dict handed to the
scheduler and the stored payload must be equal after every chunk, bit for bit, and where 0.16.0
raises, the wrapper raises the same. Under ``qwen3-omni`` the Qwen3-Omni stream's values are the
same, with ``thinker_embeddings`` held in a preallocated buffer. The family's signature probe refuses
a 0.16 build whose wrapped methods changed, naming them. ``bash scripts/test.sh`` runs this file in
.venv-016; elsewhere every test skips, naming the installed release.
"""

from __future__ import annotations

import random
from importlib.metadata import version
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omni_accum.integrations.vllm_omni import families
from omni_accum.integrations.vllm_omni.binding import binding_for
from omni_accum.integrations.vllm_omni.families import v016
from omni_accum.testing import first_difference

H = 8


@pytest.fixture
def vo16(vo):
    have = version("vllm-omni")
    if families.family_for(have) is not v016.FAMILY:
        pytest.skip(f"vllm-omni {have} is installed; the 0.16 family runs in .venv-016 (scripts/test.sh)")
    return vo


def make_adapter(policy: str | None = None, backend: str | None = None) -> Any:
    """A real 0.16.0 ``OmniChunkTransferAdapter`` (SharedMemoryConnector, AR stage 1), its loops stopped."""
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
        OmniChunkTransferAdapter,
    )

    extra = {"stage_id": 1, **({"omni_accum_policy": policy} if policy else {})}
    model_config = SimpleNamespace(
        stage_connector_config={"name": "SharedMemoryConnector", "extra": extra},
        worker_type="ar",
        custom_process_next_stage_input_func=None,
    )
    vllm_config = SimpleNamespace(
        model_config=model_config,
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        parallel_config=SimpleNamespace(distributed_executor_backend=backend),
    )
    a = OmniChunkTransferAdapter(vllm_config)
    a.stop_event.set()
    return a


def original(name: str) -> Any:
    from omni_accum.integrations.vllm_omni.families.base import _resolve

    fn = _resolve(v016.ADAPTER).__dict__[name]
    return getattr(fn, "__omni_accum_original__", fn)


def leaf(rng: random.Random, key: str, n: int) -> Any:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if key == "thinker_embeddings":
        return torch.randn(n, H, generator=g).bfloat16()
    if key == "thinker_hidden_states":
        return torch.randn(n, H, generator=g)
    if key == "tts_bos_embed":
        return torch.randn(1, 1, H, generator=g)
    if key in ("thinker_sequences", "thinker_input_ids", "code_predictor_codes"):
        return [rng.randrange(1000) for _ in range(n)]
    if key == "finished":
        return torch.tensor(rng.random() < 0.2)
    if key == "speaker":
        return rng.choice(["Ethan", "Chelsie"])
    if key == "meta":
        return {"left_context_size": n}
    if key == "step":  # a 0-d tensor outside finished: 0.16.0's torch.cat raises
        return torch.tensor(n)
    if key == "promoted":  # dtype changes: 0.16.0's torch.cat promotes
        return torch.randn(n, H, generator=g).to(rng.choice([torch.float32, torch.bfloat16]))
    if key == "flip":  # kind changes: tensor, list, None
        return [torch.randn(n, H, generator=g), [n], None][rng.randrange(3)]
    raise KeyError(key)


KEYS = [
    "thinker_embeddings", "thinker_hidden_states", "tts_bos_embed", "thinker_sequences", "thinker_input_ids",
    "code_predictor_codes", "finished", "speaker", "meta", "step", "promoted", "flip",
]  # fmt: skip


def random_stream(seed: int) -> list[tuple[str, dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(rng.randrange(1, 30)):
        rid = rng.choice(["a", "b"])
        keys = rng.sample(KEYS, rng.randrange(0, 6))
        if rng.random() < 0.7 and "thinker_embeddings" not in keys:
            keys.append("thinker_embeddings")
        out.append((rid, {k: leaf(rng, k, rng.randrange(0, 4)) for k in keys}))
    return out


def _step(fn: Any, adapter: Any, rid: str, chunk: dict) -> tuple[Any, Any]:
    payload = dict(chunk)
    try:
        fn(adapter, rid, payload)
    except Exception as e:  # noqa: BLE001 - 0.16.0's own failure (torch.cat of a 0-d tensor, list + tensor)
        return None, type(e)
    return payload, None


@pytest.mark.parametrize("seed", range(60))
def test_default_policy_equals_0160_adapter(vo16, seed):
    vo16.install("default")
    up, wrapped = make_adapter(), make_adapter("default")
    own = original("_update_request_payload")
    b = binding_for(wrapped)
    through = 0  # chunks whose accumulated keys came out of omni-accum's Receiver
    stream = random_stream(seed)
    for k, (rid, chunk) in enumerate(stream):
        expected, raised = _step(own, up, rid, chunk)
        got, got_raised = _step(type(wrapped)._update_request_payload, wrapped, rid, chunk)
        assert got_raised is raised, f"chunk {k}: 0.16.0 raised {raised}, omni-accum {got_raised}"
        if raised is None:
            assert first_difference(expected, got) is None, f"chunk {k}: {first_difference(expected, got)}"
        diff = first_difference(up.request_payload, wrapped.request_payload)
        assert diff is None, f"chunk {k}: stored payload differs: {diff}"
        through += rid in b.receiver.request_ids()
        if k % 7 == 6:  # a request ends: both adapters forget it
            up.cleanup(rid)
            wrapped.cleanup(rid)
            assert rid not in b.receiver.request_ids()
    accumulable = any(k != "finished" and isinstance(v, (torch.Tensor, list)) for _, c in stream for k, v in c.items())
    assert (through > 0) == accumulable and b.stats["chunks_received"] == len(stream)


def qwen3_omni_stream(prompt: int, steps: int) -> list[dict]:
    """What 0.16.0's thinker2talker_async_chunk sends: the prefill (+ the first decode row) with the
    statics, then one thinker_embeddings row and finished per decode step."""
    g = torch.Generator().manual_seed(prompt)
    first = {
        "thinker_embeddings": torch.randn(prompt + 1, H, generator=g).bfloat16(),
        "thinker_hidden_states": torch.randn(prompt + 1, H, generator=g).bfloat16(),
        "thinker_sequences": list(range(prompt + 1)),
        "thinker_input_ids": list(range(prompt)),
        "tts_bos_embed": torch.randn(1, H, generator=g).bfloat16(),
        "tts_eos_embed": torch.randn(1, H, generator=g).bfloat16(),
        "tts_pad_embed": torch.randn(1, H, generator=g).bfloat16(),
        "finished": torch.tensor(False),
    }
    rows = [
        {"thinker_embeddings": torch.randn(1, H, generator=g).bfloat16(), "finished": torch.tensor(i == steps - 1)}
        for i in range(steps)
    ]
    return [first, *rows]


def test_qwen3_omni_preset_prealloc_on_0160_stream(vo16):
    """qwen3-omni on 0.16's flat keys: the talker gets 0.16.0's values, thinker_embeddings in one buffer."""
    vo16.install("qwen3-omni")
    up, wrapped = make_adapter(), make_adapter("qwen3-omni")
    b = binding_for(wrapped)
    assert b.strategy_name("thinker_embeddings", torch.zeros(1, H)) == "prealloc"
    own = original("_update_request_payload")
    storages = set()
    for k, chunk in enumerate(qwen3_omni_stream(prompt=64, steps=40)):
        expected, _ = _step(own, up, "r", chunk)
        got, raised = _step(type(wrapped)._update_request_payload, wrapped, "r", chunk)
        assert raised is None and first_difference(expected, got) is None, f"chunk {k}"
        emb = got["thinker_embeddings"]
        assert isinstance(emb, torch.Tensor) and emb.shape[0] == 64 + 1 + k
        if k >= 2:  # after the one re-seed (0.16 drops the prefill's other keys at the first decode chunk)
            storages.add(emb.untyped_storage().data_ptr())
    assert len(storages) <= 2, "thinker_embeddings was copied into a new tensor on decode steps"
    assert not b.fell_back and "r" in b.receiver.request_ids()


def test_probe_refuses_a_changed_0160_build_naming_the_methods(vo16, monkeypatch):
    from omni_accum.integrations.vllm_omni.families.base import _resolve

    cls = _resolve(v016.ADAPTER)
    raw = {t.name: cls.__dict__[t.name] for t in v016.FAMILY.targets}
    monkeypatch.setattr(cls, "_update_request_payload", lambda self, req_id, payload_data, extra=None: None)
    monkeypatch.delattr(cls, "cleanup")
    problems = families.probe(v016.FAMILY)
    assert any("OmniChunkTransferAdapter._update_request_payload: signature is" in p for p in problems), problems
    assert any("OmniChunkTransferAdapter.cleanup: not found" in p for p in problems), problems
    with pytest.raises(vo16.InstallRefused) as ei:
        vo16.install("default")
    msg = str(ei.value)
    assert "_update_request_payload" in msg and "cleanup" in msg and "nothing was patched" in msg
    assert cls.__dict__["__init__"] is raw["__init__"] and not vo16.is_installed()


def test_0160_is_chosen_with_its_table(vo16):
    assert families.select() is v016.FAMILY
    names = {t.name for t in v016.FAMILY.targets}
    assert names == {"__init__", "_update_request_payload", "cleanup", "postprocess_scheduler_output"}
    assert v016.FAMILY.data_plane is None and v016.FAMILY.span_merge == ()


def test_a_talker_s_metrics_reach_the_scrape_though_0160_never_releases_its_requests(vo16, monkeypatch):
    """0.16.0's AR scheduler calls the adapter's cleanup only after a failed KV load, so a talker's requests
    are never released: the hook publishes at a request's first chunk, its last one and once a second
    between (the first 0.16 server run showed no chunk and no merge time in /metrics: 158 chunks, no flush)."""
    from prometheus_client import REGISTRY

    from omni_accum.integrations.vllm_omni import publishing, whole_payload

    def sample(name, labels):
        publishing.publish_pending()
        return REGISTRY.get_sample_value(name, labels) or 0.0

    clock = [100.0]
    monkeypatch.setattr(whole_payload.time, "perf_counter", lambda: clock[0])
    vo16.install("default")
    wrapped = make_adapter("default")
    fn = type(wrapped)._update_request_payload
    stream = qwen3_omni_stream(prompt=16, steps=6)
    key = {"role": "receive", "key": "thinker_embeddings", "strategy": "cat"}
    before = sample("omni_accum_chunks_total", key)
    merges = sample("omni_accum_merge_seconds_count", {"strategy": "cat"})
    _step(fn, wrapped, "r", stream[0])  # the request's first chunk: published
    assert sample("omni_accum_chunks_total", key) == before + 1
    for chunk in stream[1:3]:  # no second has passed, not the last chunk: still buffered
        _step(fn, wrapped, "r", chunk)
    assert sample("omni_accum_chunks_total", key) == before + 1
    clock[0] += whole_payload.PUBLISH_EVERY_S
    _step(fn, wrapped, "r", stream[3])  # a second later: published, with the merge times
    assert sample("omni_accum_chunks_total", key) == before + 4
    assert sample("omni_accum_merge_seconds_count", {"strategy": "cat"}) == merges + 4
    for chunk in stream[4:]:  # the last chunk (finished) publishes too
        _step(fn, wrapped, "r", chunk)
    assert stream[-1]["finished"].item() and sample("omni_accum_chunks_total", key) == before + len(stream)
    assert "r" in binding_for(wrapped).receiver.request_ids()  # not released: 0.16.0 never asked


def _scheduled(rid: str, new: bool, request: Any) -> Any:
    """One step's output for one request, as 0.16.0's AR scheduler builds it (before the adapter's
    ``postprocess_scheduler_output``): a new request carries its ``additional_information``."""
    from vllm_omni.core.sched.output import OmniCachedRequestData, OmniNewRequestData

    empty = dict(new_token_ids=[], all_token_ids={}, new_block_ids=[], num_computed_tokens=[], num_output_tokens=[])
    if new:
        nr = OmniNewRequestData(
            req_id=rid, external_req_id=rid, prompt_token_ids=[0], mm_features=[], sampling_params=None,
            pooling_params=None, block_ids=([0],), num_computed_tokens=0, lora_request=None, prompt_embeds=None,
            additional_information=request.additional_information,
        )  # fmt: skip
        cached = OmniCachedRequestData(req_ids=[], resumed_req_ids=set(), prompt_token_ids={}, **empty)
        return SimpleNamespace(scheduled_new_reqs=[nr], scheduled_cached_reqs=cached)
    cached = OmniCachedRequestData(req_ids=[rid], resumed_req_ids=set(), prompt_token_ids={}, **empty)
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached)


@pytest.mark.parametrize("policy", ["default", "qwen3-omni"])
def test_the_runner_gets_0160_s_values_and_qwen3_omni_sends_it_only_new_rows(vo16, policy):
    """The scheduler -> runner crossing (``runner_rows``) through the real adapter's
    ``postprocess_scheduler_output``, vLLM's message queue pickling (protocol 5, out-of-band buffers) and 0.16.0's
    own ``OmniGPUModelRunner._update_request_information``: the model's ``thinker_embeddings`` equal 0.16.0's at every
    step under both policies; under ``qwen3-omni`` a decode step sends the new row, not the buffer (before the fix,
    the prealloc view crossed with its spare capacity: twice 0.16.0's bytes per step); under ``default`` what
    crosses is what 0.16.0 sends."""
    from vllm_omni.worker.gpu_model_runner import OmniGPUModelRunner

    from message_queue import through_message_queue  # tests/ is on sys.path

    vo16.install(policy)
    up, wrapped = make_adapter(), make_adapter(policy, backend="mp")
    own = original("_update_request_payload")
    p = 4096  # [p, 8] bf16: 64 KiB, a decode row 16 bytes
    request = SimpleNamespace(request_id="r", additional_information=None)
    runner = SimpleNamespace(requests={"r": SimpleNamespace(additional_information_cpu=None)})
    sent = []
    for k, chunk in enumerate(qwen3_omni_stream(prompt=p, steps=30)):
        expected, _ = _step(own, up, "r", chunk)
        got, raised = _step(type(wrapped)._update_request_payload, wrapped, "r", chunk)
        assert raised is None
        request.additional_information = got
        so = _scheduled("r", k == 0, request)
        wrapped.postprocess_scheduler_output(so, {"r": request})
        assert request.additional_information is got and first_difference(expected, got) is None, f"chunk {k}"
        seen, nbytes = through_message_queue(so)
        sent.append(nbytes)
        state = runner.requests["r"]
        if k == 0:
            state.additional_information_cpu = seen.scheduled_new_reqs[0].additional_information
        else:
            OmniGPUModelRunner._update_request_information(runner, "r", seen.scheduled_cached_reqs.additional_information["r"])
        model_sees = state.additional_information_cpu["thinker_embeddings"]
        assert isinstance(model_sees, torch.Tensor)
        assert first_difference(expected["thinker_embeddings"], model_sees) is None, f"step {k}"
    stats = binding_for(wrapped).stats
    if policy == "qwen3-omni":
        assert stats["runner_delta"] >= 25, stats
        assert max(sent[5:]) < 4096, sent  # a row and the pickle's frame, not [p + t, 8]
    else:
        assert stats.get("runner_full", 0) == stats.get("runner_delta", 0) == 0
        assert min(sent[1:]) > p * H * 2  # the whole tensor, every step, as 0.16.0 sends it


def test_a_uni_executor_s_runner_gets_the_scheduler_s_own_objects(vo16):
    vo16.install("qwen3-omni")
    wrapped = make_adapter("qwen3-omni", backend="uni")
    request = SimpleNamespace(request_id="r", additional_information=None)
    for k, chunk in enumerate(qwen3_omni_stream(prompt=64, steps=4)):
        got, _ = _step(type(wrapped)._update_request_payload, wrapped, "r", chunk)
        request.additional_information = got
        so = _scheduled("r", k == 0, request)
        wrapped.postprocess_scheduler_output(so, {"r": request})
        shipped = so.scheduled_new_reqs[0].additional_information if k == 0 else so.scheduled_cached_reqs.additional_information["r"]
        assert shipped is got


class _Request:
    """What the scheduler's ``requests`` hold (vLLM's ``Request``: weakly referable)."""

    def __init__(self, rid: str) -> None:
        self.request_id = self.external_req_id = rid
        self.additional_information = None


def _idle() -> Any:
    """One step's output that schedules nothing."""
    from vllm_omni.core.sched.output import OmniCachedRequestData

    empty = dict(new_token_ids=[], all_token_ids={}, new_block_ids=[], num_computed_tokens=[], num_output_tokens=[])
    cached = OmniCachedRequestData(req_ids=[], resumed_req_ids=set(), prompt_token_ids={}, **empty)
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached)


@pytest.mark.parametrize("policy", ["default", "qwen3-omni"])
def test_a_request_the_scheduler_let_go_holds_no_more_than_0160_holds(vo16, policy):
    """0.16.0's AR scheduler never calls cleanup for a talker's request: 0.16.0 keeps its rows for good (its own
    leak), and the binding kept its Receiver state beside them; under qwen3-omni that pinned a buffer of twice the
    prompt's rows per finished request (the talker's memory grew twice as fast as 0.16.0's), and status counted
    every finished request as live. Once the scheduler drops the request, the next step gives upstream's entry
    tight tensors equal to 0.16.0's and releases the Receiver's state."""
    import gc

    vo16.install(policy)
    up, wrapped = make_adapter(), make_adapter(policy, backend="mp")
    own = original("_update_request_payload")
    req = _Request("r")
    for k, chunk in enumerate(qwen3_omni_stream(prompt=256, steps=10)):
        _step(own, up, "r", chunk)
        got, raised = _step(type(wrapped)._update_request_payload, wrapped, "r", chunk)
        assert raised is None
        req.additional_information = got
        wrapped.postprocess_scheduler_output(_scheduled("r", k == 0, req), {"r": req})
    b = binding_for(wrapped)
    emb = wrapped.request_payload["r"]["thinker_embeddings"]
    assert "r" in b.receiver.request_ids()
    assert (emb.untyped_storage().nbytes() > emb.nbytes) == (policy == "qwen3-omni")  # prealloc: spare rows pinned
    wrapped.postprocess_scheduler_output(_idle(), {"r": req})  # still the scheduler's: nothing changes
    assert "r" in b.receiver.request_ids()
    del req, got, emb
    gc.collect()
    wrapped.postprocess_scheduler_output(_idle(), {})  # the scheduler let it go: the next step compacts
    assert "r" not in b.receiver.request_ids()
    held = wrapped.request_payload["r"]  # 0.16.0's own entry stays, as 0.16.0 keeps it
    assert first_difference(up.request_payload["r"], held) is None
    t = held["thinker_embeddings"]
    assert t.untyped_storage().nbytes() == t.nbytes  # tight: the rows 0.16.0 holds, no more


def test_doctor_on_0160_names_what_the_family_cannot_do_and_reads_its_stage_config(vo16, tmp_path, monkeypatch, capsys):
    """On 0.16 an A/B split ran every request on its first arm while doctor printed the 50/50 split as ready; a capture
    folder recorded nothing; and 0.16.0's own stage config (no connector named: the default) was 'not a vllm-omni
    deploy YAML'."""
    from pathlib import Path

    import vllm_omni

    from omni_accum import cli

    split = tmp_path / "ab.yaml"
    split.write_text("ab:\n  arms:\n    control: {policy: default}\n    treatment: {policy: qwen3-omni}\n")
    monkeypatch.setenv("OMNI_ACCUM_POLICY", str(split))
    cli.main(["doctor"])
    out = capsys.readouterr().out
    assert "PROBLEM" in out and "no send hook to split by: every request would run the first arm ('control')" in out
    monkeypatch.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    monkeypatch.setenv("OMNI_ACCUM_CAPTURE", str(tmp_path / "cap"))
    cli.main(["doctor"])
    out = capsys.readouterr().out
    assert "no capture hook: nothing is recorded there" in out and "no send hook to split by" not in out
    monkeypatch.delenv("OMNI_ACCUM_CAPTURE")
    stage_config = Path(vllm_omni.__file__).parent / "model_executor" / "stage_configs" / "qwen3_omni_moe_async_chunk.yaml"
    cli.main(["doctor", "--deploy", str(stage_config)])
    out = capsys.readouterr().out
    assert "not a vllm-omni deploy YAML" not in out and "ready: this deployment runs as configured" in out, out
    # a fragment of config/deploy (the 0.28 / 0.30 format) was called ready, with a base_config fix 0.16.0 cannot take
    fragment = Path(__file__).resolve().parents[1] / "config" / "deploy" / "qwen3_omni_async_chunk.yaml"
    with pytest.raises(Exception, match="stage_args"):  # 0.16.0's own loader refuses it
        from vllm_omni.entrypoints.utils import load_stage_configs_from_yaml

        load_stage_configs_from_yaml(str(fragment))
    cli.main(["doctor", "--deploy", str(fragment)])
    out = capsys.readouterr().out
    assert "PROBLEM  deploy stages:" in out, out
    assert "vllm-omni 0.16.0 is installed: its loader reads stage_args:" in out, out
    assert "not ready" in out and "add 'base_config:" not in out, out


def test_0160_s_connectors_are_left_as_they_are(vo16):
    """The 0.16 family has no send hook: installing it wrapped every connector class's put anyway (a pass-through
    per put, outside the family's all-or-nothing check)."""
    from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

    from omni_accum.integrations.vllm_omni import send

    vo16.install("qwen3-omni")
    assert not send._wrapped and not hasattr(SharedMemoryConnector.put, "__omni_accum_original__")


def test_a_binding_made_afresh_watches_the_requests_again(vo16):
    """The watch mark on a request was a flag: after a reinstall (a new binding) the requests the old binding had
    marked were never compacted, and the old binding's list filled up with nobody draining it."""
    import gc

    vo16.install("qwen3-omni")
    wrapped = make_adapter("qwen3-omni", backend="mp")
    req = _Request("r")
    for k, chunk in enumerate(qwen3_omni_stream(prompt=64, steps=3)):
        got, _ = _step(type(wrapped)._update_request_payload, wrapped, "r", chunk)
        req.additional_information = got
        wrapped.postprocess_scheduler_output(_scheduled("r", k == 0, req), {"r": req})
    vo16.uninstall()
    vo16.install("qwen3-omni")
    got, _ = _step(type(wrapped)._update_request_payload, wrapped, "r", {"thinker_embeddings": torch.zeros(1, H).bfloat16()})
    b = binding_for(wrapped)
    wrapped.postprocess_scheduler_output(_idle(), {"r": req})
    assert "r" in b.receiver.request_ids()
    del req, got
    gc.collect()
    wrapped.postprocess_scheduler_output(_idle(), {})
    assert "r" not in b.receiver.request_ids()


def test_probe_refuses_a_build_whose_runner_side_changed(vo16, monkeypatch):
    """runner_rows' deltas hold only while 0.16.0's worker keeps the tensors it unpickles
    (OmniGPUModelRunner._update_request_information's dict.update) and the adapter attaches the cached dicts as it
    does; those methods were not checked, so a build that changed them was accepted and failed a worker's unpickling
    later. They are checked now, never wrapped."""
    from omni_accum.integrations.vllm_omni.families.base import _resolve

    runner = _resolve(v016.RUNNER)
    assert families.probe(v016.FAMILY) == []
    monkeypatch.setattr(runner, "_update_request_information", lambda self, request_id, payload_info, copy=True: None)
    problems = families.probe(v016.FAMILY)
    assert any("OmniGPUModelRunner._update_request_information: signature is" in p for p in problems), problems
    with pytest.raises(vo16.InstallRefused):
        vo16.install("qwen3-omni")
    assert not vo16.is_installed() and "__omni_accum_original__" not in vars(runner)
