"""Workload presets, the YAML schema, and deterministic stream generation."""

from __future__ import annotations

import pytest
import torch

from omni_accum.bench.replay import iter_leaves
from omni_accum.bench.streams import build_stream
from omni_accum.bench.workloads import (
    Workload,
    WorkloadError,
    dump_workload,
    load_workload,
    workload_names,
)

PRESETS = [
    "qwen3-omni-0.30",
    "qwen3-omni-seed",
    "qwen3-omni-chunked-prefill",
    "qwen3-omni-full-payload",
    "qwen3-omni-override-ids",
    "talker-code2wav",
]


def test_the_six_presets_exist():
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


def test_a_stream_of_another_bucket_drops_the_shared_prefill_tensors_and_a_rebuilt_one_is_the_same():
    from omni_accum.bench import streams
    from omni_accum.testing import same_bits

    wl = load_workload("qwen3-omni-seed")
    first = dict(iter_leaves(build_stream(wl, 96, 0)[0]))
    held = {k: v for k, v in first.items() if any(v is s for s in streams._SHARED.values())}
    assert held["thinker_embeddings"].shape[0] > 96  # the prefill rows (P+1), shared by the bucket's requests
    build_stream(wl, 80, 0)  # another prompt length: one bucket's tensors are held at a time
    assert {k[3] for k in streams._SHARED} == {80}
    again = dict(iter_leaves(build_stream(wl, 96, 1)[0]))  # another request of the first bucket: the same values
    for k, v in held.items():
        assert again[k] is not v and same_bits(again[k], v), k


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
        ("name: w\nkeys:\n  - {path: x, kind: apend}\n", "keys[0].kind: Input should be 'append', 'replace' or 'static' (got 'apend')"),
        ("name: w\nkeys:\n  - {path: x, kind: append, dtype: bfloat17}\n", "(got 'bfloat17')"),
        ("name: w\ndecode_steps: -4\nkeys:\n  - {path: x, kind: append}\n", "greater than or equal to 0 (got -4)"),
        # a file's values as written: a number given as a string is refused, not converted (as in a policy file)
        ('name: w\ncontext_len: "64"\nkeys:\n  - {path: x, kind: append}\n', "line 2: context_len: Input should be a valid integer (got '64')"),
        ('name: w\nconcurrency: [1, "4"]\nkeys:\n  - {path: x, kind: append}\n', "concurrency[1]: Input should be a valid integer (got '4')"),
        ("name: w\ndecode_steps: 8.0\nkeys:\n  - {path: x, kind: append}\n", "decode_steps: Input should be a valid integer (got 8.0)"),
        ("name: w\nkeys:\n  - {path: x, kind: append, colour: red}\n", "keys[0].colour: unknown field"),
        ("name: w\ndecode_steps: -1\nkeys:\n  - {path: x, kind: append}\n", "decode_steps"),
        ("name: w\nkeys: []\n", "keys"),
        ("name: w\nkeys:\n  - {path: x, kind: append}\n  - {path: x, kind: replace}\n", "listed twice"),
        ("name: w\nkeys:\n  - {path: f, kind: append, value: flag}\n", "cannot be append-kind"),
        ("- just a list\n", "must be a mapping"),
        ("name: [unclosed\n", "invalid YAML"),
        ("", "the workload file is empty"),
        ("# only a comment\n", "the workload file is empty"),
        # numbers that are generated into tensors are checked here, not by torch later
        ("name: w\nkeys:\n  - {path: a.b, kind: append, row_shape: [-5]}\n", "keys[0].row_shape[0]"),
        ("name: w\nkeys:\n  - {path: a.b, kind: append, row_shape: [4, 0]}\n", "keys[0].row_shape[1]"),
        ("name: w\nkeys:\n  - {path: a.b, kind: append, row_shape: [65536, 65536]}\n", "elements per row"),
        ("name: w\nkeys:\n  - {path: a.b, kind: append, rows: 0}\n", "keys[0].rows"),
        ("name: w\nkeys:\n  - {path: a.b, kind: append, extra_first_rows: 2000000}\n", "extra_first_rows"),
        ("name: w\nkeys:\n  - {path: c, kind: replace, value: codes, windows: [4, -1]}\n", "keys[0].windows[1]"),
        ("name: w\nkeys:\n  - {path: c, kind: replace, value: codes, windows: [4], codebooks: 0}\n", "codebooks"),
        ("name: w\ncontext_len: 0\nkeys:\n  - {path: x, kind: append}\n", "context_len"),
        ("name: w\ncontext_len: 10000000000\nkeys:\n  - {path: x, kind: append}\n", "context_len"),
        ("name: w\ncontext_lens: [16, 10000000000]\nkeys:\n  - {path: x, kind: append}\n", "context_lens"),
        ("name: w\nprefill_chunk: 0\nkeys:\n  - {path: x, kind: append}\n", "prefill_chunk"),
        ("name: w\ndecode_steps: 10000000000\nkeys:\n  - {path: x, kind: append}\n", "decode_steps"),
        ("name: w\nseed: -1\nkeys:\n  - {path: x, kind: append}\n", "seed"),
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


@pytest.mark.parametrize("name", ["nosuch.yaml", "nosuch.JSON", "sub/nosuch"])
def test_missing_workload_file_says_so(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(WorkloadError) as e:
        load_workload(name)
    assert str(e.value).startswith(f"no such workload file: {name}.") and "qwen3-omni-seed" in str(e.value)


def test_workload_folder_says_it_is_a_folder(tmp_path):
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(WorkloadError) as e:
        load_workload(str(tmp_path / "dir.yaml"))
    assert "is a folder, not a workload file" in str(e.value) and "qwen3-omni-seed" in str(e.value)


def _float32_then_cast(shape, dtype, gen):
    """How streams were generated before: float32 (int64) values cast to the dtype."""
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    return torch.randint(0, 4096, shape, generator=gen, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("block", [16, 48, 1 << 20])
def test_tensors_are_built_in_their_dtype_with_the_same_values(monkeypatch, block):
    from omni_accum.bench import streams as workloads

    monkeypatch.setattr(workloads, "_RANDN_BLOCK", block)
    for shape in ([1], [15], [16], [17], [5, 17], [3, 2048], [2, 1, 2048], [33, 33]):
        for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64):
            g_old, g_new = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
            old, new = _float32_then_cast(shape, dtype, g_old), workloads._tensor(shape, dtype, g_new)
            assert new.dtype == dtype and torch.equal(old, new), (shape, dtype)
            # the generator is left where it was, so the next values match too
            assert torch.equal(torch.randn(4, generator=g_old), torch.randn(4, generator=g_new)), (shape, dtype)


def test_half_precision_tensors_have_no_float32_copy(monkeypatch):
    from omni_accum.bench import streams as workloads

    real = torch.randn
    drawn = []

    def randn(*a, **k):
        t = real(*a, **k)
        drawn.append(t.numel())
        return t

    monkeypatch.setattr(workloads, "_RANDN_BLOCK", 1024)
    monkeypatch.setattr(torch, "randn", randn)
    t = workloads._tensor([8, 2048], torch.bfloat16, torch.Generator().manual_seed(0))
    assert t.dtype == torch.bfloat16 and t.shape == (8, 2048)
    assert max(drawn) == 1024 and sum(drawn) == 8 * 2048


def test_a_workload_files_yaml_syntax_error_is_one_line_naming_line_and_column(tmp_path):
    from omni_accum.bench.workloads import WorkloadError, load_workload

    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nkeys: [a, b\n")
    with pytest.raises(WorkloadError) as e:
        load_workload(str(p))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{p}: line 3, column 1: invalid YAML: expected ',' or ']'")
    assert "(while parsing a flow sequence at line 2, column 7)" in msg


def test_a_repeated_key_path_is_reported_at_its_own_line(tmp_path):
    """A check over the whole workload (a path listed twice) names the repeat's line and the first
    listing, not line 1 of a "top level" error."""
    path = tmp_path / "dup.yaml"
    keys = "  - path: a.x\n    kind: append\n  - path: a.y\n    kind: append\n  - path: a.x\n    kind: replace\n"
    path.write_text("name: w\nkeys:\n" + keys)
    with pytest.raises(WorkloadError) as e:
        load_workload(str(path))
    assert f"{path}: line 7: keys[2].path 'a.x' is listed twice (also keys[0].path)" in str(e.value)
    assert "top level" not in str(e.value)


def _processor_chunks(p: int, steps: int) -> list[dict]:
    """What vllm-omni 0.30.0's own thinker -> talker processor and chunk adapter put on the wire for a request of
    ``p`` prompt tokens and ``steps`` decode steps (the adapter adds meta.is_segment_finished to every payload)."""
    from types import SimpleNamespace

    from vllm_omni.model_executor.stage_input_processors.qwen3_omni import thinker2talker_async_chunk

    hf = SimpleNamespace(talker_config=SimpleNamespace(accept_hidden_layer=24))
    tm = SimpleNamespace(put_req_chunk={"r": 0}, request_payload={}, config=SimpleNamespace(hf_config=hf))
    prompt = list(range(p))
    tts = {k: torch.zeros(1, 1, 2048, dtype=torch.bfloat16) for k in ("tts_bos", "tts_eos", "tts_pad")}
    out: list[dict] = []
    rows = [p, 1] + [1] * steps  # the prefill step, the first sampled token, then one row per decode step
    for i, n in enumerate(rows):
        req = SimpleNamespace(
            external_req_id="r", all_token_ids=prompt + [7] * i, prompt_token_ids=prompt, resumable=False,
            additional_information=None,
        )  # fmt: skip
        layers = {0: torch.zeros(n, 2048, dtype=torch.bfloat16), 24: torch.zeros(n, 2048, dtype=torch.bfloat16)}
        mm = {"hidden_states": {"layers": layers}, "embed": dict(tts)}
        payload = thinker2talker_async_chunk(tm, mm, req, is_finished=i == len(rows) - 1)
        if payload is None:
            continue
        tm.put_req_chunk["r"] += 1
        leaves = {}
        for f in payload.__struct_fields__:
            v = getattr(payload, f)
            for q in getattr(v, "__struct_fields__", ()):
                if getattr(v, q) is not None:
                    leaves[f"{f}.{q}"] = getattr(v, q)
            if v is not None and not hasattr(v, "__struct_fields__"):
                leaves[f] = v
        leaves["meta.is_segment_finished"] = torch.tensor(False)  # set by OmniChunkTransferAdapter on every put
        out.append(leaves)
    return out


def test_the_default_workload_is_the_stream_0_30_0_sends(vllm_omni):
    """tune's and bench's default workload carries exactly the keys, shapes and dtypes vllm-omni 0.30.0's
    thinker -> talker processor sends, chunk by chunk (qwen3-omni-seed's flat keys are never sent)."""
    import argparse

    from omni_accum.cli import bench as bench_cli, tune as tune_cli

    from omni_accum.tuner import TuneOptions

    for mod in (tune_cli, bench_cli):  # no --workload (None: neither it nor --trace given) means the default
        parser = argparse.ArgumentParser()
        mod.register(parser.add_subparsers())
        args = parser.parse_args([mod.__name__.rsplit(".", 1)[1], "--out", "x.yaml"] if mod is tune_cli else ["bench"])
        assert args.workload in (None, "qwen3-omni-0.30")
    assert TuneOptions().workload == "qwen3-omni-0.30"
    p, steps = 24, 3
    real = _processor_chunks(p, steps)
    wl = load_workload("qwen3-omni-0.30").model_copy(update={"decode_steps": steps})
    ours = [dict(iter_leaves(c)) for c in build_stream(wl, p)]
    assert len(ours) == len(real) == 1 + steps
    for i, (mine, theirs) in enumerate(zip(ours, real)):
        assert set(mine) == set(theirs), (i, sorted(set(mine) ^ set(theirs)))
        for k, v in theirs.items():
            if isinstance(v, torch.Tensor):
                assert (tuple(mine[k].shape), mine[k].dtype) == (tuple(v.shape), v.dtype), (i, k)
            else:
                assert type(mine[k]) is type(v) and len(mine[k]) == len(v), (i, k)
    assert not {"thinker_embeddings", "finished"} & {k for c in ours for k in c}
    assert wl.key("embed.decode").read == "delta" and wl.key("embed.prefill").read == "delta"


def test_read_delta_needs_an_append_key():
    with pytest.raises(WorkloadError, match="read 'delta'.*needs an append key"):
        load_workload({"name": "x", "keys": [{"path": "a.b", "kind": "replace", "read": "delta"}]})
