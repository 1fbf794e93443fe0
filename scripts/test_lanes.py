"""Split the test files into lanes that scripts/test.sh runs side by side, balanced by how long each file takes.

    python3 scripts/test_lanes.py split N WEIGHTS [--hold FILE]... [--reserve LANE=KEY]... PATH...
        N lines, one per lane: its test files, separated by blanks (a file under PATH, a test_*.py; those given by
        --hold are left out). The longest files go first, each to the lane with the least time so far; a lane
        starts with the time of each KEY reserved for it (what it runs after its files: the other releases' runs,
        the end-to-end test). A file not in WEIGHTS counts as DEFAULT seconds.
    python3 scripts/test_lanes.py record LOG... > tests/durations.txt
        WEIGHTS from pytest's ``--durations=0`` lines in LOG (``OMNI_ACCUM_TEST_LANES=2 bash scripts/test.sh
        --durations=0 -vv | tee LOG`` runs the suite in its two lanes and prints every test's time): the seconds of
        each file, summed.

WEIGHTS is a text file of ``SECONDS PATH`` lines (``#`` starts a comment); a PATH starting with ``@`` is a KEY.
Only the order matters: the figures are this machine's, another machine's are proportional enough.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

#: Seconds of a test file the weights do not name (a new file): about the median file's.
DEFAULT = 2.0
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (?:call|setup|teardown) +([^:\s]+)::")


def read_weights(path: str) -> dict[str, float]:
    """The weights in ``path`` (none when there is no such file: every file then counts as DEFAULT)."""
    out: dict[str, float] = {}
    if not Path(path).is_file():
        return out
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            out[parts[1]] = float(parts[0])
        except ValueError:
            raise SystemExit(f"test_lanes.py: {path}:{n}: {line!r} is not 'SECONDS PATH'") from None
    return out


def test_files(paths: list[str]) -> list[str]:
    files: list[str] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            files += sorted(str(f) for f in path.rglob("test_*.py") if "__pycache__" not in f.parts)
        elif path.is_file():
            files.append(p)
        else:
            raise SystemExit(f"test_lanes.py: {p}: no such file or folder")
    return list(dict.fromkeys(files))


def split(n: int, weights: dict[str, float], files: list[str], reserve: dict[int, list[str]]) -> list[list[str]]:
    """Longest first, each file to the lane with the least time so far (ties: the lower lane)."""
    load = [sum(weights.get(k, DEFAULT) for k in reserve.get(i, [])) for i in range(n)]
    lanes: list[list[str]] = [[] for _ in range(n)]
    for f in sorted(files, key=lambda f: (-weights.get(f, DEFAULT), f)):
        i = min(range(n), key=lambda j: (load[j], j))
        lanes[i].append(f)
        load[i] += weights.get(f, DEFAULT)
    return [sorted(lane) for lane in lanes]


def record(logs: list[str]) -> str:
    per: dict[str, float] = {}
    for log in logs:
        for line in Path(log).read_text(encoding="utf-8", errors="replace").splitlines():
            m = _DURATION.match(line.replace("\0", "").strip())
            if m:
                per[m.group(2)] = per.get(m.group(2), 0.0) + float(m.group(1))
    if not per:
        raise SystemExit(f"test_lanes.py: no pytest --durations lines in {', '.join(logs)}")
    lines = [f"{s:.1f} {f}" for f, s in sorted(per.items(), key=lambda kv: (-kv[1], kv[0]))]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "record":
        sys.stdout.write(record(argv[1:]))
        return 0
    if len(argv) < 3 or argv[0] != "split" or not argv[1].isdigit() or int(argv[1]) < 1:
        raise SystemExit(__doc__)
    n, weights = int(argv[1]), read_weights(argv[2])
    hold: set[str] = set()
    reserve: dict[int, list[str]] = {}
    paths: list[str] = []
    it = iter(argv[3:])
    for a in it:
        if a in ("--hold", "--reserve"):
            v = next(it, None)
            if v is None:
                raise SystemExit(f"test_lanes.py: {a} needs a value")
            if a == "--hold":
                hold.add(v)
            else:
                lane, _, key = v.partition("=")
                if not lane.isdigit() or not 1 <= int(lane) <= n or not key:
                    raise SystemExit(f"test_lanes.py: --reserve {v!r}: give LANE=KEY, LANE 1 to {n}")
                reserve.setdefault(int(lane) - 1, []).append(key)
        else:
            paths.append(a)
    files = [f for f in test_files(paths) if f not in hold]
    for lane in split(n, weights, files, reserve):
        print(" ".join(lane))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
