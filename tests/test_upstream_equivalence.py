"""With no policy, omni-accum accumulates exactly as the installed vllm-omni's own ``_accumulate_payload``
(0.30.0 or 0.28.0).

The real upstream method runs on the same randomized streams (nested and flat, override keys,
``meta.finished``, type changes, the list concatenation of a repeated ``meta.override_keys``).
Where upstream raises, omni-accum raises :class:`AccumulationError` and keeps the state.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import omni_accum
from fuzzing import examples
from omni_accum.testing import as_dict, first_difference

HIDDEN = 8

LEAVES = {
    ("embed", "prefill"): lambda g, n: torch.randn(n, HIDDEN, generator=g).bfloat16(),
    ("embed", "decode"): lambda g, n: torch.randn(1, HIDDEN, generator=g).bfloat16(),
    ("embed", "tts_bos"): lambda g, n: torch.ones(1, 1, HIDDEN).bfloat16(),
    ("hidden_states", "output"): lambda g, n: torch.randn(n, HIDDEN, generator=g),
    ("ids", "all"): lambda g, n: torch.randint(0, 100, (n,), generator=g).tolist(),
    ("ids", "prompt"): lambda g, n: [1, 2, 3],
    ("meta", "finished"): lambda g, n: torch.tensor(bool(n % 2)),
    ("meta", "is_segment_finished"): lambda g, n: bool(n % 2),
    ("meta", "left_context_size"): lambda g, n: n,
    ("codes", "audio"): lambda g, n: torch.randint(0, 4096, (16 * n,), generator=g),
    ("speaker", None): lambda g, n: "Ethan",
    ("language", None): lambda g, n: "en",
    ("thinker_embeddings", None): lambda g, n: torch.randn(n, HIDDEN, generator=g),
    ("thinker_output_token_ids", None): lambda g, n: list(range(n)),
    ("finished", None): lambda g, n: bool(n % 2),
    # upstream quirks and failure cases
    ("meta", "step_flag"): lambda g, n: torch.tensor(n),  # 0-d tensor outside meta.finished: cat raises upstream
    ("embed", "flip"): lambda g, n: [torch.randn(n, HIDDEN, generator=g), None, [n]][n % 3],  # type changes
}
OVERRIDE_CHOICES = [["embed", "decode"], ["ids", "all"], ["meta", "override_keys"], "speaker", "thinker_embeddings"]


def _upstream_accumulate():
    """The installed release's own runner merge, unbound: 0.30.0's ``_OmniConnectorPayloadTransportMixin``,
    0.28.0's ``OmniConnectorModelRunnerMixin`` (its decode-span rule needs span keys, which these streams
    never carry)."""
    from omni_accum.integrations.vllm_omni.classes import transport_mixin

    mixin = transport_mixin()
    holder = types.SimpleNamespace(_send_side_request_payload={})
    return lambda req_id, payload: mixin._accumulate_payload(holder, req_id, payload)


@st.composite
def upstream_streams(draw):
    keys = list(LEAVES)
    n_chunks = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 10_000))
    g = torch.Generator().manual_seed(seed)
    stream = []
    for _ in range(n_chunks):
        chosen = draw(st.lists(st.sampled_from(keys), min_size=0, max_size=6, unique=True))
        chunk: dict = {}
        for top, qual in chosen:
            v = LEAVES[(top, qual)](g, draw(st.integers(0, 3)))
            if qual is None:
                chunk[top] = v
            else:
                chunk.setdefault(top, {})[qual] = v
        if draw(st.booleans()):
            ok = draw(st.lists(st.sampled_from(OVERRIDE_CHOICES), max_size=3))
            chunk.setdefault("meta", {})["override_keys"] = [list(k) if isinstance(k, list) else k for k in ok]
        if draw(st.integers(0, 9)) == 0:
            chunk["embed"] = {}  # an empty group
        stream.append(chunk)
    return stream


def _run_both(stream, rx):
    upstream = _upstream_accumulate()
    for k, chunk in enumerate(stream):
        try:
            expected = upstream("r", chunk)
        except Exception as e:  # noqa: BLE001 - upstream's own failure (torch.cat of 0-d tensors, shapes)
            before = as_dict(rx.view("r")) if "r" in rx.request_ids() else None
            with pytest.raises(omni_accum.AccumulationError):
                rx.merge("r", chunk)
            if before is not None:
                assert first_difference(before, as_dict(rx.view("r"))) is None, f"chunk {k}: state changed ({e})"
            continue
        got = as_dict(rx.merge("r", chunk))
        diff = first_difference(expected, got)
        assert diff is None, f"chunk {k}: omni-accum differs from the installed vllm-omni: {diff}"


@settings(max_examples=examples(150))
@given(stream=upstream_streams())
def test_default_preset_equals_upstream(vllm_omni, stream):
    _run_both(stream, omni_accum.Receiver("default"))


@settings(max_examples=examples(50))
@given(stream=upstream_streams())
def test_no_policy_equals_upstream(vllm_omni, stream):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("OMNI_ACCUM_POLICY", raising=False)
        rx = omni_accum.Receiver()
    _run_both(stream, rx)


def test_repeated_override_keys_list_is_concatenated_like_upstream(vllm_omni):
    upstream = _upstream_accumulate()
    rx = omni_accum.Receiver("default")
    chunks = [
        {"embed": {"decode": torch.ones(1, 2)}, "meta": {"override_keys": [["embed", "decode"]]}},
        {"embed": {"decode": torch.zeros(1, 2)}, "meta": {"override_keys": [["embed", "decode"]]}},
    ]
    for c in chunks:
        expected = upstream("r", c)
        got = as_dict(rx.merge("r", c))
    assert first_difference(expected, got) is None
    # the override list itself was concatenated (upstream quirk), the overridden key replaced
    assert got["meta"]["override_keys"] == [["embed", "decode"], ["embed", "decode"]]
    assert torch.equal(got["embed"]["decode"], torch.zeros(1, 2))


def test_zero_dim_append_raises_accumulation_error_where_upstream_raises(vllm_omni):
    upstream = _upstream_accumulate()
    rx = omni_accum.Receiver("default")
    first = {"meta": {"step": torch.tensor(1)}}
    upstream("r", first)
    rx.merge("r", first)
    with pytest.raises(RuntimeError):
        upstream("r", {"meta": {"step": torch.tensor(2)}})
    with pytest.raises(omni_accum.AccumulationError, match="0-d tensor") as ei:
        rx.merge("r", {"meta": {"step": torch.tensor(2)}})
    assert ei.value.key == "meta.step" and ei.value.request_id == "r"
    assert int(rx.view("r")["meta"]["step"]) == 1
