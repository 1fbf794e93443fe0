"""``benchmarks/e2e/run.py``'s arm specs (the harness itself runs in tests/test_e2e_server.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import require_module

RUN_PY = Path(__file__).resolve().parent.parent / "benchmarks" / "e2e" / "run.py"


@pytest.fixture(scope="module")
def run():
    spec = importlib.util.spec_from_file_location("e2e_run", RUN_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["e2e_run"] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("e2e_run", None)


@pytest.fixture(scope="module")
def report(run):
    """``benchmarks/e2e/e2e_report.py``, the module run.py imports from its own folder."""
    import e2e_report

    return e2e_report


def test_an_arm_with_its_own_deploy_config(run):
    arm = run.make_arm("off@arena")
    assert arm.name == "off@arena" and arm.env == {"OMNI_ACCUM_VLLM_OMNI": "0"}
    assert arm.deploy == RUN_PY.parent / "configs" / "qwen3_omni_cpu_arena.yaml"
    assert "OmniAccumArenaConnector" in arm.deploy.read_text()
    q = run.make_arm(f"qwen3-omni@{RUN_PY.parent / 'configs' / 'qwen3_omni_cpu_full_payload.yaml'}")
    assert q.env["OMNI_ACCUM_POLICY"] == "qwen3-omni" and q.deploy.name == "qwen3_omni_cpu_full_payload.yaml"
    assert run.make_arm("off").deploy is None


def test_an_arm_run_again_is_named_apart(run):
    again = run.make_arm("off#2")
    assert again.name == "off#2" and again.env == run.make_arm("off").env and again.deploy is None
    arena = run.make_arm("qwen3-omni@arena#3")
    assert arena.name == "qwen3-omni@arena#3" and arena.env["OMNI_ACCUM_POLICY"] == "qwen3-omni"
    assert arena.deploy == run.make_arm("qwen3-omni@arena").deploy


def test_the_cpu_knobs_reach_every_arms_server_environment(run):
    import argparse

    none = argparse.Namespace(idle_spin_s=None, omp_wait=None, executor=None)
    assert run.cpu_knobs(none) == {}  # vLLM's and libgomp's own behaviour (or the caller's environment)
    every = argparse.Namespace(idle_spin_s=0, omp_wait="passive", executor="uni")
    assert run.cpu_knobs(every) == {
        "OMNI_ACCUM_E2E_IDLE_SPIN_S": "0.0", "OMP_WAIT_POLICY": "PASSIVE", "OMNI_ACCUM_E2E_EXECUTOR": "uni",
    }


def test_an_unknown_deploy_config_is_named(run):
    with pytest.raises(SystemExit, match="nosuch"):
        run.make_arm("off@nosuch")


def test_the_new_deploys_are_named_arms(run):
    chunked = run.make_arm("off@chunked").deploy
    assert chunked.name == "qwen3_omni_cpu_chunked.yaml"
    full = run.make_arm("qwen3-omni@arena_full_payload").deploy
    assert "OmniAccumArenaConnector" in full.read_text()
    assert {"arena", "chunked", "full_payload", "arena_full_payload", "arena_chunked"} <= set(run.deploy_names())
    assert run.resolve_deploy("chunked") == chunked and run.resolve_deploy("nosuch") is None


def _deploy(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("name", ["", "arena", "chunked", "full_payload", "arena_full_payload", "arena_chunked"])
def test_every_deploy_takes_a_32k_prompt_and_only_the_chunked_ones_chunk_it(run, name):
    path = RUN_PY.parent / "configs" / (f"qwen3_omni_cpu_{name}.yaml" if name else "qwen3_omni_cpu.yaml")
    d = _deploy(path)
    thinker, talker = d["stages"][0], d["stages"][1]
    for stage in (thinker, talker):  # 32k prompt tokens + 100 out + the chat template's few
        assert stage["max_model_len"] >= 32000 + 100 + 64, (name, stage)
    assert talker["max_num_batched_tokens"] >= 32000 + 64, "the talker's prefill stays one step"
    if "chunked" in name:
        assert thinker["max_num_batched_tokens"] == 2048 and thinker.get("enable_chunked_prefill", True)
    else:
        assert thinker["max_num_batched_tokens"] >= 32000 + 64
    assert d["async_chunk"] is ("full_payload" not in name)
    connectors = {c["name"] for c in d["connectors"].values()}
    assert connectors == ({"OmniAccumArenaConnector"} if "arena" in name else {"SharedMemoryConnector"})


def test_input_lengths_and_concurrencies_are_lists(run):
    assert run.positive_ints("8000,16000,32000", "--input-len") == [8000, 16000, 32000]
    assert run.positive_ints(" 8000 ", "--input-len") == [8000]
    for bad in ("8k", "8000,,16000", "0", "-1", ""):
        with pytest.raises(ValueError, match="--input-len") as e:
            run.positive_ints(bad, "--input-len")
        assert repr(bad) in str(e.value)


def serving_venv(path: Path, version: str = "0.30.0") -> Path:
    """A stand-in server virtualenv as run.py looks at it: bin/vllm-omni, vllm-omni's and torchvision's dist-info."""
    (path / "bin").mkdir(parents=True, exist_ok=True)
    (path / "bin" / "vllm-omni").write_text("")
    site = path / "lib" / "python3.11" / "site-packages"
    (site / f"vllm_omni-{version}.dist-info").mkdir(parents=True, exist_ok=True)
    (site / "torchvision-0.28.0.dist-info").mkdir(parents=True, exist_ok=True)
    return path


def test_usage_errors_exit_2_with_one_line(run, capsys, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")  # a model folder, so the later checks are reached
    monkeypatch.setattr(run, "INTERPRETER_BIN", serving_venv(tmp_path / "venv") / "bin")
    model = ["--model", str(tmp_path)]
    cases = [  # each fails before any server starts
        (["--input-len", "8000,32k"], "'32k'"),
        (["--concurrency", "0"], "'0'"),
        (["--model", str(tmp_path / "none")], str(tmp_path / "none")),
        ([*model, "--deploy-config", "nosuch"], "chunked"),  # names the valid choices
        ([*model, "--arms", "off@nosuch"], "nosuch"),
        ([*model, "--arms", "off,default,off"], "off given twice"),  # and how to run it again: ARM#2
        ([*model, "--omp-wait", "lazy"], "'passive', 'active'"),
        ([*model, "--executor", "ray"], "'mp', 'uni'"),
    ]
    for argv, needle in cases:
        with pytest.raises(SystemExit) as e:
            run.main(argv)
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (argv, err)
    monkeypatch.setitem(run.MODELS, "light", tmp_path / "not-built")
    with pytest.raises(SystemExit):
        run.main(["--model", "light"])
    assert "build_model.py --variant light" in capsys.readouterr().err


def test_the_model_option_names_a_variant_or_a_folder(run, tmp_path):
    assert run.resolve_model("tiny") == RUN_PY.parent / ".work" / "model"
    assert run.resolve_model("light") == RUN_PY.parent / ".work" / "model-light"
    assert run.resolve_model("lean") == RUN_PY.parent / ".work" / "model-lean"
    assert run.resolve_model(tmp_path) == tmp_path.resolve()


METRICS_TEXT = """
# HELP omni_accum_handoff_seconds hand-off
omni_accum_handoff_seconds_bucket{kind="prefill",le="0.1",pair="0->1"} 1.0
omni_accum_handoff_seconds_sum{kind="prefill",pair="0->1"} %(s01)s
omni_accum_handoff_seconds_count{kind="prefill",pair="0->1"} %(n01)s
omni_accum_handoff_bytes_total{kind="prefill",pair="0->1"} %(b01)s
omni_accum_handoff_seconds_sum{kind="decode",pair="0->1"} 0.002
omni_accum_handoff_seconds_count{kind="decode",pair="0->1"} 2.0
omni_accum_handoff_seconds_sum{kind="prefill",pair="1->2"} 0.004
omni_accum_handoff_seconds_count{kind="prefill",pair="1->2"} 2.0
omni_accum_handoff_skipped_total{reason="clock_domain"} 1.0
omni_accum_processor_merge_seconds_sum{stage="0",strategy="prealloc"} %(sp)s
omni_accum_processor_merge_seconds_count{stage="0",strategy="prealloc"} %(np)s
omni_accum_processor_bytes_copied_total{strategy="prealloc"} 1000.0
omni_accum_chunks_total{key="embed.prefill",role="send",strategy="prealloc"} 3.0
vllm_unrelated_total 5.0
"""


def _scrape(report, s01, n01, b01, sp, np_):
    return report.parse_metrics(METRICS_TEXT % {"s01": s01, "n01": n01, "b01": b01, "sp": sp, "np": np_})


def test_the_hand_off_and_processor_metrics_are_read_from_the_scrape(report):
    m = _scrape(report, 0.3, 3.0, 3e8, 0.5, 2.0)
    assert m["handoff"]["0->1 prefill"] == {"seconds": 0.3, "count": 3.0, "bytes": 3e8, "buckets": {"0.1": 1.0}}
    assert m["handoff"]["1->2 prefill"] == {"seconds": 0.004, "count": 2.0}
    assert m["processor_merge"]["0 prealloc"] == {"seconds": 0.5, "count": 2.0}
    assert m["handoff_skipped"] == {"clock_domain": 1.0} and m["processor_bytes_copied"] == {"prealloc": 1000.0}
    assert m["chunks"] == {"send": 3.0} and not any("vllm_unrelated" in line for line in m["lines"])
    # one benchmark's share: the difference of two scrapes, entries with no new event left out
    d = report.metrics_delta(m, _scrape(report, 0.5, 5.0, 5e8, 0.9, 3.0))
    assert d["handoff"] == {"0->1 prefill": {"seconds": pytest.approx(0.2), "count": 2.0, "bytes": 2e8,
                                             "buckets": {"0.1": 0.0}}}
    assert d["processor_merge"] == {"0 prealloc": {"seconds": pytest.approx(0.4), "count": 1.0}}
    assert report.metrics_delta(m, {"error": "URLError"}) == {} and report.metrics_delta(None, m) == {}


def test_the_hand_off_median_comes_from_the_buckets_of_one_benchmark(report):
    """Three fast hand-offs and one that waited 20 s: the mean says 5 s, the median what most requests saw."""
    text = "\n".join(
        [f'omni_accum_handoff_seconds_bucket{{kind="prefill",le="{le}",pair="0->1"}} {c}' for le, c in
         (("0.025", 0), ("0.05", 2), ("0.1", 3), ("25.0", 4), ("+Inf", 4))]
        + ['omni_accum_handoff_seconds_sum{kind="prefill",pair="0->1"} 20.15',
           'omni_accum_handoff_seconds_count{kind="prefill",pair="0->1"} 4']
    )
    before = report.parse_metrics(text.replace("} 4", "} 1").replace("} 2\n", "} 1\n").replace("} 3", "} 1")
                                  .replace("20.15", "0.04"))
    after = report.parse_metrics(text)
    e = after["handoff"]["0->1 prefill"]
    assert report.mean_ms(e) == pytest.approx(5037.5)
    assert report.p50_ms(e) == pytest.approx(50.0)  # rank 2 of 4: the top of the (0.025, 0.05] bucket
    d = report.metrics_delta(before, after)["handoff"]["0->1 prefill"]  # this benchmark's 3 hand-offs
    assert d["buckets"] == {"0.025": 0, "0.05": 1, "0.1": 2, "25.0": 3, "+Inf": 3} and d["count"] == 3
    assert report.p50_ms(d) == pytest.approx(75.0)  # rank 1.5: halfway into (0.05, 0.1]
    rows = dict((label, v) for label, v, _ in report.server_rows({"server": {"handoff": {"0->1 prefill": d}}}))
    assert rows["hand-off 0->1 prefill p50"] == pytest.approx(75.0)
    assert report.p50_ms({"seconds": 1.0, "count": 1.0}) is None  # no buckets: no median
    inf_only = {"buckets": {"0.1": 0.0, "+Inf": 2.0}}
    assert report.p50_ms(inf_only) == pytest.approx(100.0)  # the +Inf bucket answers its lower bound


def _bench(n, c, ttfp, server=None, memcpy=None):
    raw = {"p50_ttft_ms": 800.0, "p50_tpot_ms": 13.0, "p50_audio_ttfp_ms": ttfp, "median_e2el_ms": 3000.0}
    return {"input_len": n, "concurrency": c, "raw": raw, "server": server or {}, "memcpy_ms": memcpy}


def _rows(section: str) -> dict[str, str]:
    """label -> the cells of one table section's rows."""
    return {line[2:28].strip(): line[28:] for line in section.splitlines() if line.startswith("  ")}


def test_the_table_shows_the_hand_off_beside_ttft_and_ttfp_per_input_length(report):
    handoff = {
        "handoff": {"0->1 prefill": {"seconds": 0.4, "count": 2.0}, "0->1 decode": {"seconds": 0.01, "count": 10.0}},
        "processor_merge": {"0 prealloc": {"seconds": 0.2, "count": 2.0}},
    }
    arena = {"handoff": {"0->1 prefill": {"seconds": 0.02, "count": 2.0}}, "processor_merge": {}}
    results = [
        {"arm": "off", "bench": [_bench(8000, 1, 1800.0), _bench(32000, 1, 4000.0)]},
        {"arm": "default", "bench": [_bench(8000, 1, 1600.0, handoff, 9.5), _bench(32000, 1, 4000.0)]},
        {"arm": "qwen3-omni@arena", "bench": [_bench(8000, 1, 1000.0, arena, 9.5)]},
    ]
    text = "\n".join(report.table_lines(results))
    assert "input 8000 tokens, concurrency 1" in text and "input 32000 tokens, concurrency 1" in text
    assert text.index("input 8000 tokens") < text.index("input 32000 tokens")
    rows = _rows(text[: text.index("input 32000 tokens")])
    assert "1000.0 ms (0.56x)" in rows["audio TTFP p50"] and "E2EL p50" in rows  # median_ fallback
    # the hand-off columns: off measures nothing ('-'), default's mean per event, the arena's ratio to it
    assert rows["hand-off 0->1 prefill"].split()[0] == "-"
    assert "200.0 ms" in rows["hand-off 0->1 prefill"] and "10.0 ms (0.05x)" in rows["hand-off 0->1 prefill"]
    assert "1.0 ms" in rows["hand-off 0->1 decode"]
    assert "100.0 ms" in rows["proc. merge 0 prealloc"]
    # the share of audio TTFP p50 taken by the hand-offs on its path (prefill / full kinds only)
    assert "12.5 %" in rows["hand-off/TTFP"] and "1.0 %" in rows["hand-off/TTFP"]
    assert rows["payload memcpy"].split()[0] == "-" and "9.5 ms" in rows["payload memcpy"]
    long = _rows(text[text.index("input 32000 tokens") :])
    assert "hand-off 0->1 prefill" not in long and long["hand-off/TTFP"].split() == ["-", "-", "-"]


def test_a_table_without_any_metric_prints_dashes(report):
    text = "\n".join(report.table_lines([{"arm": "off", "bench": [{"input_len": 8000, "concurrency": 4, "raw": {}}]}]))
    assert text.strip().startswith("input 8000 tokens, concurrency 4 (ratio: arm / off)")
    rows = _rows(text)
    del rows["metric"]
    assert [k for k in rows if k.startswith("server side")] == ["server side"]  # no default arm: no ratio to it said
    rows = {k: v for k, v in rows.items() if not k.startswith("server side")}
    assert rows and all(cells.split() == ["-"] for cells in rows.values()), rows
    assert report.table_lines([{"arm": "off"}]) == []


def _build_model():
    spec = importlib.util.spec_from_file_location("e2e_build_model", RUN_PY.parent / "build_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_light_model_keeps_the_payload_widths_with_less_compute():
    require_module("transformers", "the e2e model's config (Qwen3OmniMoeConfig); installed with vllm-omni")
    bm = _build_model()
    tiny, light = bm.build_config("tiny"), bm.build_config("light")
    t, lt = tiny.thinker_config.text_config, light.thinker_config.text_config
    # what travels between the stages: the thinker's hidden size, its vocabulary, the talker's width
    assert (lt.hidden_size, lt.vocab_size) == (t.hidden_size, t.vocab_size) == (2048, 152064)
    assert light.talker_config.thinker_hidden_size == 2048
    assert light.talker_config.text_config.hidden_size == tiny.talker_config.text_config.hidden_size
    # what computes: one layer, two heads of 64 over one KV head, two experts (top-1)
    assert (lt.num_hidden_layers, lt.num_attention_heads, lt.num_key_value_heads, lt.head_dim) == (1, 2, 1, 64)
    assert (lt.num_experts, lt.num_experts_per_tok) == (2, 1) and lt.moe_intermediate_size < t.moe_intermediate_size
    assert light.code2wav_config.decoder_dim < tiny.code2wav_config.decoder_dim
    # vllm-omni captures a thinker layer's input (layers 0 .. n-1): the talker's accepted layer must be one
    for cfg in (tiny, light):
        assert 0 <= cfg.talker_config.accept_hidden_layer < cfg.thinker_config.text_config.num_hidden_layers
    assert bm.OUT_DIRS["light"] != bm.OUT_DIRS["tiny"] and bm.script_hash("light") != bm.script_hash("tiny")


def _rope_of(text_config) -> dict:
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None)
    return dict(rope or {})


@pytest.mark.parametrize("release", ["0.30", "0.16"])
def test_the_lean_model_is_light_with_one_attention_head_of_32(release):
    require_module("transformers", "the e2e model's config (Qwen3OmniMoeConfig); installed with vllm-omni")
    bm = _build_model()
    light, lean = bm.build_config("light", release), bm.build_config("lean", release)
    head = {"num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 32}
    for part in ("thinker_config.text_config", "talker_config.text_config", "talker_config.code_predictor_config"):
        a, b = light, lean
        for attr in part.split("."):
            a, b = getattr(a, attr), getattr(b, attr)
        assert {k: getattr(b, k) for k in head} == head, part
        assert getattr(a, "head_dim") == 64, part
        # the payload widths and everything else light chose stay
        assert (b.hidden_size, b.vocab_size, b.num_hidden_layers) == (a.hidden_size, a.vocab_size, a.num_hidden_layers)
    for tc in (lean.thinker_config.text_config, lean.talker_config.text_config):
        # M-RoPE rotates head_dim / 2 pairs: the sections must add up to them, or the rotary embedding breaks
        assert sum(_rope_of(tc)["mrope_section"]) == 16
    assert sum(_rope_of(light.thinker_config.text_config)["mrope_section"]) == 32
    assert lean.talker_config.accept_hidden_layer == light.talker_config.accept_hidden_layer
    assert bm.OUT_DIRS["lean"] not in (bm.OUT_DIRS["light"], bm.OUT_DIRS_016["lean"])
    assert bm.script_hash("lean", release) != bm.script_hash("light", release)


# --------------------------------------------------------------------------------------------------
# vllm-omni 0.16.0's server environment (run.py --release 0.16)

CONFIGS_016 = RUN_PY.parent / "configs" / "0.16"


def test_the_016_stage_config_is_that_release_s_async_chunk_pipeline_on_cpu():
    d = _deploy(CONFIGS_016 / "qwen3_omni_cpu.yaml")
    assert d["async_chunk"] is True and "stages" not in d  # 0.16.0's format: stage_args, not 0.30's stages
    stages = d["stage_args"]
    assert [s["stage_id"] for s in stages] == [0, 1, 2]
    assert [s["engine_args"]["model_stage"] for s in stages] == ["thinker", "talker", "code2wav"]
    procs = [s["engine_args"].get("custom_process_next_stage_input_func", "") for s in stages]
    assert procs[0].endswith("qwen3_omni.thinker2talker_async_chunk")
    assert procs[1].endswith("qwen3_omni.talker2code2wav_async_chunk")
    for s in stages:
        assert "devices" not in (s.get("runtime") or {}), "one CPU device: no per-stage devices"
        assert s["engine_args"]["enforce_eager"] is True
        assert "gpu_memory_utilization" not in s["engine_args"]
        # vLLM 0.16.0 leaves it None on its CPU platform, and 0.16.0's omni runner takes max(max_num_seqs, it)
        # when it loads any stage's model (the thinker failed on it in the third server start)
        assert s["engine_args"]["max_cudagraph_capture_size"] == 0, s["stage_id"]
    for s in stages[:2]:  # a 32k prompt, its output and the template's tokens, prefilled in one step
        assert s["engine_args"]["max_model_len"] >= 32000 + 100 + 64
        assert s["engine_args"]["max_num_batched_tokens"] >= 32000 + 64
    assert stages[0]["default_sampling_params"]["temperature"] == 0.0
    assert stages[1]["default_sampling_params"]["max_tokens"] == 64  # random weights: capped codec frames
    assert [s.get("engine_input_source") for s in stages] == [None, [0], [1]]


def test_release_016_picks_its_venv_models_and_config_format(run, monkeypatch, tmp_path, capsys):
    import dataclasses

    monkeypatch.setattr(run, "RELEASE", run.RELEASE)  # main() sets both; restored after the test
    monkeypatch.setattr(run, "VENV_BIN", run.VENV_BIN)
    monkeypatch.delenv("OMNI_ACCUM_E2E_VENV", raising=False)
    missing = tmp_path / "no-venv"
    monkeypatch.setitem(run.RELEASES, "0.16", dataclasses.replace(run.RELEASES["0.16"], venv=missing))
    with pytest.raises(SystemExit) as e:
        run.main(["--release", "0.16"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "setup_env.sh --release 0.16" in err and str(missing) in err, err
    venv = serving_venv(tmp_path / "venv-016", "0.16.0")
    models = {**run.RELEASES["0.16"].models, "light": tmp_path / "not-built-light"}
    monkeypatch.setitem(run.RELEASES, "0.16", dataclasses.replace(run.RELEASES["0.16"], venv=venv, models=models))
    with pytest.raises(SystemExit) as e:
        run.main(["--release", "0.16", "--model", "light"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "not-built-light" in err, err
    assert f"{venv / 'bin' / 'python'} benchmarks/e2e/build_model.py --variant light" in err, err
    (tmp_path / "model-016").mkdir()
    (tmp_path / "model-016" / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:  # the simulated hosts are 0.30's deploys
        run.main(["--release", "0.16", "--model", str(tmp_path / "model-016"), "--hosts", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--hosts 4" in err and "0.16" in err, err
    assert run.VENV_BIN == venv / "bin" and run.RELEASE.config_flag == "--stage-configs-path"
    assert run.resolve_model("tiny") == RUN_PY.parent / ".work" / "model-016"
    assert run.resolve_deploy("nosuch") is None and run.deploy_names() == []
    assert run.resolve_deploy(CONFIGS_016 / "qwen3_omni_cpu.yaml") == CONFIGS_016 / "qwen3_omni_cpu.yaml"


def test_the_default_release_keeps_0_30_s_deploy_flag_and_folders(run):
    r = run.RELEASES["0.30"]
    assert r.config_flag == "--deploy-config" and r.configs == RUN_PY.parent / "configs"
    assert r.models is run.MODELS and r.venv == RUN_PY.parent / ".work" / "venv"
    assert run.RELEASES["0.16"].venv == RUN_PY.parent / ".work" / "venv-016"


def test_the_model_config_takes_the_rope_layout_of_the_installed_transformers(monkeypatch):
    bm = _build_model()
    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [12, 10, 10]}
    monkeypatch.setattr(bm, "transformers_major", lambda: 5)
    assert bm.rope(mrope) == {"rope_parameters": mrope}
    monkeypatch.setattr(bm, "transformers_major", lambda: 4)  # vllm-omni 0.16.0's transformers 4.57
    assert bm.rope(mrope) == {
        "rope_theta": 1000000.0,
        "rope_scaling": {"rope_type": "default", "mrope_section": [12, 10, 10]},
    }
    assert bm.rope({"rope_type": "default", "rope_theta": 10.0}) == {"rope_theta": 10.0, "rope_scaling": None}
    assert bm.OUT_DIRS_016["light"] != bm.OUT_DIRS["light"]


def test_the_016_models_capture_the_thinker_layer_0_16_s_processors_read():
    require_module("transformers", "the e2e model's config (Qwen3OmniMoeConfig); installed with vllm-omni")
    bm = _build_model()
    for variant in ("tiny", "light"):
        plain, v016 = bm.build_config(variant), bm.build_config(variant, "0.16")
        # 0.16.0's thinker2talker_async_chunk reads pooling_output["24"]: layer 24 must exist and be captured
        assert v016.talker_config.accept_hidden_layer == 24
        assert v016.thinker_config.text_config.num_hidden_layers == 25
        # 0.16.0's M-RoPE reads thinker_config.seconds_per_chunk on every request (the real model's 2)
        assert v016.thinker_config.seconds_per_chunk == 2 and v016.to_dict()["thinker_config"]["seconds_per_chunk"] == 2
        t, p = v016.thinker_config.text_config, plain.thinker_config.text_config
        # everything else is the variant's: the same payload widths and per-layer sizes
        assert (t.hidden_size, t.vocab_size, t.num_attention_heads, t.num_experts, t.moe_intermediate_size) == (
            p.hidden_size, p.vocab_size, p.num_attention_heads, p.num_experts, p.moe_intermediate_size
        )
        assert plain.talker_config.accept_hidden_layer < plain.thinker_config.text_config.num_hidden_layers <= 2
    assert bm.script_hash("light", "0.16") != bm.script_hash("light", "0.30")


@pytest.mark.parametrize(
    "argv, env, needle",
    [
        (["--release", "0.99"], {}, "unknown release '0.99' (valid: 0.30, 0.16)"),
        (["--release"], {}, "--release needs a value"),
        (["--bogus"], {}, "unknown argument '--bogus'"),
        ([], {"OMNI_ACCUM_E2E_RELEASE": "1.0"}, "unknown release '1.0'"),
        (["--release", "0.16"], {"OMNI_ACCUM_E2E_VLLM_CPU_DIST": "vllm"}, "OMNI_ACCUM_E2E_VLLM_CPU_DIST='vllm' is not"),
    ],
)
def test_setup_env_refuses_a_bad_release_before_building_anything(tmp_path, argv, env, needle):
    import os
    import subprocess

    venv = tmp_path / "venv"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_ACCUM_E2E_")}
    full_env.update(env, OMNI_ACCUM_E2E_VENV=str(venv))
    r = subprocess.run(
        ["bash", str(RUN_PY.parent / "setup_env.sh"), *argv], env=full_env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and needle in r.stderr, (r.returncode, r.stderr)
    assert not venv.exists()


@pytest.mark.parametrize("release, cli, nice", [("0.30", "vllm", []), ("0.16", "vllm-omni", ["nice", "-n", "-10"])])
def test_the_benchmark_client_runs_from_the_release_s_own_cli(run, monkeypatch, tmp_path, release, cli, nice):
    # vLLM 0.16.0's own `vllm bench serve` has no openai-chat-omni backend (the first 0.16.0 benchmark failed on
    # it): vllm-omni 0.16.0 takes `bench serve --omni` in its `vllm-omni` CLI only
    import argparse

    seen = []
    monkeypatch.setattr(run, "RELEASE", run.RELEASES[release])
    monkeypatch.setattr(run, "VENV_BIN", tmp_path / "bin")
    monkeypatch.setattr(run.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or argparse.Namespace(returncode=0))
    args = argparse.Namespace(num_prompts=0, duration_s=0, output_len=100, seed=0, bench_timeout=10)
    run.run_bench("http://127.0.0.1:1", "m", args, 100, 10, tmp_path, {}, None)
    # 0.16.0's stage workers poll on every core: its client runs at a higher priority (it got ~0.5 % of a core)
    assert seen[0][: len(nice)] == nice, seen
    cmd = seen[0][len(nice):]
    assert cmd[:4] == [str(tmp_path / "bin" / cli), "bench", "serve", "--omni"], seen
    assert cmd[cmd.index("--backend") + 1] == "openai-chat-omni"
    assert cmd[cmd.index("--percentile-metrics") + 1] == "ttft,tpot,itl,e2el,audio_ttfp,audio_rtf"
    assert "--save-detailed" in cmd  # without it the client deletes the failed requests' error texts


def test_the_016_client_reads_the_server_s_wav_chunks_without_ffmpeg(tmp_path):
    # vllm-omni 0.16.0's openai-chat-omni client decodes each audio chunk with pydub.AudioSegment.from_file(BytesIO)
    # and no format (ffmpeg / ffprobe, which this host lacks); run.py --release 0.16 puts client_016 first on the
    # client's PYTHONPATH, whose sitecustomize hands WAV chunks to pydub as format="wav" (its own reader). Here a
    # stand-in pydub records the format it is asked for (the real one lives in .work/venv-016 only).
    import io
    import os
    import subprocess
    import wave

    (tmp_path / "pydub").mkdir()
    (tmp_path / "pydub" / "__init__.py").write_text(
        "class AudioSegment:\n"
        "    @classmethod\n"
        "    def from_file(cls, file, format=None, codec=None, **kw):\n"
        "        return (cls.__name__, format, codec, file.read(4))\n"
    )
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(24000)
        w.writeframes(bytes(2 * 2400))
    (tmp_path / "chunk.wav").write_bytes(buf.getvalue())
    (tmp_path / "chunk.bin").write_bytes(b"ID3 not a wav file")
    code = (
        "import io, sys\n"
        "from pydub import AudioSegment\n"
        "print(AudioSegment.from_file(io.BytesIO(open(sys.argv[1], 'rb').read())), "
        "AudioSegment.from_file(io.BytesIO(open(sys.argv[1], 'rb').read()), format='mp3'))\n"
    )
    client_path = RUN_PY.parent / "client_016"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def decode(name: str, with_stand_in: bool = True) -> str:
        path = os.pathsep.join([str(client_path), str(tmp_path)] if with_stand_in else [str(tmp_path)])
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path / name)], capture_output=True, text=True,
                           env={**env, "PYTHONPATH": path}, timeout=120)  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.strip()

    # a WAV chunk: pydub's WAV reader; a format the caller names and anything not WAV: as they come
    assert decode("chunk.wav") == "('AudioSegment', 'wav', None, b'RIFF') ('AudioSegment', 'mp3', None, b'RIFF')"
    assert decode("chunk.bin") == "('AudioSegment', None, None, b'ID3 ') ('AudioSegment', 'mp3', None, b'ID3 ')"
    assert decode("chunk.wav", with_stand_in=False).startswith("('AudioSegment', None,")  # what 0.16.0 asks for


def test_release_016_gives_the_client_and_only_the_client_the_wav_stand_in(run):
    assert run.RELEASES["0.16"].client_path == RUN_PY.parent / "client_016"
    assert (run.RELEASES["0.16"].client_path / "sitecustomize.py").is_file()
    assert run.RELEASES["0.30"].client_path is None


def test_the_talker_s_time_per_token_comes_from_vllm_omni_s_own_stage_tables(report, run):
    """run.py --release 0.16 starts the server with --log-stats and reads each benchmark's requests from the
    orchestrator's tables: here written by vllm-omni's own table formatter, two requests among other log lines
    (a probe's table before the benchmark's offset is not read: run_arm reads from the offset on)."""
    utils = require_module("vllm_omni.metrics.utils", "vllm-omni's stage tables (--log-stats)")

    def logged(where, message):  # as vLLM's logger writes a message: its prefix on every line
        return "".join(f"(APIServer pid=5439) INFO 12-03 06:24:06 [{where}] {line}\n" for line in message.split("\n"))

    def request(rid, walls, tokens):
        summary = {"e2e_requests": 1, **{f"e2e_stage_{i}_wall_time_ms": w for i, w in enumerate(walls)}}
        stages = [{"stage_id": i, "num_tokens_out": n, "stage_gen_time_ms": 3.25} for i, n in enumerate(tokens)]
        return (
            logged("stats.py:502", "\n" + utils._format_table("Overall Summary", summary, list(summary)))
            + logged("stats.py:528", "\n" + utils._format_table(f"RequestE2EStats [request_id={rid}]",
                                                               {"e2e_total_ms": 9.0}, ["e2e_total_ms"]))
            + logged("stats.py:581", "\n" + utils._format_table(f"StageRequestStats [request_id={rid}]", stages,
                                                               ["num_tokens_out", "stage_gen_time_ms"], column_key="stage_id"))
            + "(EngineCore pid=7) INFO 12-03 06:00:01 [loggers.py:1] Avg generation throughput: 3.0 tokens/s\n"
            + utils._format_table("Overall Summary", {"e2e_requests": 1}, ["e2e_requests"]).replace("[", "(", 1) + "\n"
        )  # fmt: skip

    text = request("chatcmpl-a", [20000.0, 12800.0, 9000.0], [100, 64, 1]) + request(
        "chatcmpl-b", [21000.0, 6400.0, 5000.0], [100, 32, 1]
    )
    reqs = report.stage_requests(text)
    assert [r["request_id"] for r in reqs] == ["chatcmpl-a", "chatcmpl-b"]
    assert reqs[0]["wall_ms"] == {0: 20000.0, 1: 12800.0, 2: 9000.0} and reqs[0]["tokens_out"] == {0: 100, 1: 64, 2: 1}
    rows = report.stage_rows(reqs)
    assert rows["requests"] == 2
    assert rows["stages"][1] == {"wall_ms": 9600.0, "ms_per_token": 200.0, "n": 2}  # medians of 12800/64, 6400/32
    assert rows["stages"][0]["ms_per_token"] == 205.0
    # the table: talker time per token with its ratio to off
    off = {"arm": "off", "bench": [dict(_bench(8000, 1, 1800.0), stages=rows)]}
    fast = report.stage_rows(report.stage_requests(request("chatcmpl-c", [20000.0, 3200.0, 9000.0], [100, 64, 1])))
    on = {"arm": "qwen3-omni", "bench": [dict(_bench(8000, 1, 1500.0), stages=fast)]}
    lines = _rows("\n".join(report.table_lines([off, on])))
    assert "200.0 ms" in lines["talker ms/token p50"] and "50.0 ms (0.25x)" in lines["talker ms/token p50"]
    assert "talker ms/token p50" not in _rows("\n".join(report.table_lines([{"arm": "off", "bench": [_bench(8000, 1, 1.0)]}])))
    # a table without its summary (a log cut at the offset) still counts the request, with no wall time
    cut = text[text.index("[RequestE2EStats [request_id=chatcmpl-a]]"):]
    assert report.stage_requests(cut)[0]["wall_ms"] == {} and report.stage_rows(report.stage_requests(cut))["requests"] == 2
    assert run.RELEASES["0.16"].server_flags == ("--log-stats",) and run.RELEASES["0.30"].server_flags == ()


def test_the_016_server_session_yields_the_cpu_to_the_client(run):
    """0.16.0's server runs in a session of its own whose autogroup gets niceness 10 (the kernel shares the CPU
    between sessions first: the client's own nice -10 did not help); a real child in a new session here."""
    import subprocess

    assert run.RELEASES["0.16"].server_group_nice == 10 and run.RELEASES["0.30"].server_group_nice == 0
    if not Path("/proc/self/autogroup").exists():
        pytest.skip("this kernel has no autogroups (/proc/self/autogroup): nothing to set")
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        said = run.set_group_nice(child.pid, 10)
        assert said.endswith("nice 10"), said
        assert Path(f"/proc/{child.pid}/autogroup").read_text().split()[-1] == "10"
        # this session keeps its own niceness; an empty file means the root group (a session never set apart),
        # as in a container whose init never called setsid
        ours = Path("/proc/self/autogroup").read_text().split()
        assert not ours or ours[-1] != "10", ours
        assert run.set_group_nice(2**22 + 7, 10).startswith("not set (")  # no such process: said, not raised
    finally:
        child.kill()
        child.wait()


def test_hosts_take_the_fast_path_deploy_and_point_each_host_s_connectors_at_its_own_address(run, tmp_path):
    """``qwen3-omni@mooncake_fast`` under ``--hosts 4``: the fast path's connector is a Mooncake connector for
    the plan, and each host's copy names that host and the lab's master; a shared-memory deploy is refused."""
    import yaml

    hosts = run.hosts_mode
    fast = run.make_arm("qwen3-omni@mooncake_fast")
    assert fast.deploy.name == "qwen3_omni_cpu_mooncake_fast.yaml"
    assert hosts.plan(fast.deploy, 4) == ["mooncake", "api", "stage1", "stage2"]
    out = hosts.host_deploy(fast.deploy, tmp_path / "deploy-stage1.yaml", "10.231.7.12", "10.231.7.10")
    conns = yaml.safe_load(out.read_text())["connectors"]
    assert {c["name"] for c in conns.values()} == {"OmniAccumMooncakeConnector"}
    for c in conns.values():
        assert c["extra"]["host"] == "10.231.7.12" and c["extra"]["master"] == "10.231.7.10:50151"
        assert c["extra"]["metadata_server"] == "http://10.231.7.10:8080/metadata"
        assert c["extra"]["mooncake_buffer_bytes"] == "16MiB"
    with pytest.raises(hosts.HostsUsageError, match="SharedMemoryConnector"):
        hosts.plan(run.make_arm("qwen3-omni@arena").deploy.with_name("qwen3_omni_cpu.yaml"), 4)


def test_build_model_replaces_only_a_folder_it_made(tmp_path, monkeypatch, capsys):
    """``--out DIR`` deleted whatever DIR held (``--out ~/models`` wiped it): a folder this script did not make
    (and its ``DIR.tmp``) is refused before anything is built, unless ``--force``; a file there always is; its
    own model folders (the stamp names it the builder), as run.py's variants are, are rebuilt as before."""
    bm = _build_model()
    built: list[Path] = []
    monkeypatch.setattr(bm, "build", lambda out, variant="tiny", release="0.30": built.append(out))

    def refused(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as e:
            bm.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err, err
        return err.strip().splitlines()[-1]

    mine = tmp_path / "models"
    mine.mkdir()
    (mine / "weights.bin").write_text("a user's own files")
    assert "is not a model folder this script made" in refused(["--out", str(mine)])
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert f"--out {a_file}: exists and is not a folder" in refused(["--out", str(a_file), "--force"])
    new = tmp_path / "new"  # not there yet: its DIR.tmp is someone else's folder
    foreign_tmp = tmp_path / "new.tmp"
    foreign_tmp.mkdir()
    (foreign_tmp / "notes.txt").write_text("not a build")
    said = refused(["--out", str(new)])
    assert f"--out {new}: its build folder {foreign_tmp} exists and is not a model folder" in said, said
    assert built == [] and (mine / "weights.bin").exists() and (foreign_tmp / "notes.txt").exists()
    (foreign_tmp / "notes.txt").unlink()  # an empty one is replaced; so is a build of this script's cut short
    assert bm.main(["--out", str(new)]) == 0
    (foreign_tmp / bm.BUILDING).write_text("")
    (foreign_tmp / "model.safetensors").write_text("")
    assert bm.main(["--out", str(new)]) == 0
    ours = tmp_path / "model"  # a model folder of this script's: a DIR.tmp beside it is a build of an older version
    ours.mkdir()
    (ours / bm.STAMP).write_text(json.dumps({"builder": bm.BUILDER, "hash": "old"}))
    (tmp_path / "model.tmp").mkdir()
    (tmp_path / "model.tmp" / "config.json").write_text("{}")  # (no BUILDING marker: that version wrote none)
    assert bm.main(["--out", str(ours)]) == 0
    assert bm.main(["--out", str(mine), "--force"]) == 0  # --force: the user said so
    assert built == [new, new, ours, mine]


def test_the_tables_name_every_arm_whole_and_take_the_first_off_arm_as_reference(report):
    def arm(name, e2el):
        return {"arm": name, "bench": [{"input_len": 8000, "concurrency": 1, "raw": {"median_e2el_ms": e2el}}],
                "correctness": {"probes": [{"text": "a", "audio_sha256": "s"}]}}  # fmt: skip

    results = [arm("qwen3-omni@mooncake_fast", 100.0), arm("off@replicas", 200.0),
               arm("qwen3-omni@mooncake_fast_any", 50.0), arm("off#2", 400.0)]  # fmt: skip
    text = "\n".join(report.table_lines(results))
    assert "(ratio: arm / off@replicas)" in text, text
    header = next(line for line in text.splitlines() if "metric" in line)
    assert header.split()[1:] == [r["arm"] for r in results], header
    e2el = _rows(text)["E2EL p50"].split()
    assert e2el == ["100.0", "ms", "(0.50x)", "200.0", "ms", "50.0", "ms", "(0.25x)", "400.0", "ms", "(2.00x)"], e2el
    assert set(report.compare(results)) == {"qwen3-omni@mooncake_fast", "qwen3-omni@mooncake_fast_any", "off#2"}
    assert report.off_arm(["default", "off"]) == "off" and report.off_arm(["default"]) is None
    plain = "\n".join(report.table_lines([arm("off", 200.0), arm("default", 100.0)]))
    assert "(ratio: arm / off)" in plain and "(0.50x)" in plain
