"""Finish a harness virtualenv that setup_env.sh started from another environment's packages.

setup_env.sh can start the harness's virtualenv from the packages of the project's own ``.venv``
(hard links, ~2.2 GB less on the disk: opencv, scipy, llvmlite, transformers, vllm-omni ... are the
same builds in both). pip then installs only what differs. Two things stay to do, here:

``prune ROOT...``
    uninstall every distribution that the roots (the packages setup_env.sh installs by name) do not
    need, directly or through their requirements: the seed's own extras (its CUDA-only kernels, the
    test tools, Mooncake) are not in a harness built from scratch, and must not be in one started
    from a seed.
``outside SEED_ROOT``
    copy the files that the distributions which came from the seed keep outside site-packages (their RECORD's
    files in ``bin/`` and ``share/``, ``#!`` lines pointed at this Python): only site-packages was linked, and
    pip never installed them here, so ``bin/`` lacks ``vllm-omni``, ``ninja`` and the others.
``broken``
    print ``name==version`` of each distribution a file of which is missing, for setup_env.sh to install again:
    two distributions may own the same files, and uninstalling one takes them from the other.

Run with the harness's own Python (the requirement markers are evaluated for that interpreter).
Standard library only, plus pip's vendored ``packaging``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from importlib.metadata import Distribution, distributions


def _norm(name: str) -> str:
    return "".join("-" if c in "_." else c for c in name.lower())


def _requirement_cls():
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare venv: pip's own copy
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def needed(requires: dict[str, list[str]], roots: list[str], env: dict[str, str] | None = None) -> set[str]:
    """The normalized names reachable from ``roots`` through ``requires`` (name -> requirement strings).

    A requirement counts when its marker holds for this interpreter (``env`` overrides marker variables)
    with no extra, or with one of the extras asked of its distribution (``foo[bar]`` asks ``bar`` of
    ``foo``). Names without an installed distribution are ignored (an optional dependency that is absent).
    """
    Requirement = _requirement_cls()
    wanted: dict[str, set[str]] = {}  # name -> extras asked of it
    todo: list[tuple[str, frozenset[str]]] = [(_norm(r), frozenset()) for r in roots]
    while todo:
        name, extras = todo.pop()
        if name not in requires:
            continue
        have = wanted.get(name)
        if have is not None and extras <= have:
            continue
        wanted[name] = (have or set()) | set(extras)
        for line in requires[name]:
            req = Requirement(line)
            if req.marker is not None:
                contexts = [{"extra": e} for e in sorted(wanted[name])] + [{"extra": ""}]
                if not any(req.marker.evaluate({**(env or {}), **c}) for c in contexts):
                    continue
            todo.append((_norm(req.name), frozenset(_norm(e) for e in req.extras)))
    return set(wanted)


def _installed() -> dict[str, Distribution]:
    found: dict[str, Distribution] = {}
    for d in distributions():
        name = d.metadata["Name"]
        if name:
            found.setdefault(_norm(name), d)  # the first on sys.path wins, as for imports
    return found


ALWAYS = {"pip", "setuptools", "wheel"}  # what a new virtualenv may come with


def prune(roots: list[str], dry_run: bool = False) -> list[str]:
    installed = _installed()
    requires = {n: list(d.requires or []) for n, d in installed.items()}
    keep = needed(requires, roots)
    missing = [r for r in roots if _norm(r) not in installed]
    if missing:
        raise SystemExit(f"seed_venv.py prune: roots not installed: {', '.join(missing)}")
    extra = sorted(n for n in installed if n not in keep and n not in ALWAYS)
    if extra and not dry_run:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *extra], check=True)
    return extra


def copy_outside(root: str, seed_root: str, python: str, dists=None) -> tuple[list[str], list[str]]:
    """Copy from the seed each file that an installed distribution's RECORD puts in the virtualenv ``root`` outside
    site-packages (``bin/``'s console scripts and a wheel's scripts or programs such as ``ninja``, ``share/``'s
    data) and that is missing, from the same place under ``seed_root``; a ``#!`` line naming the seed's ``bin/``
    is pointed at ``python``. Compiled ``__pycache__`` files are left to Python. ``dists``: the installed ones by
    default. Returns (copied, not found in the seed), as paths relative to ``root``."""
    root, seed_root = os.path.realpath(root), os.path.realpath(seed_root)
    seed_bin = os.path.join(seed_root, "bin")
    copied, lost = [], []
    for d in _installed().values() if dists is None else dists:
        site = os.path.realpath(d.locate_file(""))
        for f in d.files or []:
            path = os.path.realpath(d.locate_file(f))
            if (not path.startswith(root + os.sep) or path.startswith(site + os.sep) or "__pycache__" in path
                    or os.path.lexists(path)):
                continue
            rel = os.path.relpath(path, root)
            src = os.path.join(seed_root, rel)
            if not os.path.isfile(src):
                lost.append(rel)
                continue
            with open(src, "rb") as fin:
                data = fin.read()
            first, nl, rest = data.partition(b"\n")
            if first.startswith(b"#!") and seed_bin.encode() in first:
                data = b"#!" + python.encode() + nl + rest
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as fout:
                fout.write(data)
            os.chmod(path, os.stat(src).st_mode & 0o7777)
            copied.append(rel)
    return sorted(copied), sorted(lost)


def broken() -> list[str]:
    """``name==version`` of each installed distribution one of whose files is missing: two distributions can own
    the same files (the seed's ``py-cpuinfo2`` and ``py-cpuinfo`` both ship ``cpuinfo/``), and uninstalling the one
    that goes takes them from the one that stays."""
    found = []
    for d in _installed().values():
        if any(not os.path.lexists(d.locate_file(f)) for f in d.files or [] if "__pycache__" not in str(f)):
            found.append(f"{d.metadata['Name']}=={d.version}")
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prune", help="uninstall what the roots do not need")
    p.add_argument("roots", nargs="+", help="the distributions setup_env.sh installs by name")
    p.add_argument("--dry-run", action="store_true", help="print what would go, uninstall nothing")
    p = sub.add_parser("outside", help="copy the seed's files outside site-packages (bin/, share/) that are missing")
    p.add_argument("seed_root", help="the seed virtualenv's folder")
    sub.add_parser("broken", help="print name==version of each distribution with a file missing")
    args = ap.parse_args(argv)
    if args.cmd == "prune":
        gone = prune(args.roots, args.dry_run)
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {len(gone)} distributions the harness does not need: {' '.join(gone) or '-'}", file=sys.stderr)
    elif args.cmd == "broken":
        for line in broken():
            print(line)
    else:
        made, lost = copy_outside(sys.prefix, args.seed_root, sys.executable)
        print(f"copied {len(made)} files from {args.seed_root}: {' '.join(made) or '-'}", file=sys.stderr)
        if lost:
            print(f"not in {args.seed_root} (missing here too): {' '.join(lost)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
