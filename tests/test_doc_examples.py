"""Every ``omni-accum bench`` and ``omni-accum tune`` example of docs/benchmarks.md, docs/tuning.md and the two
commands' ``--help`` epilogs runs as written (sizes shrunk to a few steps) and shows what it is there to show: a
ratio in every bench table, the decision table (and the gain table when it verifies) for tune. The ``--wire
mooncake`` examples fork their stage processes from the test process's one stage host.

Before this test, several failed or showed nothing: the tune epilog's ``--base qwen3-omni-flat`` stopped with
"nothing to tune"; the mooncake epilog aborted with a child's traceback (upstream raises on the default workload);
the serializer and ``--through vllm-omni`` examples of benchmarks.md printed a ratio column of ``-`` only.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import require_vllm_omni
from omni_accum.cli import bench as bench_cli
from omni_accum.cli import main
from omni_accum.cli import tune as tune_cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "tuning.md"]
_COMMAND = re.compile(r"^(?:\S*/)?omni-accum (bench|tune)\b")
_PLACEHOLDER = re.compile(r"\b(NAME|FILE|DIR|POLICY|OUT)\b")

#: Sizes put in place of an example's own (an option's values are dropped, then these appended).
TINY = {
    "bench": {"--context-lens": "1k", "--concurrency": "1", "--steps": "2", "--repeats": "1",
              "--mooncake-occupancy": "2"},  # and two arms for an occupancy (a fresh master per arm: ~9 s each)
    "tune": {"--context-lens": "1k", "--concurrency": "1", "--decode-steps": "3", "--max-rounds": "1"},
}  # fmt: skip


def _joined(text: str) -> list[str]:
    out, cur = [], ""
    for line in text.splitlines():
        line = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        out.append((cur + line).strip())
        cur = ""
    return out


def doc_examples() -> list[tuple[str, str]]:
    """``(where, command)`` of every bench/tune command in the docs' ``bash`` blocks and inline code, and epilogs."""
    found = []
    for md in DOCS:
        text = md.read_text(encoding="utf-8")
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            found += [(md.name, c) for c in _joined(block) if _COMMAND.match(c)]
        for inline in re.findall(r"`([^`\n]+)`", text):
            if _COMMAND.match(inline) and " --" in inline and not _PLACEHOLDER.search(inline):
                found.append((md.name, inline))
    for name, epilog in (("bench --help", bench_cli.EXAMPLES), ("tune --help", tune_cli.EXAMPLES)):
        found += [(name, c) for c in _joined(epilog) if _COMMAND.match(c)]
    seen: set[str] = set()
    return [(w, c) for w, c in found if not (c in seen or seen.add(c))]


def _shrunk(command: str) -> list[str]:
    argv = shlex.split(command)
    argv = argv[argv.index(next(a for a in argv if a.endswith("omni-accum"))) + 1 :]
    tiny = TINY[argv[0]] if "--show" not in argv else {}
    out: list[str] = []
    skip = False
    for a in argv:
        if a.startswith("--"):
            skip = a in tiny
        if not skip:
            out.append(a)
    for option, value in tiny.items():
        if option != "--mooncake-occupancy" or "--mooncake-occupancy" in argv:
            out += [option, value]
    if "--mooncake-occupancy" in argv and "--arms" not in argv:
        out += ["--arms", "upstream", "qwen3-omni"]
    return out + (["--no-progress"] if "--no-progress" not in out and "--show" not in out else [])


EXAMPLES = doc_examples()


def test_the_examples_are_found():
    where = {w for w, _ in EXAMPLES}
    assert where == {"benchmarks.md", "tuning.md", "bench --help", "tune --help"}, where
    assert any("--through vllm-omni" in c for _, c in EXAMPLES) and any("--wire mooncake" in c for _, c in EXAMPLES)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The files the examples name: the docs' own my-traffic.yaml, a policy, and a tuned table."""
    d = tmp_path_factory.mktemp("examples")
    yaml_block = next(b for b in re.findall(r"```yaml\n(.*?)```", DOCS[0].read_text(), re.S) if "my-traffic" in b)
    (d / "my-traffic.yaml").write_text(yaml_block)
    (d / "my-policy.yaml").write_text("rules:\n  - {match: 'embed.*', strategy: prealloc}\n")
    return d


def _ratio_in_every_table(out: str) -> list[str]:
    """The bench tables (one per bucket) that show no ratio at all."""
    tables = out.split("\ncontext_len=")[1:]
    return [t.splitlines()[0] for t in tables if not re.search(r"\dx \[|~1x \(within noise", t)]


@pytest.mark.parametrize("where, command", EXAMPLES, ids=[f"{w}: {c[:70]}" for w, c in EXAMPLES])
def test_every_example_runs_and_shows_its_figures(folder, monkeypatch, capsys, request, where, command):
    argv = _shrunk(command)
    if "--through" in argv or "--wire" in argv and argv[argv.index("--wire") + 1] != "inproc" or "upstream" in argv:
        require_vllm_omni()
    if "mooncake" in argv:
        from tests.mooncake_fixtures import bench_on_shared_host, require_mooncake

        require_mooncake()
        bench_on_shared_host(request, monkeypatch)
    monkeypatch.chdir(folder)
    if "--show" in argv or "--resume" in argv:  # a table to show, or to resume: the same run without --resume
        first = ["tune", "--quick", "--out", "tuned.yaml", *_shrunk("omni-accum tune")[1:]]
        assert main(first if "--show" in argv else [a for a in argv if a != "--resume"]) == 0
        capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, f"{where}: {command}\n-> {shlex.join(argv)}: exit {rc}\n{err[-2000:]}"
    if argv[0] == "bench" and "--mooncake-occupancy" not in argv:
        assert "p50 vs" in out and not _ratio_in_every_table(out), f"{where}: {command}: no ratio in\n{out}"
    elif argv[0] == "tune" and "--show" not in argv:
        assert "margin" in out, out
        if "--quick" not in argv and "--resume" not in argv:  # a resumed bucket is not verified again
            assert "step gain" in out, f"{where}: {command}: no gain table\n{out}"


def test_a_run_whose_tables_have_no_ratio_says_why_and_what_gives_one():
    """The --through example's note pointed to wire-floor, which --through vllm-omni cannot run."""
    from omni_accum.bench import upstream_notes
    from omni_accum.bench.replay import ArmResult

    failed = ArmResult("upstream", 1000, 1, "shm", requests=1, steps=3, correct=False, error="RuntimeError: 0-d")
    cat = ArmResult("cat", 1000, 1, "shm", requests=1, steps=3, samples_us=[[1.0]])
    (through,) = upstream_notes([failed, cat], "vllm-omni")
    assert "--through vllm-omni cannot run wire-floor, so the tables have no ratio" in through
    assert "--workload qwen3-omni-seed" in through
    (direct,) = upstream_notes([failed, cat])
    assert "the tables have no ratio: add wire-floor to --arms" in direct


def test_a_base_whose_rules_decide_every_key_says_so(tmp_path, capsys):
    """`tune --workload qwen3-omni-seed --base qwen3-omni-flat` (the epilog's example) said only "nothing to tune"."""
    rc = main(["tune", "--workload", "qwen3-omni-seed", "--base", "qwen3-omni-flat", "--out", str(tmp_path / "t.yaml"),
               "--quick", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "nothing to tune" in err
    assert "--base qwen3-omni-flat's rules decide keys the table could: give a --base without them (default)" in err
