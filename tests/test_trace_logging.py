"""``OMNI_ACCUM_TRACE_PLUGINS=1`` and ``-v`` are visible: on the CLI's stderr, and in a library process."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ENV = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_ACCUM_")}


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**ENV, **env}, timeout=120)


CLI = "import sys; from omni_accum.cli.main import main; sys.exit(main(sys.argv[1:] or {argv!r}))"


def test_trace_shows_on_the_cli_stderr():
    r = _run(CLI.format(argv=["explain", "qwen3-omni", "--key", "embed.decode"]), OMNI_ACCUM_TRACE_PLUGINS="1")
    assert r.returncode == 0, r.stderr
    assert re.search(r"omni_accum hook:\s+omni_accum_select_strategy", r.stderr)
    assert "omni_accum hook" not in r.stdout


def test_verbose_shows_debug_lines_on_the_cli_stderr():
    r = _run(CLI.format(argv=["-v", "strategies"]))
    assert r.returncode == 0, r.stderr
    assert "plugin 'prealloc'" in r.stderr and "DEBUG" in r.stderr
    r = _run(CLI.format(argv=["strategies"]))
    assert "DEBUG" not in r.stderr


LIB = """
import torch, omni_accum
pol = omni_accum.load_policy("qwen3-omni")
rx = omni_accum.Receiver(pol)
rx.merge("r", {"embed": {"decode": torch.ones(1, 2)}})
"""


def test_trace_shows_in_a_library_process_without_logging_set_up():
    r = _run(LIB, OMNI_ACCUM_TRACE_PLUGINS="1")
    assert r.returncode == 0, r.stderr
    assert re.search(r"omni_accum hook:\s+omni_accum_select_strategy", r.stderr)


def test_a_library_process_without_trace_gets_no_handler():
    r = _run(LIB + "\nimport logging; print(logging.getLogger('omni_accum').handlers)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]" and r.stderr == ""


def test_an_application_handler_is_kept():
    r = _run(
        "import logging, io; s = io.StringIO(); h = logging.StreamHandler(s); "
        "lg = logging.getLogger('omni_accum'); lg.addHandler(h); lg.setLevel(logging.INFO)\n"
        + LIB
        + "\nprint(len(lg.handlers), 'omni_accum hook' in s.getvalue())",
        OMNI_ACCUM_TRACE_PLUGINS="1",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1 True"
