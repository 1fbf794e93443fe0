"""How property tests draw their examples: the same ones every run, unless a long fuzz is asked for.

By default (the README's test command, and CI) hypothesis is *derandomized*: each property test draws
a fixed set of examples, seeded from the test itself, so a run fails or passes the same way every
time. ``OMNI_ACCUM_FUZZ=long`` explores new examples instead: each test draws
``OMNI_ACCUM_FUZZ_SCALE`` (default 20) times as many, from a seed printed in the session header
(``OMNI_ACCUM_FUZZ_SEED`` or ``--hypothesis-seed`` picks it; hypothesis prints how to reproduce a
failure). See docs/reliability.md.
"""

from __future__ import annotations

import os
import random

LONG = os.environ.get("OMNI_ACCUM_FUZZ", "").strip().lower() == "long"
SCALE = max(1, int(os.environ.get("OMNI_ACCUM_FUZZ_SCALE", "20"))) if LONG else 1
SEED = int(os.environ.get("OMNI_ACCUM_FUZZ_SEED") or random.SystemRandom().randrange(2**32)) if LONG else None


def examples(n: int) -> int:
    """``n`` examples in the default run; ``n * SCALE`` in a long fuzz."""
    return n * SCALE
