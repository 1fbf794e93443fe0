"""Presets load by name from a normal (non-editable) install: build a wheel, install it, load them.

The wheel is built from a copy of the source tree (so the checkout gets no build/ or egg-info),
installed with ``pip install --no-deps --target``, and imported in a fresh interpreter started
without site processing, so the editable install of the checkout cannot be picked up.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "omni_accum", "strategies", "config")

CHECK = r"""
import json, sys
import omni_accum
from omni_accum.policy.loader import preset_names
from omni_accum import cli
out = {"file": omni_accum.__file__, "presets": preset_names(), "rules": {}}
for name in preset_names():
    out["rules"][name] = len(omni_accum.load_policy(name).rules)
p = omni_accum.load_policy("qwen3-omni")
out["embed.decode"] = p.resolve("embed.decode").strategy
spec = omni_accum.get_manager().spec("prealloc")
out["prealloc_module"] = sys.modules[type(spec.factory(spec.params_model())).__module__].__file__
out["validate"] = cli.main(["validate", "qwen3-omni", "default", "qwen3-omni-flat"])
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=ignore)
        else:
            shutil.copy2(p, src / name)
    wheels = tmp / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    r = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = wheels.glob("omni_accum-*.whl")
    target = tmp / "site"
    r = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return target


def test_wheel_ships_every_preset(installed):
    shipped = sorted(p.stem for p in (installed / "omni_accum" / "config").glob("*.yaml"))
    in_tree = sorted(p.stem for p in (ROOT / "config").glob("*.yaml"))
    assert shipped == in_tree and {"default", "qwen3-omni", "qwen3-omni-flat"} <= set(shipped)
    assert not (installed / "omni_accum" / "config" / "__editable__").exists()


def test_presets_load_by_name_from_the_installed_wheel(installed, tmp_path):
    purelib = sysconfig.get_paths()["purelib"]  # torch, pydantic, pluggy, yaml
    env = {"PYTHONPATH": f"{installed}:{purelib}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    # -S: no site processing, so the checkout's editable install (a .pth finder) is not active.
    r = subprocess.run(
        [sys.executable, "-S", "-c", CHECK], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    assert Path(out["file"]).resolve().is_relative_to(installed.resolve()), out["file"]
    assert Path(out["prealloc_module"]).resolve().is_relative_to(installed.resolve()), out["prealloc_module"]
    assert {"default", "qwen3-omni", "qwen3-omni-flat"} <= set(out["presets"])
    assert out["rules"]["qwen3-omni"] >= 10 and out["embed.decode"] == "prealloc"
    assert out["validate"] == 0
