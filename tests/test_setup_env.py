"""The set-up script installs every extra the suite needs (CI failed once when an edit dropped one).

``scripts/env.sh`` is what the README's two commands and ``.ci/run`` use to build the environment; a
test that needs an extra it does not install fails under ``CI=true`` (Mooncake is one: a failure,
not a skip, there).
"""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

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


def _need_disk(*triples: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = f'source "{ROOT / "scripts" / "disk.sh"}" && omni_accum_need_disk "$@"'
    return subprocess.run(["bash", "-c", cmd, "disk", *triples], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


FREE_KB = 10_000_000  # what the stub df says is available: 10.24 GB (10^9 bytes), i.e. "10.2 GB free"


@pytest.fixture
def fixed_df(tmp_path: Path) -> dict[str, str]:
    """The environment of a disk check whose ``df`` is a stub first on PATH: ``df -Pk PATH`` (POSIX output,
    1024-byte blocks) says ``FREE_KB`` are available on mount point ``/stubfs``, whatever PATH, and notes the
    arguments it got. The live free space of a shared disk (other builds and tests write it meanwhile) decides
    nothing."""
    bin_dir = tmp_path / "stub-bin"
    bin_dir.mkdir()
    df = bin_dir / "df"
    df.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{tmp_path / "df-args"}"\n'
        "echo 'Filesystem     1024-blocks     Used Available Capacity Mounted on'\n"
        f"echo 'stub              20000000  7500000 {FREE_KB}      43% /stubfs'\n"
    )
    df.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"}


def test_the_disk_check_passes_a_build_that_fits_and_refuses_one_that_does_not(tmp_path, fixed_df):
    assert _need_disk(str(tmp_path / "venv"), "10.2", "a small build", env=fixed_df).returncode == 0
    refused = _need_disk(str(tmp_path / "a" / "venv"), "10.3", "a huge build", env=fixed_df)
    assert refused.returncode == 1, refused.stderr
    # df was asked about the nearest existing parent of the path
    assert (tmp_path / "df-args").read_text().splitlines()[-1] == f"-Pk {tmp_path}"
    # One line that names what, where (the path and its mount point), what is needed and what is free.
    assert "not enough disk on /stubfs: about 10.3 GB needed for a huge build" in refused.stderr, refused.stderr
    assert str(tmp_path / "a" / "venv") in refused.stderr and "; 10.2 GB free." in refused.stderr
    assert "OMNI_ACCUM_SKIP_DISK_CHECK=1" in refused.stderr
    # The switch turns it off, with any of the other switches' on words (it took only "1").
    for word in ("1", "true", " Yes"):
        skip = {**fixed_df, "OMNI_ACCUM_SKIP_DISK_CHECK": word}
        assert _need_disk(str(tmp_path), "10.3", "x", env=skip).returncode == 0, word
    assert _need_disk(str(tmp_path), "10.3", "x", env={**fixed_df, "OMNI_ACCUM_SKIP_DISK_CHECK": "0"}).returncode == 1


def test_the_disk_check_adds_up_builds_that_share_a_file_system(tmp_path, fixed_df):
    # Each fits alone; together they do not (test.sh builds four environments side by side).
    share = "6.2"  # of 10.24 GB free
    assert _need_disk(str(tmp_path / "one"), share, "one", env=fixed_df).returncode == 0
    assert _need_disk(str(tmp_path / "two"), share, "two", env=fixed_df).returncode == 0
    both = _need_disk(str(tmp_path / "one"), share, "one", str(tmp_path / "two"), share, "two", env=fixed_df)
    assert both.returncode == 1, both.stderr
    assert "about 12.4 GB needed for one (" in both.stderr and "two (" in both.stderr, both.stderr
    fits = _need_disk(str(tmp_path / "one"), "5", "one", str(tmp_path / "two"), "5", "two", env=fixed_df)
    assert fits.returncode == 0, fits.stderr  # 10 of 10.24 GB


def test_the_environments_are_checked_for_room_before_anything_is_built():
    # env.sh: before each new virtualenv (seeded or from scratch); test.sh: every build of the run, summed,
    # before the first one starts.
    for guard, build in (("1.5", 'cp -al "$src/."'), ("7", '"$PY" -m venv "$VENV"\n')):
        check = ENV_SH.index(f'omni_accum_need_disk "$VENV" {guard} ')
        assert check < ENV_SH.index(build, check), f"env.sh builds before checking the disk ({build!r})"
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert test_sh.index('omni_accum_need_disk "${builds[@]}"') < test_sh.index('( source "$ROOT/scripts/env.sh" )')


def test_the_readme_main_command_runs_where_its_output_folder_is_missing(tmp_path):
    """``bash scripts/main.sh``, the README's first command, failed on a fresh clone from the day ``tune`` began
    refusing an ``--out`` whose folder is missing (a user's typo must not make folders): the job's own ``out/`` is
    git-ignored, so a fresh clone has none. The job makes its output folder (``OMNI_ACCUM_OUT`` here, a fresh one);
    its three parts run: a complete tuned policy that ``validate`` accepts, the wires' table, what to deploy."""
    out = tmp_path / "fresh" / "out"
    env = {**os.environ, "OMNI_ACCUM_OUT": str(out)}
    env.pop("OMNI_ACCUM_POLICY", None)
    run = subprocess.run(["bash", str(ROOT / "scripts" / "main.sh"), "--quick"], env=env, capture_output=True,
                         text=True, timeout=900, check=False)
    said = run.stdout + run.stderr
    assert run.returncode == 0, said[-3000:]
    policy = out / "tuned-policy.yaml"
    assert f"wrote {policy} (complete)" in said, said[-3000:]
    from omni_accum.cli.main import main

    assert main(["validate", str(policy)]) == 0
    assert re.search(r"8000 x c1\s+arena\s.*\byes\s*$", said, re.M) and "== 3. what to deploy" in said, said[-3000:]
