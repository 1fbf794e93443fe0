"""The conformance kit needs hypothesis, which only the ``testing`` (and ``test``) extras bring: without it the
fixture fails the test naming ``pip install 'omni-accum[testing]'``."""

from __future__ import annotations

import builtins
import sys
import tomllib
from pathlib import Path

import pytest

from omni_accum import pytest_plugin

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def no_hypothesis(monkeypatch):
    real = builtins.__import__

    def imp(name, *a, **k):
        if name == "hypothesis" or name.startswith("hypothesis."):
            raise ModuleNotFoundError("No module named 'hypothesis'", name="hypothesis")
        return real(name, *a, **k)

    for mod in [m for m in sys.modules if m == "hypothesis" or m.startswith("hypothesis.")] + ["omni_accum.testing"]:
        monkeypatch.delitem(sys.modules, mod, raising=False)
    monkeypatch.setattr(builtins, "__import__", imp)


def test_the_fixture_names_the_testing_extra_without_hypothesis(no_hypothesis):
    with pytest.raises(pytest.fail.Exception, match=r"pip install 'omni-accum\[testing\]'"):
        pytest_plugin.load_check_conformance()


def test_the_kit_names_the_testing_extra_without_hypothesis(no_hypothesis):
    with pytest.raises(ImportError, match=r"pip install 'omni-accum\[testing\]'"):
        import omni_accum.testing  # noqa: F401


def test_the_testing_extra_brings_hypothesis():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("hypothesis") for req in extras["testing"])
