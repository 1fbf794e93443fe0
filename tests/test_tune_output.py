"""What tune prints: a kept baseline's row, the lines of a resumed run, the time of a quick bucket, `--out -`; what it
writes and whose files it trusts: the partial file --resume reads, links at --out and its lock, owners, long names."""

from __future__ import annotations

import errno
import io
import os
import re
import stat
from pathlib import Path

import pytest

import omni_accum
from omni_accum import cli
from omni_accum.cli import main
from omni_accum.policy import TunedCell, TunedTable
from omni_accum.tuner.core import TuneError
from omni_accum.tuner.report import decision_table
from omni_accum.tuner.run import TuneOptions, output_problem, tune, write_atomic

# the one-key workload, the clock, the options and command line of tune's own tests
from tests.test_tune_cli import SMALL, _Clock, _opts, _tune_args


def test_a_kept_baseline_row_shows_no_margin_of_a_challenger():
    """A row whose strategy is `cat` (kept) showed token_list's margin, interval and time as its own."""
    cell = TunedCell(key="embed.decode", context_len=1000, concurrency=1, strategy="cat", baseline="cat",
                     margin=0.026, ci=(-0.042, 0.069), timings_us={"cat": 10.9, "token_list": 10.6},
                     reason="token_list: +2.6% [-4.2%, +6.9%]: the interval crosses 0")  # fmt: skip
    text = decision_table(TunedTable(context_len_edges=[1000], concurrency_edges=[1], cells=[cell]))
    row = next(line for line in text.splitlines() if line.startswith(">="))
    assert "+2.6%" not in row and "-4.2%" not in row and "10.6 us" not in row and "10.9 us" in row, row
    assert "token_list: +2.6% [-4.2%, +6.9%]" in text  # under why


def test_a_resumed_run_says_once_per_bucket_that_it_was_reused_and_names_one_file(tmp_path, monkeypatch):
    """Each reused bucket printed "reused from t2.yaml" (the file read was t2.partial.yaml) and "0 round(s), 0.0 s"."""
    opts = dict(workload=SMALL, out=tmp_path / "t.yaml", context_lens=[64, 256], concurrency=[1], decode_steps=4,
                max_rounds=1, verify=False, quick=True)  # fmt: skip
    monkeypatch.setattr("omni_accum.tuner.run.time", _Clock())
    first = tune(TuneOptions(**opts, budget_s=1))
    assert not first.complete
    monkeypatch.undo()
    log = io.StringIO()
    res = tune(TuneOptions(**opts, resume=True), log=log)
    lines = log.getvalue().splitlines()
    assert res.complete
    assert f"--resume: reusing the buckets of {tmp_path / 't.partial.yaml'}" in lines
    assert [ln for ln in lines if "context_len=64 " in ln] == ["bucket context_len=64 concurrency=1: reused (--resume)"]
    (measured,) = [ln for ln in lines if "context_len=256 " in ln]
    assert re.fullmatch(r"bucket context_len=256 concurrency=1: \d+ round\(s\), \d+\.\d\d s", measured), measured


def test_out_dash_says_stdout_is_not_supported(capsys):
    assert main(["tune", "--out", "-", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "--out -: stdout is not supported" in err and "without an extension" not in err


# -- what tune writes, and whose files it trusts ----------------------------------------------------------------- #

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives files to another user (uid 65534): needs root")


def _stopped_run(tmp_path: Path, monkeypatch) -> Path:
    """A run stopped by its budget after its first bucket: the partial file beside --out (tuned.yaml)."""
    monkeypatch.setattr("omni_accum.tuner.run.time", _Clock())
    assert not tune(_opts(tmp_path, context_lens=[64, 256], budget_s=1)).complete
    monkeypatch.undo()
    return tmp_path / "tuned.partial.yaml"


@pytest.mark.parametrize("how", ["another user's", "group-writable", "world-writable", "a symlink"])
def test_resume_refuses_a_partial_file_that_is_not_this_users_own(tmp_path, monkeypatch, capsys, how):
    """`tune --resume` reused a partial table another user planted in a shared folder, and wrote its cells (a
    prealloc of 16777216 rows, say) into the "complete" table."""
    part = _stopped_run(tmp_path, monkeypatch)
    if how == "another user's":
        if os.geteuid() != 0:
            pytest.skip("gives the file to another user (uid 65534): needs root")
        os.chown(part, NOBODY, NOBODY)
    elif how == "a symlink":
        planted = tmp_path / "planted.yaml"
        part.rename(planted)
        part.symlink_to(planted)
    else:
        part.chmod(0o664 if how == "group-writable" else 0o646)
    before = part.read_bytes()
    assert cli.main(_tune_args(tmp_path, tmp_path / "tuned.yaml", "--context-lens", "64", "256", "--resume")) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"--resume: {part}: refused (" in err and "reused nothing" in err, err
    said = {"another user's": "owned by another user", "a symlink": "a symlink"}.get(how, "group- or world-writable")
    assert said in err
    assert part.read_bytes() == before and not (tmp_path / "tuned.yaml").exists()


@needs_root
def test_resume_refuses_an_out_of_another_user_and_follows_this_users_own_link(tmp_path, monkeypatch, capsys):
    out = tmp_path / "tuned.yaml"
    tune(_opts(tmp_path))
    os.chown(out, NOBODY, NOBODY)
    with pytest.raises(TuneError, match=rf"--resume: {re.escape(str(out))}: refused \(owned by another user"):
        tune(_opts(tmp_path, resume=True))
    os.chown(out, 0, 0)
    (tmp_path / "deployed").mkdir()
    deployed = out.rename(tmp_path / "deployed" / "t.yaml")
    out.symlink_to(deployed)  # root's own link to a deployed table: followed, and its buckets reused
    log = io.StringIO()
    assert tune(_opts(tmp_path, resume=True), log=log).complete
    assert f"--resume: reusing the buckets of {out}" in log.getvalue() and out.is_symlink()


def _foreign_link(link: Path, target: Path) -> None:
    link.symlink_to(target)
    os.chown(link, NOBODY, NOBODY, follow_symlinks=False)


@needs_root
def test_another_users_symlink_at_out_or_at_its_lock_is_refused_and_never_followed(tmp_path, capsys):
    """Another user's link at --out in a sticky world-writable folder made root replace its own 0600 file."""
    from omni_accum.tuner.files import OutputLock

    secret = tmp_path / "secret.yaml"  # root's own table, 0600
    tune(_opts(tmp_path, out=secret))
    secret.chmod(0o600)
    before = secret.read_bytes()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    out = shared / "t.yaml"
    _foreign_link(out, secret)
    assert cli.main(_tune_args(tmp_path, out)) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: {out} is a symlink owned by uid {NOBODY}" in err and "refused, never followed" in err, err
    with pytest.raises(PermissionError, match=f"symlink owned by uid {NOBODY}") as e:
        write_atomic(out, "a: 1\n")
    assert e.value.filename == str(out)
    with pytest.raises(PermissionError, match=f"symlink owned by uid {NOBODY}"):
        OutputLock(out).acquire()
    assert secret.read_bytes() == before and stat.S_IMODE(secret.stat().st_mode) == 0o600
    out.unlink()
    _foreign_link(shared / ".t.yaml.lock", secret)
    assert cli.main(_tune_args(tmp_path, out)) == 2
    err = capsys.readouterr().err
    assert f"{shared / '.t.yaml.lock'} is a symlink owned by uid {NOBODY}" in err and "refused" in err, err
    assert secret.read_bytes() == before and not out.exists()


@needs_root
def test_out_of_the_service_user_keeps_its_owner_group_and_mode(tmp_path, capsys, monkeypatch):
    """As root over a table of the service user (nobody, 0600) tune left it root's 0600: the service could no longer
    read it."""
    out = tmp_path / "tuned.yaml"
    tune(_opts(tmp_path))
    os.chown(out, NOBODY, NOBODY)
    out.chmod(0o600)
    assert cli.main(_tune_args(tmp_path, out)) == 0
    st = out.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, NOBODY, 0o600)
    capsys.readouterr()

    def refuse(*a):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "fchown", refuse)  # as a user who may not give files away
    write_atomic(out, "a: 1\n")
    err = capsys.readouterr().err
    assert f"warning: {out}: was owned by uid {NOBODY}" in err and "cannot give back" in err, err
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


@pytest.mark.parametrize("held", ["t.yaml", "t.partial.yaml"])
def test_a_run_holds_the_lock_of_its_partial_file_too(tmp_path, capsys, held):
    """While `tune --out t.yaml` ran, `tune --out t.partial.yaml` wrote that name, and the first run removed it
    when it completed."""
    from omni_accum.tuner.files import OutputLock

    first, second = tmp_path / held, tmp_path / ({"t.yaml": "t.partial.yaml"}.get(held, "t.yaml"))
    with OutputLock(first):
        assert cli.main(_tune_args(tmp_path, second)) == 2
        err = capsys.readouterr().err
        assert f"is being written by another omni-accum tune run (pid {os.getpid()}" in err and "Traceback" not in err
        assert not second.exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".lock")]


@pytest.mark.parametrize("failing", [1, 2])
def test_a_lock_that_cannot_be_written_leaves_no_lock_file_and_no_open_file(tmp_path, capsys, monkeypatch, failing):
    """On a full disk tune said "cannot lock it (No space left on device)" but left `.t.yaml.lock` (0 bytes) and the
    descriptor open; nor is the first lock kept when the second (the partial file's) fails."""
    real, calls = os.pwrite, []

    def full(fd, data, offset):
        calls.append(fd)
        if len(calls) == failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    out = tmp_path / "t.yaml"
    args = _tune_args(tmp_path, out)
    fds = sorted(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "pwrite", full)
    assert cli.main(args) == 2
    assert f"--out {out}: cannot lock it (No space left on device)" in capsys.readouterr().err
    assert sorted(os.listdir("/proc/self/fd")) == fds
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_long_legal_out_name_is_taken_and_one_too_long_is_named(tmp_path, capsys):
    """A legal 250-byte --out was refused: the probe, temporary, lock (and partial) names beside it exceeded 255."""
    out = tmp_path / ("t" * 245 + ".yaml")
    assert output_problem(out) is None
    from omni_accum.tuner.files import OutputLock, lock_path, partial_path

    assert all(len(p.name.encode()) <= 255 for p in (partial_path(out), lock_path(out), lock_path(partial_path(out))))
    assert partial_path(out).name.endswith(".partial.yaml") and partial_path(out) != partial_path(tmp_path / "t.yaml")
    with OutputLock(out) as lock:
        assert len(lock.paths) == 2
    assert cli.main(_tune_args(tmp_path, out)) == 0
    assert omni_accum.load_policy(out).tuned.complete and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [out.name, "small-workload.yaml"])
    too_long = tmp_path / ("t" * 251 + ".yaml")
    assert cli.main(_tune_args(tmp_path, too_long)) == 2
    assert f"--out {too_long}: its file name is 256 bytes long, over the 255" in capsys.readouterr().err


def test_the_partial_file_is_never_writable_by_others_so_resume_takes_it_under_a_group_umask(tmp_path, monkeypatch):
    """Under umask 002 (a user-private group) the partial file was 0664: --resume, which refuses a group-writable
    file, would refuse the run's own."""
    old = os.umask(0o002)
    try:
        part = _stopped_run(tmp_path, monkeypatch)
        assert stat.S_IMODE(part.stat().st_mode) == 0o644
        log = io.StringIO()
        assert tune(_opts(tmp_path, context_lens=[64, 256], resume=True), log=log).complete
    finally:
        os.umask(old)
    assert f"--resume: reusing the buckets of {part}" in log.getvalue()
    assert stat.S_IMODE((tmp_path / "tuned.yaml").stat().st_mode) == 0o664  # --out: 0666 & ~umask, as open()


@needs_root
@pytest.mark.parametrize("where, file_mode", [("shared", 0o644), ("private", 0o666)])
def test_another_users_file_that_others_could_have_planted_is_not_given_back_to_them(
        tmp_path, capsys, where, file_mode):
    """Root's tune --out onto a file another user made first (in a sticky world-writable folder, or writable by
    others) kept that user as its owner and its 0666: the table root deploys was theirs to rewrite."""
    folder = tmp_path / where
    folder.mkdir()
    folder.chmod(0o1777 if where == "shared" else 0o755)
    out = folder / "t.yaml"
    tune(_opts(tmp_path, out=out))  # a tuned table, made there by another user (below) before root's run
    os.chown(out, NOBODY, NOBODY)
    out.chmod(file_mode)
    assert cli.main(_tune_args(tmp_path, out)) == 0
    st = out.stat()
    assert st.st_uid == os.geteuid() and not stat.S_IMODE(st.st_mode) & 0o022, (st.st_uid, oct(st.st_mode))
    err = capsys.readouterr().err
    assert f"warning: {out}: was owned by uid {NOBODY}" in err and "not group- or world-writable" in err, err


@needs_root
def test_a_service_users_group_writable_table_in_its_own_folder_stays_the_service_users(tmp_path, capsys):
    """umask 002 makes 0664 tables: root's update must leave such a table the service user's (not root's 0644)."""
    folder = tmp_path / "svc"
    folder.mkdir()
    folder.chmod(0o750)
    out = folder / "t.yaml"
    tune(_opts(tmp_path, out=out))
    os.chown(out, NOBODY, NOBODY)
    out.chmod(0o660)
    assert cli.main(_tune_args(tmp_path, out)) == 0
    st = out.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, NOBODY, 0o660)
    assert "warning" not in capsys.readouterr().err
