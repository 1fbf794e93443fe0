"""Release hygiene of pyproject.toml (issue 32, item 12): what a build ships, read from the metadata itself.

``scripts/release.sh`` builds the sdist and wheel and smoke-tests them in a clean environment (minutes, so
not in the suite); these checks catch the same mistakes at the source: a license setuptools deprecates,
a preset left out of the wheel, an entry point naming a module that is not shipped (a package left out of
``[tool.setuptools] packages``: tests/test_layout.py).
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PLUGINS = sorted((ROOT / "examples" / "plugins").glob("*/pyproject.toml"))
SPDX = re.compile(r"^[A-Za-z0-9.+-]+( (AND|OR|WITH) [A-Za-z0-9.+-]+)*$")


def _setuptools_floor(requires: list[str]) -> tuple[int, ...]:
    for req in requires:
        m = re.fullmatch(r"setuptools\s*>=\s*([0-9.]+)", req.strip())
        if m:
            return tuple(int(x) for x in m.group(1).split("."))
    return ()


@pytest.mark.parametrize("path", [ROOT / "pyproject.toml", *PLUGINS], ids=lambda p: p.parent.name)
def test_license_is_an_spdx_string_that_the_required_setuptools_reads(path):
    """A ``license = {text = ...}`` table is deprecated by setuptools (no builds after 2027-02-18); an SPDX
    expression needs setuptools >= 77 (PEP 639), so the build requirement must say so."""
    doc = tomllib.loads(path.read_text())
    lic = doc["project"].get("license")
    assert isinstance(lic, str) and SPDX.match(lic), f"{path}: project.license must be an SPDX string, got {lic!r}"
    if doc["build-system"]["build-backend"].startswith("setuptools"):
        assert _setuptools_floor(doc["build-system"]["requires"]) >= (77,), doc["build-system"]["requires"]
    assert not any(c.startswith("License ::") for c in doc["project"].get("classifiers", [])), "license classifiers"
    for pattern in doc["project"].get("license-files", []):
        assert list(path.parent.glob(pattern)), f"{path}: license-files {pattern!r} matches no file"


def _package_dirs() -> dict[str, Path]:
    """Every package the wheel ships, by name, and its source folder (``tool.setuptools.package-dir``)."""
    st = PYPROJECT["tool"]["setuptools"]
    mapped = st.get("package-dir", {})
    out = {}
    for name in st["packages"]:
        base = next((p for p in sorted(mapped, key=len, reverse=True) if name == p or name.startswith(p + ".")), None)
        rel = Path(mapped[base], *name[len(base) :].split(".")[1:]) if base else Path(*name.split("."))
        out[name] = ROOT / rel
    return out


def test_package_data_globs_cover_every_preset_and_deploy_example():
    """Every ``config/**/*.yaml`` (the presets ``validate qwen3-omni`` loads by name, the deploy examples)
    is matched by a package-data glob of the package holding it."""
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    by_dir = {d.resolve(): name for name, d in _package_dirs().items()}
    yamls = sorted((ROOT / "config").rglob("*.yaml"))
    assert len(yamls) >= 3
    unshipped = []
    for f in yamls:
        pkg = by_dir.get(f.parent.resolve())
        if pkg is None or not any(fnmatch.fnmatch(f.name, g) for g in data.get(pkg, [])):
            unshipped.append(f"{f.relative_to(ROOT)} (package {pkg})")
    assert not unshipped, f"not in the wheel's package data: {unshipped}"


def test_entry_points_name_shipped_modules():
    """Every entry point (the built-in strategies, the vllm plugin hooks, the console script) names a module
    in a shipped package, so the installed wheel can load it."""
    dirs = _package_dirs()
    targets = [PYPROJECT["project"]["scripts"]["omni-accum"]]
    targets += [t for group in PYPROJECT["project"]["entry-points"].values() for t in group.values()]
    assert len(targets) >= 10
    for target in targets:
        module = target.partition(":")[0]
        pkg, _, leaf = module.rpartition(".")
        if module in dirs:
            continue
        assert pkg in dirs and (dirs[pkg] / f"{leaf}.py").is_file(), f"entry point {target!r}: module not shipped"


def test_release_script_checks_what_it_builds():
    """scripts/release.sh runs twine check, installs the wheel into a clean environment and smoke-tests the
    entry point, the presets and doctor there (the script itself takes minutes: run it before a release)."""
    script = ROOT / "scripts" / "release.sh"
    text = script.read_text()
    assert script.stat().st_mode & 0o111
    for needle in ("twine check --strict", "-m build", "pip install -q \"$WHEEL\"", "validate", "explain", "doctor"):
        assert needle in text, needle


@pytest.mark.parametrize("argv", [["--version"], ["strategies"]])
def test_the_command_line_runs_without_numpy(argv):
    """numpy is not a core dependency (torch, pluggy, pydantic, PyYAML): a module the command line imports with a
    top-level ``import numpy`` made ``omni-accum --version`` a traceback in the release script's clean environment
    (``pip install omni-accum``, no vllm). numpy is hidden from a fresh interpreter here, as it is absent there."""
    import subprocess
    import sys

    code = f"import sys; sys.modules['numpy'] = None\nfrom omni_accum.cli.main import main\nsys.exit(main({argv!r}))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
