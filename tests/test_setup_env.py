"""The set-up script installs every extra the suite needs (CI failed once when an edit dropped one).

``scripts/env.sh`` is what the README's two commands and ``.ci/run`` use to build the environment; a
test that needs an extra it does not install fails under ``CI=true`` (Mooncake is one: a failure,
not a skip, there).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV_SH = (ROOT / "scripts" / "env.sh").read_text()


def _installed_extras() -> list[set[str]]:
    """The extras of every ``pip install -e "$ROOT[...]"`` line of env.sh (one per release branch)."""
    found = [set(m.split(",")) for m in re.findall(r'pip install -q -e "\$ROOT\[([a-z0-9_,-]+)\]"', ENV_SH)]
    assert found, "env.sh no longer installs the project with extras"
    return found


def test_every_branch_installs_the_extras_the_suite_needs():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    needed = {"test", "plot", "mooncake"}
    assert needed <= set(extras), f"pyproject lost an extra: {needed - set(extras)}"
    for branch in _installed_extras():
        assert needed <= branch, f"env.sh installs [{','.join(sorted(branch))}]; missing {sorted(needed - branch)}"


def test_the_default_release_installs_vllm_through_the_extra():
    assert any("vllm" in branch for branch in _installed_extras())


def test_libibverbs_is_installed_when_root():
    # Mooncake's transfer engine links libibverbs.so.1 even for TCP.
    assert re.search(r"apt-get install [^\n]*libibverbs1", ENV_SH)
    assert "ldconfig -p" in ENV_SH


def test_the_stamp_covers_the_script_itself():
    # An edit to the installer must re-run it in an existing environment.
    assert re.search(r'want=.*cat "\$ROOT/scripts/env.sh"', ENV_SH)


def test_the_other_releases_runs_leave_out_only_the_tests_marked_once():
    # The recovery-from-kill tests run once (0.30.0), the rest of the integration files in every release's run.
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert re.search(r'python -m pytest -m "not once" "\$@"', test_sh)
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("once:") for m in markers)
