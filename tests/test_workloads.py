"""Workload presets, the YAML schema, and deterministic stream generation."""

from __future__ import annotations

import pytest
import torch

from omni_accum.replay import iter_leaves
from omni_accum.workloads import (
    Workload,
    WorkloadError,
    build_stream,
    dump_workload,
    load_workload,
    workload_names,
)

PRESETS = [
    "qwen3-omni-seed",
    "qwen3-omni-chunked-prefill",
    "qwen3-omni-full-payload",
    "qwen3-omni-override-ids",
    "talker-code2wav",
]


def test_the_five_presets_exist():
    assert sorted(PRESETS) == workload_names()


@pytest.mark.parametrize("name", PRESETS)
def test_preset_streams_are_deterministic_and_sized(name):
    wl = load_workload(name)
    p = 64 if name != "talker-code2wav" else 1
    a, b = build_stream(wl, p, 1), build_stream(wl, p, 1)
    assert len(a) == wl.n_chunks(p)
    for ca, cb in zip(a, b):
        la, lb = dict(iter_leaves(ca)), dict(iter_leaves(cb))
        assert la.keys() == lb.keys()
        for k in la:
            if isinstance(la[k], torch.Tensor):
                assert torch.equal(la[k], lb[k]), k
            else:
                assert la[k] == lb[k], k


def test_seed_layout():
    wl = load_workload("qwen3-omni-seed")
    s0, s1 = build_stream(wl, 100, 0), build_stream(wl, 100, 1)
    assert s0[0]["thinker_embeddings"].shape == (101, 2048) and s0[0]["thinker_embeddings"].dtype == torch.bfloat16
    assert s0[0]["tts_bos_embed"].shape == (1, 1, 2048)
    assert s0[0]["thinker_embeddings"] is s1[0]["thinker_embeddings"]  # prefill shared across requests
    assert s0[1]["thinker_embeddings"].shape == (1, 2048)
    assert not torch.equal(s0[1]["thinker_embeddings"], s1[1]["thinker_embeddings"])  # decode rows differ
    assert len(s0) == 101 and set(s0[1]) == {"thinker_embeddings", "finished"}
    assert s0[-1]["finished"] is True and s0[1]["finished"] is False
    assert wl.concurrency == [1, 10] and wl.policy == "qwen3-omni-flat"


def test_chunked_prefill_schedule():
    wl = load_workload("qwen3-omni-chunked-prefill")
    chunks = wl.prefill_chunks()
    assert sum(chunks) == 32000 and chunks[0] == 2048 and len(chunks) == 16
    s = build_stream(wl, 5000, 0)
    assert [c["embed"]["prefill"].shape[0] for c in s] == [2048, 2048, 904]


def test_override_ids_is_cumulative_with_constant_override_keys():
    s = build_stream(load_workload("qwen3-omni-override-ids"), 10, 0)
    assert [len(c["ids"]["output"]) for c in s[1:4]] == [1, 2, 3]
    assert s[2]["ids"]["output"][:1] == s[1]["ids"]["output"]
    assert s[1]["meta"]["override_keys"] == s[5]["meta"]["override_keys"] == [["embed", "decode"], ["ids", "output"]]


def test_code2wav_windows():
    s = build_stream(load_workload("talker-code2wav"), 1, 0)
    assert [c["codes"]["audio"].numel() for c in s[:4]] == [64, 464, 800, 800]
    assert s[0]["codes"]["audio"].dtype == torch.int64


def test_user_yaml_round_trip(tmp_path):
    wl = load_workload("qwen3-omni-override-ids").model_copy(update={"name": "mine", "decode_steps": 7})
    path = tmp_path / "mine.yaml"
    path.write_text(dump_workload(wl))
    back = load_workload(str(path))
    assert back == wl
    assert isinstance(back, Workload)


def test_yaml_without_name_takes_the_file_stem(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text("keys:\n  - {path: x, kind: append}\n")
    assert load_workload(str(path)).name == "tiny"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("name: w\nkeys:\n  - {path: x, kind: apend}\n", "keys[0].kind"),
        ("name: w\nkeys:\n  - {path: x, kind: append, colour: red}\n", "keys[0].colour: unknown field"),
        ("name: w\ndecode_steps: -1\nkeys:\n  - {path: x, kind: append}\n", "decode_steps"),
        ("name: w\nkeys: []\n", "keys"),
        ("name: w\nkeys:\n  - {path: x, kind: append}\n  - {path: x, kind: replace}\n", "listed twice"),
        ("name: w\nkeys:\n  - {path: f, kind: append, value: flag}\n", "cannot be append-kind"),
        ("- just a list\n", "must be a mapping"),
        ("name: [unclosed\n", "invalid YAML"),
    ],
)
def test_bad_workload_file_names_the_field(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(WorkloadError) as e:
        load_workload(str(path))
    assert needle in str(e.value)
    assert str(path) in str(e.value)


def test_unknown_name_lists_presets():
    with pytest.raises(WorkloadError, match="qwen3-omni-seed"):
        load_workload("no-such-workload")
