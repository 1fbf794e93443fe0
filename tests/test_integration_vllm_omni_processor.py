"""The stage input processor hook: vllm-omni's own ``thinker2talker_async_chunk`` under chunked prefill.

Every test calls the processor a real ``OmniChunkTransferAdapter`` resolved from its deploy path (the
function vllm-omni's adapter calls), with the adapter as ``transfer_manager``, fed thinker outputs of
Qwen3-Omni's shapes (bf16, width 2048): the prompt's prefill chunks, then a decode row. After a payload
comes back the test advances ``put_req_chunk`` as the adapter does after its put.
"""

from __future__ import annotations

import inspect
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.test_integration_vllm_omni import assert_same

pytestmark = pytest.mark.vllm

D = 2048
ROW = D * 2  # bytes of one bf16 row
T2T = "vllm_omni.model_executor.stage_input_processors.qwen3_omni.thinker2talker_async_chunk"
QWEN = {"omni_accum_policy": "qwen3-omni"}


def _request(rid: str, prompt_len: int, out_ids: list[int]) -> Any:
    prompt = [100 + i % 1000 for i in range(prompt_len)]
    return SimpleNamespace(
        request_id="int-" + rid,
        external_req_id=rid,
        prompt_token_ids=prompt,
        output_token_ids=list(out_ids),
        all_token_ids=prompt + list(out_ids),
        additional_information=SimpleNamespace(entries={"speaker": SimpleNamespace(list_data=["Ethan"])}),
        resumable=False,
        num_computed_tokens=0,
    )


def _request_at(rid: str, sizes: list[int], i: int) -> Any:
    """The request as step ``i`` sees it: no output token during the prefill, then one per decode step."""
    return _request(rid, sum(sizes), [1000 + j for j in range(len(sizes), i + 1)])


def _steps(sizes: list[int], seed: int, decode: int = 1, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Thinker outputs: one per prefill chunk (``sizes`` rows), then ``decode`` one-row steps."""
    g = torch.Generator().manual_seed(seed)
    consts = {k: torch.randn(1, 1, D, generator=g).bfloat16() for k in ("tts_bos", "tts_eos", "tts_pad")}
    out = []
    for n in [*sizes, *[1] * decode]:
        layers = {0: torch.randn(n, D, generator=g).to(dtype), 24: torch.randn(n, D, generator=g).to(dtype)}
        out.append({"hidden_states": {"layers": layers}, "embed": dict(consts)})
    return out


def _drive(tx: Any, rid: str, sizes: list[int], steps: list[dict], finish_at: int | None = None) -> list[Any]:
    """Call ``tx``'s processor for every step, as its save loop does; ``finish_at``: that step is the last
    (``is_finished``). Returns what each call returned (payloads as plain dicts)."""
    from vllm_omni.data_entry_keys import to_dict

    got = []
    for i, mm in enumerate(steps):
        last = finish_at == i
        payload = tx.custom_process_next_stage_input_func(
            transfer_manager=tx, multimodal_output=mm, request=_request_at(rid, sizes, i), is_finished=last
        )
        got.append(None if payload is None else to_dict(payload))
        if payload is not None:
            tx.put_req_chunk[rid] += 1  # the adapter's successful put
        if last:
            tx.request_payload.pop(rid, None)  # the adapter's clean-up of a finished request
            break
    return got


def _cases(n: int, seed: int) -> list[tuple[list[int], int | None]]:
    """Random chunk counts (1..9) and sizes (1..300 rows); some requests finish during their prefill."""
    rnd = random.Random(seed)
    cases = []
    for _ in range(n):
        sizes = [rnd.randint(1, 300) for _ in range(rnd.randint(1, 9))]
        finish = rnd.randrange(len(sizes)) if rnd.random() < 0.25 else None
        cases.append((sizes, finish))
    return cases


@pytest.fixture
def upstream(vo, adapters):
    """A thinker adapter running vllm-omni's own processor (nothing installed)."""
    tx = adapters(0, next_func=T2T)
    assert getattr(tx.custom_process_next_stage_input_func, "__omni_accum_original__", None) is None
    return tx


def _prom(name: str, labels: dict[str, str]) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


# ---------------------------------------------------------------------------------------------- #


def test_chunked_prefill_is_bit_identical_over_random_chunkings(vo, adapters, upstream):
    vo.install()
    tx = adapters(0, next_func=T2T, extra=QWEN)
    fn = tx.custom_process_next_stage_input_func
    assert fn.__omni_accum_original__ is upstream.custom_process_next_stage_input_func
    assert inspect.signature(fn) == inspect.signature(fn.__omni_accum_original__)  # vllm-omni's kwargs checks
    for k, (sizes, finish) in enumerate(_cases(14, seed=31)):
        steps = _steps(sizes, seed=k, decode=2)
        want = _drive(upstream, f"up-{k}", sizes, steps, finish)
        got = _drive(tx, f"on-{k}", sizes, steps, finish)
        assert_same(got, want, f"case {k} {sizes} finish={finish}")
        handed = [p for p in got if p is not None]
        if finish is None or finish >= len(sizes):
            assert handed[0]["embed"]["prefill"].shape[0] == sum(sizes) + 1  # the prompt's rows, then one
        for p in handed:
            for g, key in (("embed", "prefill"), ("hidden_states", "output")):
                if key in p.get(g, {}):
                    assert p[g][key].is_contiguous()
    assert not tx.request_payload and not upstream.request_payload


def test_two_requests_interleaved(vo, adapters, upstream):
    vo.install()
    tx = adapters(0, next_func=T2T, extra=QWEN)
    plans = {"a": [64, 64, 30], "b": [100, 7]}
    steps = {r: _steps(s, seed=i) for i, (r, s) in enumerate(plans.items())}
    want = {r: _drive(upstream, r, plans[r], steps[r]) for r in plans}
    got: dict[str, list] = {r: [] for r in plans}
    from vllm_omni.data_entry_keys import to_dict

    for i in range(max(len(s) for s in steps.values())):
        for r, st in steps.items():
            if i < len(st):
                p = tx.custom_process_next_stage_input_func(tx, st[i], _request_at(r, plans[r], i), False)
                got[r].append(None if p is None else to_dict(p))
                if p is not None:
                    tx.put_req_chunk[r] += 1
    assert_same(got, want)


def test_cost_per_chunk_does_not_grow_with_the_rows_held(vo, adapters):
    """prealloc: each chunk's rows are copied once into one buffer of the prompt's rows + 1 (allocated at the
    first chunk, never moved); the bytes copied per chunk are the chunk's own, whatever is held. Under
    ``default`` (0.30.0's torch.cat) the metric counts what each cat copies: everything held, again."""
    from omni_accum.integrations.vllm_omni.processor import _Held

    vo.install()
    tx = adapters(0, next_func=T2T, extra=QWEN)
    sizes = [256] * 12
    steps = _steps(sizes, seed=5)
    rid = "cost"
    copied, ptrs = [], []
    before = _prom("omni_accum_processor_bytes_copied_total", {"strategy": "prealloc"})
    for i, mm in enumerate(steps):
        req = _request_at(rid, sizes, i)
        p = tx.custom_process_next_stage_input_func(tx, mm, req, False)
        held = tx.request_payload.get(rid)
        if p is None:
            assert isinstance(held, _Held)
            copied.append(held.copied)
            acc = held.accs[0][1]
            ptrs.append(acc.current_tensor_meta().data_ptr())
            assert acc.capacity == sum(sizes) + 1
    per_chunk = [b - a for a, b in zip(copied, copied[1:])]
    assert copied[0] == 2 * 256 * ROW  # the first chunk goes into the buffer as it comes (both keys)
    assert per_chunk == [2 * 256 * ROW] * (len(sizes) - 1)  # constant: only the chunk's own rows
    assert len(set(ptrs)) == 1  # one buffer from the first chunk on: nothing moved again
    total = 2 * (sum(sizes) + 1) * ROW  # linear: every row of both keys copied once
    assert _prom("omni_accum_processor_bytes_copied_total", {"strategy": "prealloc"}) - before == total
    assert p.embed.prefill.untyped_storage().nbytes() == p.embed.prefill.nbytes  # no spare rows

    vo.uninstall()
    vo.install()
    ref = adapters(0, next_func=T2T, extra={"omni_accum_policy": "default"})
    before = _prom("omni_accum_processor_bytes_copied_total", {"strategy": "cat"})
    _drive(ref, "cost-ref", sizes, steps)
    held_rows = [sum(sizes[: k + 1]) for k in range(1, len(sizes))] + [sum(sizes) + 1]
    assert _prom("omni_accum_processor_bytes_copied_total", {"strategy": "cat"}) - before == 2 * ROW * sum(held_rows)


def test_whole_prompt_is_copied_before_the_first_decode_step(vo, adapters, upstream):
    """Without chunked prefill the release holds the whole prompt's rows until the thinker's first decode
    step: under prealloc they are copied into the buffer when they come, so the call at that step (the
    hand-over, on the way to the talker) copies one row per key, and hands over that buffer's rows."""
    from omni_accum.integrations.vllm_omni.processor import _Held

    vo.install()
    tx = adapters(0, next_func=T2T, extra=QWEN)
    sizes = [700]
    steps = _steps(sizes, seed=11)
    want = _drive(upstream, "whole-up", sizes, steps)
    assert tx.custom_process_next_stage_input_func(tx, steps[0], _request_at("whole", sizes, 0), False) is None
    held = tx.request_payload["whole"]
    assert isinstance(held, _Held)
    assert held.copied == 2 * 700 * ROW  # both keys' rows, copied now
    buf = held.accs[0][1].current_tensor_meta()
    assert buf.untyped_storage().data_ptr() != steps[0]["hidden_states"]["layers"][0].untyped_storage().data_ptr()
    p = tx.custom_process_next_stage_input_func(tx, steps[1], _request_at("whole", sizes, 1), False)
    assert held.copied == 2 * 701 * ROW  # the decode step added one row per key
    assert p.embed.prefill.data_ptr() == buf.data_ptr()  # the buffer's rows, no final copy
    from vllm_omni.data_entry_keys import to_dict

    assert_same([None, to_dict(p)], want[:2])


def test_default_is_the_releases_own_code(vo, adapters, upstream, monkeypatch):
    """``default`` (cat): every call reaches vllm-omni's own function with the caller's arguments, its
    entries are its own plain dicts, and the results are 0.30.0's bit for bit; the time is measured."""
    import omni_accum.integrations.vllm_omni.processor as proc

    vo.install("default")
    tx = adapters(0, next_func=T2T)
    fn = tx.custom_process_next_stage_input_func
    seen = []
    real = proc._timed_upstream

    def timed(b, orig, args, rid, store):
        seen.append((orig, args[3]))
        return real(b, orig, args, rid, store)

    monkeypatch.setattr(proc, "_timed_upstream", timed)
    sizes = [40, 40, 20]
    steps = _steps(sizes, seed=9)
    n0 = _prom("omni_accum_processor_merge_seconds_count", {"stage": "0", "strategy": "cat"})
    got = []
    from vllm_omni.data_entry_keys import to_dict

    for i, mm in enumerate(steps):
        req = _request_at("d", sizes, i)
        p = fn(tx, mm, req, False)
        got.append(None if p is None else to_dict(p))
        entry = tx.request_payload.get("d")
        assert entry is None or type(entry) is dict  # the release's own entry, never omni-accum's
    assert seen == [(fn.__omni_accum_original__, False)] * len(steps)  # its own function, the caller's flag
    assert_same(got, _drive(upstream, "d", sizes, steps))
    assert _prom("omni_accum_processor_merge_seconds_count", {"stage": "0", "strategy": "cat"}) == n0 + 1


def test_off_switch_and_per_connector_off(vo, adapters, upstream, monkeypatch):
    monkeypatch.setenv("OMNI_ACCUM_VLLM_OMNI", "0")
    monkeypatch.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    vo.activate()
    from vllm_omni.model_executor.stage_input_processors import qwen3_omni

    assert not hasattr(qwen3_omni.thinker2talker_async_chunk, "__omni_accum_original__")
    off = adapters(0, next_func=T2T, extra=QWEN)
    assert off.custom_process_next_stage_input_func is upstream.custom_process_next_stage_input_func
    monkeypatch.delenv("OMNI_ACCUM_VLLM_OMNI")
    vo.install("qwen3-omni")
    opted_out = adapters(0, next_func=T2T, extra={"omni_accum_policy": "off"})
    sizes = [30, 30]
    steps = _steps(sizes, seed=2)
    want = _drive(upstream, "o", sizes, steps)
    for tx, rid in ((off, "o1"), (opted_out, "o2")):
        got = []
        for i, mm in enumerate(steps):
            req = _request_at(rid, sizes, i)
            p = tx.custom_process_next_stage_input_func(tx, mm, req, False)
            assert tx.request_payload.get(rid) is None or type(tx.request_payload[rid]) is dict
            from vllm_omni.data_entry_keys import to_dict

            got.append(None if p is None else to_dict(p))
        assert_same(got, want)


@pytest.mark.parametrize("failure", ["strategy_raises", "dtype_change"])
def test_a_failing_strategy_falls_back_and_is_counted(vo, adapters, upstream, monkeypatch, failure):
    """A strategy that raises half-way (the prompt's third chunk), or a chunk it refuses (float32 after bf16,
    which torch.cat promotes): the release's own code takes the request from the rows held, the results are
    0.30.0's bit for bit, and the fallback is counted."""
    from omni_accum.strategies.prealloc import PreallocAccumulator

    vo.install()
    tx = adapters(0, next_func=T2T, extra=QWEN)
    sizes = [50, 50, 50, 20]
    steps = _steps(sizes, seed=4)
    reason = "processor_error"
    if failure == "strategy_raises":
        real, n = PreallocAccumulator.append_tensor, [0]

        def flaky(self, value):
            n[0] += 1
            if n[0] == 4:  # chunk 2's second key: the first key has appended it already
                raise RuntimeError("injected")
            return real(self, value)

        monkeypatch.setattr(PreallocAccumulator, "append_tensor", flaky)
    else:
        reason = "processor_refused"
        for layer in (0, 24):
            steps[2]["hidden_states"]["layers"][layer] = steps[2]["hidden_states"]["layers"][layer].float()
    from omni_accum.integrations.vllm_omni import publishing

    publishing.publish_pending()  # an earlier test's count, published late, is not this one's
    before = _prom("omni_accum_fallbacks_total", {"reason": reason})
    want = _drive(upstream, "f", sizes, steps)
    got = _drive(tx, "f", sizes, steps)
    assert_same(got, want)
    # whether the publisher thread or this call moves the count to Prometheus, it is there once (reading the
    # binding's pending count before publishing counted it twice when the thread had not run yet)
    publishing.publish_pending()
    assert _prom("omni_accum_fallbacks_total", {"reason": reason}) - before == 1


def test_signature_probe_refuses_a_changed_processor(vo, monkeypatch):
    from vllm_omni.model_executor.stage_input_processors import qwen3_omni

    def thinker2talker_async_chunk(transfer_manager, multimodal_output, request, is_finished=False, new_token_ids=()):
        return None

    monkeypatch.setattr(qwen3_omni, "thinker2talker_async_chunk", thinker2talker_async_chunk)
    with pytest.raises(vo.InstallRefused) as ei:
        vo.install("qwen3-omni")
    msg = str(ei.value)
    assert "qwen3_omni.thinker2talker_async_chunk: signature is" in msg and "new_token_ids" in msg
    assert "nothing was patched" in msg and not vo.is_installed()
    assert qwen3_omni.thinker2talker_async_chunk is thinker2talker_async_chunk
    problems = vo.check_signatures()
    assert len(problems) == 1 and problems[0].startswith("qwen3_omni.thinker2talker_async_chunk")


def test_connector_extra_installs_and_the_adapter_adopts_the_wrapper(vo, adapters, monkeypatch):
    """No process-wide policy: the constructor probe installs omni-accum when the adapter's extra names one;
    that adapter resolved the processor before, and gets the wrapper in its own attribute."""
    monkeypatch.delenv("OMNI_ACCUM_POLICY", raising=False)
    vo.activate()
    assert not vo.is_installed()
    tx = adapters(0, next_func=T2T, extra=QWEN)
    assert vo.is_installed()
    assert getattr(tx.custom_process_next_stage_input_func, "__omni_accum_original__", None) is not None


def test_uninstall_mid_prefill_hands_the_rows_to_the_release(vo, adapters, upstream):
    """Uninstall while a request's prefill is held: its entry becomes the release's own (the torch.cat so
    far), the adapter's processor the release's, and the request completes bit for bit as 0.30.0's."""
    vo.install()
    tx = adapters(0, next_func=T2T, extra=QWEN)
    sizes = [70, 70, 70]
    steps = _steps(sizes, seed=8)
    want = _drive(upstream, "u", sizes, steps)
    from vllm_omni.data_entry_keys import to_dict

    got = []
    for i, mm in enumerate(steps):
        if i == 2:
            vo.uninstall()
            assert type(tx.request_payload["u"]) is dict
            assert getattr(tx.custom_process_next_stage_input_func, "__omni_accum_original__", None) is None
        req = _request_at("u", sizes, i)
        p = tx.custom_process_next_stage_input_func(tx, mm, req, False)
        got.append(None if p is None else to_dict(p))
    assert_same(got, want)


def test_abort_releases_the_rows_held(vo, adapters):
    """The adapter's own clean-up pops the request's entry: omni-accum's buffers go with it."""
    import gc
    import weakref

    vo.install()
    tx = adapters(0, next_func=T2T, extra=QWEN)
    steps = _steps([100, 100, 100], seed=1)
    for mm in steps[:2]:
        tx.custom_process_next_stage_input_func(tx, mm, _request("x", 300, []), False)
    held = tx.request_payload["x"]
    ref = weakref.ref(held.accs[0][1].current_tensor_meta())
    del held
    with tx._sender_state_lock:
        tx._clear_sender_state_locked("x")
    gc.collect()
    assert "x" not in tx.request_payload and ref() is None


def test_a_plugin_s_prealloc_subclass_keeps_its_strategy_for_a_long_prompt(vo, adapters, upstream):
    """A plugin's ``class MyPrealloc(Prealloc)`` registered as ``my_prealloc`` keeps the class attribute ``name =
    "prealloc"``: when a prompt's rows exceeded its ``initial_capacity`` the processor rebuilt the strategy by that
    name, and the built-in replaced the plugin's for long prompts. It is rebuilt by its registered name."""
    import omni_accum
    from omni_accum.manager import reset_manager
    from omni_accum.strategies.prealloc import Params, Prealloc, PreallocAccumulator

    made: list[str] = []

    class MyAccumulator(PreallocAccumulator):
        pass

    class MyPrealloc(Prealloc):  # inherits name = "prealloc"
        def new_accumulator(self, key):
            made.append(key.path)
            return MyAccumulator(key, self.params)

    class Plugin:
        @omni_accum.hookimpl
        def omni_accum_register_strategies(self):
            return [omni_accum.StrategySpec(name="my_prealloc", factory=MyPrealloc, params_model=Params,
                                            kinds=frozenset({"append"}))]  # fmt: skip

    m = omni_accum.StrategyManager()
    m.register(Plugin(), name="acme_prealloc")
    reset_manager(m)  # conftest puts the original back after the test
    vo.install()
    policy = {"default": {"strategy": "cat"}, "rules": [
        {"match": "embed.prefill", "strategy": "my_prealloc"},
        {"match": "hidden_states.output", "strategy": "my_prealloc"}]}  # fmt: skip
    tx = adapters(0, next_func=T2T, extra={"omni_accum_policy": policy})
    sizes = [100, 100]  # 201 rows handed over: above the default initial_capacity (64)
    steps = _steps(sizes, seed=12)
    want = _drive(upstream, "p", sizes, steps)
    got = _drive(tx, "p", sizes, steps)
    assert_same(got, want)
    assert sorted(made) == ["embed.prefill", "hidden_states.output"], made  # the built-in never took over


def test_rows_held_in_chunked_prefill_count_in_the_held_bytes_gauge(vo, adapters):
    """A prompt in chunked prefill holds its rows in omni-accum's accumulators before chunk 0 is put (~268 MB at 32k
    input): ``omni_accum_held_bytes`` counted only the Receivers' state and read 0 for them."""
    from omni_accum.integrations.vllm_omni import processor
    from omni_accum.integrations.vllm_omni.instances import bindings

    vo.install()
    tx = adapters(0, next_func=T2T, extra=QWEN)
    sizes = [100, 100]
    _drive(tx, "pf", sizes, _steps(sizes, seed=7, decode=0))  # the prompt's two chunks; nothing handed over yet
    assert isinstance(tx.request_payload["pf"], processor._Held)
    b = tx._omni_accum_binding
    b.publish()
    receivers = sum(o.receiver.nbytes() for _, top in bindings() for o in top.each())
    held = sum(acc.nbytes() for _, acc in tx.request_payload["pf"].accs)
    assert held == 2 * (sum(sizes) + 1) * ROW  # both keys' buffers: the prompt's rows and the first decode step's
    assert _prom("omni_accum_held_bytes", {}) == receivers + held
