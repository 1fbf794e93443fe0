"""Bucket edges of a tuned table: declared, log-spaced, explicit floor semantics.

Lookup (in :class:`omni_accum.policy.TunedTable`): a value v falls in the bucket of the largest
edge <= v; values below the first edge or above the last clamp to the end buckets and are counted.
"""

from __future__ import annotations

import math

DEFAULT_CONTEXT_LENS = (1000, 4000, 8000, 32000)
DEFAULT_CONCURRENCY = (1, 4, 10)
QUICK_CONTEXT_LENS = (1000, 8000, 32000)
QUICK_CONCURRENCY = (1, 10)


def log_edges(low: int, high: int, n: int) -> list[int]:
    """``n`` log-spaced integer edges from ``low`` to ``high`` inclusive (strictly ascending)."""
    if low < 1 or high < low or n < 1:
        raise ValueError(f"log_edges needs 1 <= low <= high and n >= 1, got low={low} high={high} n={n}")
    if n == 1 or low == high:
        return [low]
    r = math.log(high / low) / (n - 1)
    out: list[int] = []
    for i in range(n):
        v = round(low * math.exp(r * i))
        if out and v <= out[-1]:
            v = out[-1] + 1
        out.append(v)
    out[-1] = max(out[-1], high)
    return out


def check_edges(name: str, edges: list[int]) -> list[int]:
    """Sorted, de-duplicated, validated edges; a clear error names the option."""
    if not edges:
        raise ValueError(f"{name}: at least one value is needed")
    bad = [e for e in edges if not isinstance(e, int) or e < 1]
    if bad:
        raise ValueError(f"{name}: values must be integers >= 1, got {bad}")
    return sorted(set(edges))


#: The most cells (buckets x tuned keys) one tuned table holds. A cell takes about 0.5-0.7 KB of YAML (the winner,
#: every candidate's timing and peak bytes, exclusions, the reason), so 512 of them stay well under the size of
#: policy file the loader reads (``MAX_POLICY_BYTES``); a table is read back by every process that serves it.
MAX_TUNED_CELLS = 512


def table_size_problem(n_context: int, n_concurrency: int, n_keys: int) -> str | None:
    """Why a table of these buckets and keys would be too large to write (before anything is measured), or None."""
    cells = n_context * n_concurrency * n_keys
    if cells <= MAX_TUNED_CELLS:
        return None
    return (
        f"{n_context} --context-lens x {n_concurrency} --concurrency buckets x {n_keys} tuned key(s) = {cells} cells; "
        f"a tuned table holds at most {MAX_TUNED_CELLS}: give fewer bucket edges"
    )
