"""Live A/B without vllm-omni: the ``ab`` policy section (validation, arms, the hash that splits requests,
the fingerprint) and ``omni-accum ab`` on a scrape (a file, and a loopback URL)."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from collections import Counter

import pytest

from omni_accum.cli import main
from omni_accum.errors import PolicyError
from omni_accum.policy import load_policy

SPLIT = {"ab": {"arms": {"control": {"policy": "default"}, "treatment": {"policy": "qwen3-omni", "weight": 3}}}}


# ------------------------------------------------------------------------------------------- the section
def test_arms_resolve_like_any_policy_reference_and_the_policy_resolves_as_its_first_arm():
    p = load_policy(SPLIT)
    arms = p.arm_policies()
    assert list(arms) == ["control", "treatment"]
    assert arms["treatment"] == load_policy("qwen3-omni") and arms["control"] == load_policy("default")
    key = "thinker_embeddings"  # send_once under qwen3-omni, cat under default
    assert load_policy("qwen3-omni").resolve(key).strategy != load_policy("default").resolve(key).strategy
    assert p.resolve(key).strategy == arms["control"].resolve(key).strategy
    assert "ab arm 'control'" in p.resolve(key).source


def test_an_arm_file_is_read_from_the_folder_of_the_policy_that_names_it(tmp_path):
    (tmp_path / "mine.yaml").write_text("default: token_list\n")
    top = tmp_path / "split.yaml"
    top.write_text("ab:\n  arms:\n    control: {policy: default}\n    mine: {policy: mine.yaml}\n")
    assert load_policy(str(top)).arm_policies()["mine"].default.strategy == "token_list"


def test_a_missing_arm_file_names_both_folders_it_was_looked_for_in(tmp_path, monkeypatch):
    """The split's folder is searched first, but the error named only the working directory."""
    top = tmp_path / "split" / "split.yaml"
    top.parent.mkdir()
    top.write_text("ab:\n  arms:\n    control: {policy: default}\n    mine: {policy: nothere.yaml}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PolicyError) as e:
        load_policy(str(top))
    assert f"looked for in the split's folder {top.parent}, then in the working directory {tmp_path}" in str(e.value)


@pytest.mark.parametrize(
    ("text", "line", "wanted"),
    [
        (
            "ab:\n  arms:\n    control: {policy: default}\n    treatment: {policy: nope}\n",
            4,
            ["ab.arms.treatment.policy", "'nope'", "Available presets: default, qwen3-omni"],
        ),
        ("ab:\n  arms:\n    control: {policy: default}\n", 3, ["two or more arms", "'control'"]),
        (
            "ab:\n  arms:\n    control: {policy: default}\n    'a-b': {policy: default}\n",
            4,  # the arm's own line
            ["arm name 'a-b'", "letters, digits and '_'", "16 characters"],
        ),
        (
            "ab:\n  arms:\n    control: {policy: default}\n    averyveryverylongarmname: {policy: default}\n",
            4,
            ["'averyveryverylongarmname'"],
        ),
        ("ab:\n  arms:\n    control: {policy: default, weight: 0}\n    t: {policy: default}\n", 3, ["weight", "> 0"]),
        (  # both reported ("lists every error"): the name check ran only once every arm had passed its own
            "ab:\n  arms:\n    1bad: {policy: default, weight: -1}\n    b: {policy: default}\n",
            3,
            ["ab.arms.'1bad': arm name '1bad' is not allowed", "ab.arms.'1bad'.weight:"],
        ),
        ("ab:\n  arms:\n    control: {policy: default, weight: -1}\n    t: {policy: default}\n", 3, ["weight"]),
        ("ab:\n  arms:\n    control: {policy: default, weight: true}\n    t: {policy: default}\n", 3, ["True"]),
        (
            "ab:\n  arms:\n    control: {policy: default, wieght: 2}\n    t: {policy: default}\n",
            3,
            ["wieght", "Allowed fields: policy, weight"],
        ),
        (
            "rules: [{match: x, strategy: replace}]\nab:\n  arms:\n    c: {policy: default}\n    t: {policy: default}\n",
            3,  # the ab section's body
            ["ab:", "also sets rules", "into an arm's policy"],
        ),
    ],
)
def test_a_bad_split_names_the_value_the_place_and_the_choices(tmp_path, text, line, wanted):
    f = tmp_path / "split.yaml"
    f.write_text(text)
    with pytest.raises(PolicyError) as e:
        load_policy(str(f))
    msg = str(e.value)
    assert f"{f}, line {line}:" in msg, msg
    for w in wanted:
        assert w in msg, (w, msg)


def test_an_arm_weight_given_as_a_string_is_refused_at_its_line(tmp_path):
    """``weight: "1"`` was taken as 1.0 (a bool was already refused; a string was not)."""
    f = tmp_path / "split.yaml"
    f.write_text("ab:\n  arms:\n    control: {policy: default, weight: '1'}\n    t: {policy: default, weight: 2}\n")
    with pytest.raises(PolicyError) as e:
        load_policy(str(f))
    assert "line 3: ab.arms.control.weight: Input should be a valid number (got '1')" in str(e.value)
    f.write_text("ab:\n  arms:\n    control: {policy: default, weight: 1}\n    t: {policy: default, weight: 0.5}\n")
    assert [a.weight for a in load_policy(str(f)).ab.arms.values()] == [1.0, 0.5]


def test_an_arm_that_splits_again_is_refused_not_followed(tmp_path):
    f = tmp_path / "loop.yaml"  # an arm naming the file itself: refused, no recursion
    f.write_text(f"ab:\n  arms:\n    a: {{policy: {f}}}\n    b: {{policy: default}}\n")
    with pytest.raises(PolicyError, match=r"ab.arms.a.policy: .*an ab section of its own"):
        load_policy(str(f))


def test_the_cli_validates_a_split(tmp_path, capsys):
    f = tmp_path / "split.yaml"
    f.write_text("ab:\n  arms:\n    control: {policy: default}\n    treatment: {policy: qwen3-omni}\n")
    assert main(["validate", str(f)]) == 0
    assert capsys.readouterr().out == f"{f}: ok (A/B split by request id: control 50% default, treatment 50% qwen3-omni)\n"
    f.write_text("ab:\n  arms:\n    control: {policy: default}\n    treatment: {policy: nope}\n")
    assert main(["validate", str(f)]) != 0
    got = capsys.readouterr()
    assert f"{f}, line 4: ab.arms.treatment.policy: 'nope'" in got.out + got.err


def test_validate_lists_an_arms_unknown_policy_beside_another_mistake_of_the_split(tmp_path, capsys):
    """An arm's policy was looked at only once the split's names and weights were valid: a file with a bad weight
    and two unknown arm policies reported the weight alone."""
    f = tmp_path / "split.yaml"
    f.write_text("ab:\n  arms:\n    control: {policy: nosuch2}\n    t: {policy: nosuch, weight: 0}\n")
    assert main(["validate", str(f)]) == 1
    got = capsys.readouterr()
    text = got.out + got.err
    assert "3 error(s)" in text, text
    assert f"{f}, line 3: ab.arms.control.policy: 'nosuch2'" in text and f"{f}, line 4: ab.arms.t.weight:" in text
    assert f"{f}, line 4: ab.arms.t.policy: 'nosuch'" in text


# ---------------------------------------------------------------------------------------- the hash
def test_the_same_request_id_takes_the_same_arm_in_every_process():
    split = load_policy(SPLIT).ab
    ids = [f"chatcmpl-{i}" for i in range(200)]
    here = [split.arm_for(r) for r in ids]
    code = (
        "import json, sys; from omni_accum.policy import load_policy\n"
        f"s = load_policy({SPLIT!r}).ab\n"
        f"print(json.dumps([s.arm_for(r) for r in {ids!r}]))"
    )
    env_run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(env_run.stdout.strip().splitlines()[-1]) == here
    # BLAKE2b of the id, not Python's per-process hash(): a fixed id has a fixed arm, here as anywhere
    assert [split.arm_for(f"req-{i}") for i in range(6)] == [split.arm_for(f"req-{i}") for i in range(6)]


def test_weights_lay_out_the_shares():
    split = load_policy(SPLIT).ab  # control 1, treatment 3
    n = Counter(split.arm_for(f"r{i}") for i in range(4000))
    assert set(n) == {"control", "treatment"}
    assert 0.2 < n["control"] / 4000 < 0.3  # 1/4, on fixed ids (derandomized: the same count every run)
    even = load_policy(
        {"ab": {"arms": {"a": {"policy": "default"}, "b": {"policy": "default"}, "c": {"policy": "default"}}}}
    ).ab
    m = Counter(even.arm_for(f"r{i}") for i in range(3000))
    assert all(800 < m[k] < 1200 for k in "abc"), m


def test_the_fingerprint_covers_the_arms_policies_weights_and_order():
    from omni_accum.integrations.vllm_omni.handshake import policy_fingerprint

    def fp(arms):
        return policy_fingerprint(load_policy({"ab": {"arms": arms}}))

    a = {"control": {"policy": "default"}, "treatment": {"policy": "qwen3-omni"}}
    assert fp(a) == fp(dict(a))
    assert fp(a) != fp({"treatment": {"policy": "qwen3-omni"}, "control": {"policy": "default"}})  # order
    assert fp(a) != fp({**a, "treatment": {"policy": "qwen3-omni", "weight": 2}})
    assert fp(a) != fp({**a, "treatment": {"policy": "qwen3-omni-flat"}})


# -------------------------------------------------------------------------------------- omni-accum ab
def _scrape(control: list[float], treatment: list[float], requests: tuple[int, int] | None = None) -> bytes:
    """A /metrics page with the A/B families, observations as given (a registry of its own); ``requests`` per arm
    (default: one per 5 observations)."""
    from prometheus_client import CollectorRegistry, Counter as PCounter, Histogram, generate_latest

    from omni_accum.integrations.vllm_omni.prometheus import HANDOFF_BUCKETS, MERGE_BUCKETS

    reg = CollectorRegistry()
    merge = Histogram("omni_accum_ab_merge_seconds", "m", ["arm"], buckets=MERGE_BUCKETS, registry=reg)
    hand = Histogram(
        "omni_accum_ab_handoff_seconds", "h", ["arm", "pair", "kind"], buckets=HANDOFF_BUCKETS, registry=reg
    )
    reqs = PCounter("omni_accum_ab_requests_total", "r", ["arm", "role"], registry=reg)
    for i, (arm, xs) in enumerate((("control", control), ("treatment", treatment))):
        for x in xs:
            merge.labels(arm).observe(x)
            hand.labels(arm, "0->1", "prefill").observe(x * 100)
        reqs.labels(arm, "receive").inc(len(xs) // 5 if requests is None else requests[i])
        reqs.labels(arm, "send").inc(1000)  # the sending side's count is not the unit (a receiver's merges are)
    return generate_latest(reg)


def _spread(center: float, n: int = 200) -> list[float]:
    return [center * (0.8 + 0.4 * (i % 10) / 9) for i in range(n)]


def test_ab_reads_a_saved_scrape_and_says_a_real_difference_is_above_the_noise(tmp_path, capsys):
    f = tmp_path / "metrics.txt"
    f.write_bytes(_scrape(_spread(8e-6), _spread(40e-6)))
    assert main(["ab", "--metrics", str(f)]) == 0
    out = capsys.readouterr().out
    assert "merge time per chunk" in out and "hand-off 0->1 prefill" in out
    assert out.count("difference above the noise") == 2, out
    assert main(["ab", "--metrics", str(f), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    merge = next(g for g in data["groups"] if g["what"] == "merge")
    c, t = merge["arms"]["control"], merge["arms"]["treatment"]
    assert c["count"] == t["count"] == 200
    assert c["ci_low"] < c["mean"] < c["ci_high"] and c["mean"] == pytest.approx(8e-6, rel=1e-6)
    assert merge["versus"]["treatment"]["difference"] == pytest.approx(32e-6, rel=1e-6)


def test_ab_says_which_arm_is_faster_and_why_no_interval_without_request_counts(tmp_path, capsys):
    """A result above the noise gave only a signed difference (the reader worked out which arm was faster); a scrape
    without the requests counter read "too few (< 30 requests received per arm)" beside 200 chunks per arm."""
    f = tmp_path / "metrics.txt"
    f.write_bytes(_scrape(_spread(8e-6), _spread(40e-6)))
    assert main(["ab", "--metrics", str(f)]) == 0
    assert capsys.readouterr().out.count("difference above the noise (slower)") == 2
    f.write_bytes(_scrape(_spread(40e-6), _spread(8e-6)))
    assert main(["ab", "--metrics", str(f)]) == 0
    assert capsys.readouterr().out.count("difference above the noise (faster)") == 2
    text = b"".join(line + b"\n" for line in _scrape(_spread(8e-6), _spread(40e-6)).splitlines()
                    if not line.startswith(b"omni_accum_ab_requests"))  # fmt: skip
    f.write_bytes(text)
    assert main(["ab", "--metrics", str(f)]) == 0
    out = capsys.readouterr().out
    assert "too few" not in out and out.count("no omni_accum_ab_requests_total series in the scrape") == 2, out


def test_an_arm_with_requests_but_no_times_is_named(tmp_path, capsys):
    """Control counted 40 requests but recorded no time: the report said only "only arm 'treatment' recorded here",
    and ``--baseline control`` answered "no such arm" though the report's first line listed control."""
    f = tmp_path / "metrics.txt"
    text = _scrape(_spread(8e-6), _spread(40e-6), requests=[40, 40])
    f.write_bytes(b"".join(line + b"\n" for line in text.splitlines()
                           if not (b'arm="control"' in line and b"_seconds" in line)))  # fmt: skip
    assert main(["ab", "--metrics", str(f)]) == 0
    assert "arm(s) 'control' counted requests but no merge series" in capsys.readouterr().out
    assert main(["ab", "--metrics", str(f), "--baseline", "control"]) == 2
    assert "it counted requests but recorded no merge or hand-off time" in capsys.readouterr().err


def test_a_capture_given_as_a_scrape_is_named_briefly(tmp_path, capsys):
    f = tmp_path / "capture-0-1.0.jsonl"
    f.write_text('{"v":1,"t":1e-6,"req":"ab","pair":"0->1","role":"send","seq":0,"keys":[' + ",".join(['["k","append","float32",[1,8],32,"cat"]'] * 40) + "]}\n")
    assert main(["ab", "--metrics", str(f)]) == 2
    err = capsys.readouterr().err
    assert "read it with omni-accum trace" in err and len(err) < 600, err


def test_an_arm_s_interval_of_a_time_does_not_go_below_zero(tmp_path, capsys):
    """One 12 ms merge among 200 us ones (its (0.01, 0.1] bucket spreads it) gave the arm ``[-963.6 us, 1461.5 us]``:
    a time's interval is cut at 0."""
    f = tmp_path / "metrics.txt"
    f.write_bytes(_scrape(_spread(200e-6), [*_spread(200e-6, 240), 12e-3], requests=[40, 40]))
    assert main(["ab", "--metrics", str(f), "--json"]) == 0
    merge = next(g for g in json.loads(capsys.readouterr().out)["groups"] if g["what"] == "merge")
    t = merge["arms"]["treatment"]
    assert t["ci_low"] == 0.0 < t["mean"] < t["ci_high"], t
    assert merge["arms"]["control"]["ci_low"] > 0.0
    assert merge["versus"]["treatment"]["ci_low"] < 0.0  # a difference may be below 0


def test_ab_says_within_the_noise_for_the_same_distribution(tmp_path, capsys):
    f = tmp_path / "metrics.txt"
    f.write_bytes(_scrape(_spread(20e-6), list(reversed(_spread(20e-6)))))
    assert main(["ab", "--metrics", str(f)]) == 0
    out = capsys.readouterr().out
    assert "difference above the noise" not in out and out.count("within the noise") == 2, out


def test_ab_counts_requests_not_chunks_as_the_units_of_its_interval(tmp_path, capsys):
    """The split assigns requests; a request's chunks are alike (a cat merge grows with the rows held). Two arms of
    the same policy whose 40 requests differ only by which requests each got (their sizes: 15 % apart on average)
    are within the noise; counted as 2000 independent chunks they read "above the noise" (86 % of such A/A splits
    did). A real 2x difference is still found."""
    sizes = [0.5 + i / 39 for i in range(40)]  # per-request scale of the chunks' cost

    def arm(shift: float) -> list[float]:
        return [k * shift * (i + 1) * 1e-6 for k in sizes for i in range(50)]  # 50 chunks, cost growing

    f = tmp_path / "metrics.txt"
    f.write_bytes(_scrape(arm(1.0), arm(1.15), requests=(40, 40)))
    assert main(["ab", "--metrics", str(f), "--json"]) == 0
    merge = next(g for g in json.loads(capsys.readouterr().out)["groups"] if g["what"] == "merge")
    assert merge["arms"]["control"]["units"] == 40 and merge["arms"]["control"]["count"] == 2000
    assert merge["versus"]["treatment"]["verdict"] == "within the noise", merge
    f.write_bytes(_scrape(arm(1.0), arm(2.0), requests=(40, 40)))
    assert main(["ab", "--metrics", str(f)]) == 0
    out = capsys.readouterr().out
    assert "treatment vs control: +" in out and out.count("difference above the noise") == 2, out
    f.write_bytes(_scrape(arm(1.0), arm(2.0), requests=(40, 29)))  # 1450 chunks, but 29 requests
    assert main(["ab", "--metrics", str(f)]) == 0
    assert "too few (< 30 requests received per arm)" in capsys.readouterr().out


def test_ab_gives_no_verdict_on_too_few_observations(tmp_path, capsys):
    f = tmp_path / "metrics.txt"
    f.write_bytes(_scrape(_spread(8e-6, 5), _spread(40e-6, 5)))
    assert main(["ab", "--metrics", str(f)]) == 0
    assert "too few" in capsys.readouterr().out


@pytest.fixture
def served():
    """A /metrics page on 127.0.0.1 (a free port), stopped afterwards; ``served(body)`` returns its URL."""
    servers = []

    def serve(body: bytes) -> str:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        t = threading.Thread(target=srv.serve_forever, daemon=True)
        t.start()
        servers.append((srv, t))
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield serve
    for srv, t in servers:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def test_ab_reads_a_metrics_url(served, capsys):
    url = served(_scrape(_spread(8e-6), _spread(40e-6)))
    assert main(["ab", "--metrics", f"{url}/metrics"]) == 0
    assert "difference above the noise" in capsys.readouterr().out
    assert main(["ab", "--metrics", f"{url}/nothing-here"]) == 2
    err = capsys.readouterr().err
    assert f"{url}/nothing-here" in err and "404" in err and "Traceback" not in err


def test_ab_without_ab_series_says_so(tmp_path, capsys):
    f = tmp_path / "metrics.txt"
    f.write_text("# HELP up x\n# TYPE up gauge\nup 1\n")
    assert main(["ab", "--metrics", str(f)]) == 1
    assert "no omni_accum_ab_merge_seconds" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arg", "wanted"),
    [
        ("{tmp}/missing.txt", "no such file"),
        ("{tmp}", "is a directory"),
        ("ftp://127.0.0.1/metrics", "unsupported URL scheme 'ftp'"),
        ("http://127.0.0.1:1/metrics", "cannot read the URL"),
        ("localhost:8000/metrics", "a host and port without a scheme: give http://localhost:8000/metrics"),
        ("127.0.0.1:8000/metrics", "give http://127.0.0.1:8000/metrics"),
    ],
)
def test_ab_usage_errors_exit_2_naming_the_input(tmp_path, capsys, arg, wanted):
    arg = arg.format(tmp=tmp_path)
    assert main(["ab", "--metrics", arg, "--timeout", "5"]) == 2
    err = capsys.readouterr().err
    assert arg in err and wanted in err and "Traceback" not in err, err


def test_ab_refuses_text_that_is_not_a_scrape_and_an_unknown_baseline(tmp_path, capsys):
    f = tmp_path / "metrics.txt"
    f.write_text("omni_accum_ab_merge_seconds_bucket{arm=\"a\",le=\"x\"} what\n")
    assert main(["ab", "--metrics", str(f)]) == 2
    assert str(f) in capsys.readouterr().err
    f.write_text("# HELP x a counter\nx_total 1\n\ndefault: cat\n")  # a policy file given by mistake: the line
    assert main(["ab", "--metrics", str(f)]) == 2
    assert f"{f}, line 4: not the Prometheus text format" in capsys.readouterr().err
    f.write_text("{\n")  # an error the parser gives no message for: the line is named (the message ended in ': ')
    assert main(["ab", "--metrics", str(f)]) == 2
    assert f"{f}, line 1: not the Prometheus text format: '{{' is no sample, comment or blank line" in capsys.readouterr().err
    f.write_bytes(_scrape(_spread(8e-6), _spread(40e-6)))
    assert main(["ab", "--metrics", str(f), "--baseline", "nope"]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "arms: control, treatment" in err, err


@pytest.mark.parametrize("timeout", ["inf", "1e400", "0", "nan"])
def test_ab_timeout_must_be_finite_and_positive(capsys, timeout):
    assert main(["ab", "--metrics", "http://127.0.0.1:9/metrics", "--timeout", timeout]) == 2
    err = capsys.readouterr().err
    assert f"--timeout {float(timeout)}: give seconds > 0 (finite)" in err and "Traceback" not in err


def test_ab_says_when_there_is_nothing_to_compare_or_the_baseline_is_missing_and_keeps_one_unit(tmp_path, capsys):
    """One arm printed tables and no word; a group without the baseline arm was compared with another arm silently;
    one interval read "[5443.6 us, 11.47 ms]"."""
    from omni_accum.cli.ab import Hist, analyse, format_report

    f = tmp_path / "metrics.txt"
    f.write_bytes(_scrape(_spread(8e-6), []))
    assert main(["ab", "--metrics", str(f)]) == 0
    out = capsys.readouterr().out
    assert "note: only arm 'control' recorded here: nothing to compare" in out, out
    h = Hist({1e-5: 40.0, 1e-2: 80.0, float("inf"): 100.0}, total=0.6, count=100.0)
    data = analyse({("zeta",): h, ("treatment",): h}, {}, {}, baseline="control")
    assert data["groups"][0]["note"] == "the baseline 'control' has no series here: compared with 'treatment' instead"
    text = format_report(analyse({("control",): Hist({1e-5: 100.0, float("inf"): 100.0}, 8e-4, 100.0),
                                  ("treatment",): h}, {}, {}))
    assert " us" not in text.split("merge time per chunk")[1], text  # one unit in the group: ms


def test_an_arm_without_a_requests_series_gets_no_verdict_not_a_traceback(capsys):
    """The request-count lookup of a hand-off group raised KeyError for an arm with hand-offs but no
    omni_accum_ab_requests_total series (a scrape cut short, or an arm no stage received yet)."""
    from omni_accum.cli.ab import Hist, analyse, format_report

    h = Hist({1e-3: 50.0, float("inf"): 50.0}, total=0.04, count=50.0)
    data = analyse({}, {("control", "0->1", "prefill"): h, ("treatment", "0->1", "prefill"): h}, {"control": {"receive": 50}})
    g = next(g for g in data["groups"] if g["what"].startswith("handoff"))
    assert g["arms"]["treatment"]["units"] == 0 and g["versus"]["treatment"]["verdict"].startswith("too few")
    assert "treatment" in format_report(data)


def test_ab_a_url_that_does_not_parse_exits_2_naming_it(capsys):
    """An unclosed IPv6 host raised ValueError ("Invalid IPv6 URL") out of urlsplit: exit 1 with a traceback."""
    assert main(["ab", "--metrics", "http://[::1", "--timeout", "5"]) == 2
    err = capsys.readouterr().err
    assert "http://[::1: cannot read the URL" in err and "Invalid IPv6 URL" in err and "Traceback" not in err, err


def _set(scrape: bytes, series: str, value: str) -> tuple[str, int]:
    """``scrape`` with the sample ``series`` (its name and labels as written) set to ``value``; and its line."""
    lines = scrape.decode().splitlines()
    n = next(i for i, line in enumerate(lines) if line.startswith(series + " "))
    lines[n] = f"{series} {value}"
    return "\n".join(lines) + "\n", n + 1


def test_ab_refuses_a_nan_count_naming_the_file_the_line_and_the_series(tmp_path, capsys):
    """A NaN _count raised "cannot convert float NaN to integer" (int(min(n, ...))), with --json too."""
    f = tmp_path / "metrics.txt"
    series = 'omni_accum_ab_merge_seconds_count{arm="control"}'
    text, line = _set(_scrape(_spread(8e-6), _spread(40e-6)), series, "NaN")
    f.write_text(text)
    for extra in ([], ["--json"]):
        assert main(["ab", "--metrics", str(f), *extra]) == 2
        got = capsys.readouterr()
        assert got.out == "" and "Traceback" not in got.err, got
        assert f"{f}, line {line}: {series} is NaN: not a valid histogram" in got.err, got.err


@pytest.mark.parametrize(
    ("series", "value", "wanted"),
    [
        ('omni_accum_ab_merge_seconds_sum{arm="treatment"}', "+Inf", "is +Inf: not a valid histogram"),
        ('omni_accum_ab_merge_seconds_bucket{arm="control",le="1e-06"}', "-3", "is -3: not a valid histogram"),
        (  # fewer at 0.01 than at 0.0025: the buckets are cumulative
            'omni_accum_ab_merge_seconds_bucket{arm="control",le="0.01"}',
            "5",
            'is 5, less than 200 at le="0.0025": not a valid histogram',
        ),
        (
            'omni_accum_ab_handoff_seconds_count{arm="treatment",kind="prefill",pair="0->1"}',
            "150",
            'is 150 but its le="+Inf" bucket is 200: not a valid histogram',
        ),
        ('omni_accum_ab_requests_total{arm="control",role="receive"}', "-Inf", "is -Inf: not a valid counter"),
    ],
)
def test_ab_refuses_a_corrupt_histogram_naming_the_line_and_the_fault(tmp_path, capsys, series, value, wanted):
    """A +Inf _sum printed "inf ms [nan ms, inf ms]" and "within the noise" (exit 0; --json wrote Infinity and NaN);
    a negative or decreasing bucket, or a _count unlike the +Inf bucket, gave percentiles from nonsense."""
    f = tmp_path / "metrics.txt"
    text, line = _set(_scrape(_spread(8e-6), _spread(40e-6)), series, value)
    f.write_text(text)
    for extra in ([], ["--json"]):
        assert main(["ab", "--metrics", str(f), *extra]) == 2
        got = capsys.readouterr()
        assert got.out == "" and "Traceback" not in got.err, got
        assert f"{f}, line {line}: {series} {wanted}" in got.err, got.err


def test_ab_ignores_nan_in_series_it_does_not_read_and_writes_standard_json(tmp_path, capsys):
    """Only the series ab reads are checked: a NaN gauge elsewhere on the page (or in the _created series) is
    not a reason to refuse the scrape; the JSON has no NaN or Infinity (json.loads refuses them here)."""
    f = tmp_path / "metrics.txt"
    text, _ = _set(_scrape(_spread(8e-6), _spread(40e-6)), 'omni_accum_ab_merge_seconds_created{arm="control"}', "NaN")
    f.write_text(text + "# HELP other_gauge x\n# TYPE other_gauge gauge\nother_gauge NaN\nother_inf +Inf\n")
    assert main(["ab", "--metrics", str(f), "--json"]) == 0

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    data = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert next(g for g in data["groups"] if g["what"] == "merge")["arms"]["control"]["count"] == 200


def test_an_openmetrics_scrape_gives_every_arm(tmp_path, capsys):
    """The text parser ends a family at its first ``_created`` sample: an OpenMetrics page gave the first arm only,
    and no word. Read with the OpenMetrics parser, both arms come back with the same figures as the text format."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

    reg = CollectorRegistry()
    h = Histogram("omni_accum_ab_merge_seconds", "x", ["arm"], registry=reg, buckets=(1e-4, 1e-3, 1e-2))
    c = Counter("omni_accum_ab_requests_total", "x", ["arm", "role"], registry=reg)
    for i, arm in enumerate(("control", "b")):
        for k in range(60):
            h.labels(arm).observe((k % 7 + i) * 1e-4)
        c.labels(arm, "receive").inc(40)
    got = {}
    for name, text in (("text", generate_latest(reg)), ("om", openmetrics(reg))):
        f = tmp_path / f"{name}.txt"
        f.write_bytes(text)
        assert main(["ab", "--metrics", str(f), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        got[name] = data["groups"][0]["arms"]
    assert set(got["om"]) == {"control", "b"} and got["om"] == got["text"]


@pytest.mark.parametrize(
    "text, said",
    [
        (  # two finite series of one arm whose sum is past a float's range
            "".join(f'omni_accum_ab_merge_seconds_{s}{{arm="a",instance="{i}"{le}}} {v}\n' for i in (1, 2)
                    for s, le, v in (("bucket", ',le="+Inf"', "1e308"), ("count", "", "1e308"), ("sum", "", "1")))
            + 'omni_accum_ab_requests_total{arm="a",role="receive"} 40\n',
            "the merge series of arm 'a' add up past a float's range",
        ),
        (  # finite values whose figures overflow (a bucket bound near 1e308)
            'omni_accum_ab_merge_seconds_bucket{arm="a",le="1e300"} 50\n'
            'omni_accum_ab_merge_seconds_bucket{arm="a",le="+Inf"} 50\n'
            'omni_accum_ab_merge_seconds_count{arm="a"} 50\nomni_accum_ab_merge_seconds_sum{arm="a"} 1\n'
            'omni_accum_ab_requests_total{arm="a",role="receive"} 40\n',
            "the merge figures of arm 'a' overflow",
        ),
    ],
)
def test_figures_past_a_floats_range_are_refused_not_a_traceback(tmp_path, capsys, text, said):
    f = tmp_path / "m.txt"
    f.write_text("# TYPE omni_accum_ab_merge_seconds histogram\n" + text)
    for extra in ([], ["--json"]):
        assert main(["ab", "--metrics", str(f), *extra]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err


def test_series_of_one_arm_with_different_bucket_bounds_are_refused_not_added(tmp_path, capsys):
    """Two processes of one arm whose histograms have different bounds (another omni-accum version) were added per
    ``le``: the union of bounds is not one histogram (its buckets could decrease), and no word was said."""

    def series(instance: str, bounds: tuple[str, ...], counts: tuple[int, ...]) -> str:
        lines = [f'omni_accum_ab_merge_seconds_bucket{{arm="a",instance="{instance}",le="{le}"}} {c}\n'
                 for le, c in zip(bounds, counts)]  # fmt: skip
        tail = (f'omni_accum_ab_merge_seconds_count{{arm="a",instance="{instance}"}} {counts[-1]}\n'
                f'omni_accum_ab_merge_seconds_sum{{arm="a",instance="{instance}"}} 0.01\n')  # fmt: skip
        return "".join(lines) + tail

    head = "# TYPE omni_accum_ab_merge_seconds histogram\n"
    tail = 'omni_accum_ab_requests_total{arm="a",role="receive"} 40\n'
    f = tmp_path / "m.txt"
    f.write_text(head + series("1", ("0.001", "0.01", "+Inf"), (10, 50, 50))
                 + series("2", ("0.002", "0.01", "+Inf"), (40, 50, 50)) + tail)  # fmt: skip
    for extra in ([], ["--json"]):
        assert main(["ab", "--metrics", str(f), *extra]) == 2
        got = capsys.readouterr()
        assert got.out == "" and "Traceback" not in got.err, got
        said = ('omni_accum_ab_merge_seconds{arm="a",instance="2"} has buckets up to le 0.002, 0.01, +Inf, but '
                'omni_accum_ab_merge_seconds{arm="a",instance="1"} of the same arm has 0.001, 0.01, +Inf')
        assert said in got.err, got.err
        assert "different bucket bounds cannot be added" in got.err
    # two scrapes one after the other (a family twice on the page): the same check, not "not the text format"
    f.write_text(head + series("1", ("0.001", "0.01", "+Inf"), (10, 50, 50)) + tail
                 + head + series("2", ("0.002", "0.01", "+Inf"), (40, 50, 50)))  # fmt: skip
    assert main(["ab", "--metrics", str(f)]) == 2
    err = capsys.readouterr().err
    assert "different bucket bounds cannot be added" in err and 'instance="1"' in err and "Traceback" not in err, err
    f.write_text(head + series("1", ("0.001", "0.01", "+Inf"), (10, 50, 50))
                 + series("2", ("0.001", "0.01", "+Inf"), (40, 50, 50)) + tail)  # fmt: skip
    assert main(["ab", "--metrics", str(f), "--json"]) == 0  # the same bounds: added
    data = json.loads(capsys.readouterr().out)
    assert data["groups"][0]["arms"]["a"]["count"] == 100
