"""``benchmarks/e2e/seed_venv.py``: what a harness virtualenv started from ``.venv``'s packages keeps.

The seeded build itself runs in tests/test_e2e_server.py (under ``CI=true`` the README's test command
builds ``.venv`` first, so setup_env.sh starts the harness from it).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from importlib.metadata import PathDistribution
from pathlib import Path

import pytest

SEED_PY = Path(__file__).resolve().parent.parent / "benchmarks" / "e2e" / "seed_venv.py"


@pytest.fixture(scope="module")
def seed():
    spec = importlib.util.spec_from_file_location("e2e_seed_venv", SEED_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


REQUIRES = {
    "app": ["lib-a>=1", "Lib_B[fast]; python_version >= '3'", "win-only; sys_platform == 'win32'",
            "old-only; python_version < '3'", "absent-optional"],
    "lib-a": ["app"],  # a cycle
    "lib-b": ["plain", "speedup; extra == 'fast'", "docs-tool; extra == 'docs'"],
    "plain": [],
    "speedup": ["speedup-core"],
    "speedup-core": [],
    "docs-tool": [],
    "win-only": [],
    "old-only": [],
    "unrelated": ["plain"],
}


def test_needed_follows_requirements_markers_and_extras(seed):
    got = seed.needed(REQUIRES, ["App"], env={"sys_platform": "linux"})
    assert got == {"app", "lib-a", "lib-b", "plain", "speedup", "speedup-core"}


def test_an_extra_asked_later_adds_its_requirements(seed):
    requires = {"root": ["mid", "lib-b[docs]"], "mid": ["lib-b"], **{k: v for k, v in REQUIRES.items() if k != "app"}}
    got = seed.needed(requires, ["root"])
    assert {"docs-tool", "plain"} <= got and "speedup" not in got


def test_the_platform_marker_is_evaluated(seed):
    assert "win-only" in seed.needed(REQUIRES, ["app"], env={"sys_platform": "win32"})


def test_prune_keeps_what_the_roots_need_and_names_the_rest(seed):
    gone = seed.prune(["pytest"], dry_run=True)
    for dep in ("pytest", "pluggy", "iniconfig", "pip"):
        assert dep not in gone
    assert "torch" in gone  # installed here, not needed by pytest


def test_prune_refuses_a_root_that_is_not_installed(seed):
    with pytest.raises(SystemExit, match="no-such-dist"):
        seed.prune(["pytest", "no-such-dist"], dry_run=True)


def test_the_seeds_files_outside_site_packages_are_copied_and_point_at_this_python(seed, tmp_path):
    seed_root, venv = tmp_path / "seed", tmp_path / "venv"
    (seed_root / "bin").mkdir(parents=True)
    (seed_root / "share" / "man").mkdir(parents=True)
    (venv / "bin").mkdir(parents=True)
    site = venv / "lib" / "python3.11" / "site-packages"
    info = site / "tool-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tool\nVersion: 1.0\n")
    (info / "RECORD").write_text("".join(f"../../../bin/{n},,\n" for n in ("tool", "tool-prog", "kept", "gone"))
                                 + "../../../bin/__pycache__/tool.cpython-311.pyc,,\n../../../share/man/tool.1,,\n"
                                 + "tool/__init__.py,,\ntool-1.0.dist-info/RECORD,,\n")
    script = f"#!{seed_root}/bin/python\nimport sys\nprint('tool ran', sys.executable)\n"
    (seed_root / "bin" / "tool").write_text(script)
    (seed_root / "bin" / "tool").chmod(0o755)
    (seed_root / "bin" / "tool-prog").write_bytes(b"\x7fELF\x00#!" + str(seed_root).encode())  # a program: as it is
    (seed_root / "bin" / "tool-prog").chmod(0o751)
    (seed_root / "bin" / "kept").write_text("seed's\n")
    (seed_root / "share" / "man" / "tool.1").write_text(".TH TOOL 1\n")
    (venv / "bin" / "kept").write_text("mine\n")  # one already there stays as it is
    python = str(venv / "bin" / "python")
    (venv / "bin" / "python").symlink_to(sys.executable)

    made, lost = seed.copy_outside(str(venv), str(seed_root), python, [PathDistribution(info)])
    # site-packages' own files (tool/__init__.py) and compiled files are not the seed's to give
    assert made == ["bin/tool", "bin/tool-prog", "share/man/tool.1"] and lost == ["bin/gone"]
    assert (venv / "bin" / "kept").read_text() == "mine\n"
    assert (venv / "share" / "man" / "tool.1").read_text() == ".TH TOOL 1\n"
    assert (venv / "bin" / "tool").read_text().splitlines()[0] == f"#!{python}"
    assert (venv / "bin" / "tool-prog").read_bytes() == (seed_root / "bin" / "tool-prog").read_bytes()
    assert (venv / "bin" / "tool-prog").stat().st_mode & 0o777 == 0o751
    out = subprocess.run([str(venv / "bin" / "tool")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("tool ran"), out.stderr


def test_a_distribution_that_lost_a_file_to_another_is_named(seed, tmp_path, monkeypatch):
    site = tmp_path / "site"
    for name, files in (("keeper", ["shared/__init__.py", "shared/__pycache__/x.pyc"]), ("whole", ["whole.py"])):
        info = site / f"{name}-2.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 2.0\n")
        (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    (site / "whole.py").write_text("")
    dists = {n: PathDistribution(site / f"{n}-2.0.dist-info") for n in ("keeper", "whole")}
    monkeypatch.setattr(seed, "_installed", lambda: dists)
    assert seed.broken() == ["keeper==2.0"]  # shared/__init__.py went with the other owner; a .pyc does not count
    (site / "shared").mkdir()
    (site / "shared" / "__init__.py").write_text("")
    assert seed.broken() == []
