"""The ``--rows`` / ``--repeats`` arguments the chunk-0 benchmarks share (``handoff_chunk0.py``, ``gpu_handoff.py``)."""

from __future__ import annotations

import sys


def rows_and_repeats(prog: str, rows: str, repeats: int) -> list[int] | None:
    """The prompt lengths of ``--rows`` (comma-separated positive integers), or None after naming the bad value on
    stderr (``repeats`` must be positive too)."""
    try:
        rows_list = [int(x) for x in rows.split(",")]
        if any(r <= 0 for r in rows_list) or repeats < 1:
            raise ValueError
    except ValueError:
        print(f"{prog}: --rows {rows!r} / --repeats {repeats}: use positive integers "
              "(--rows as a comma-separated list)", file=sys.stderr)
        return None
    return rows_list
