"""The tuned table that ``omni-accum tune`` writes into a policy: per-key decisions per bucket.

Buckets are context length x concurrency, with floor semantics (see :class:`TunedTable`). The
table records the environment it was measured in (``fingerprint``); whether it may be used here
is decided by :mod:`omni_accum.policy.fingerprint`, with the installed plugins given by the caller.
"""

from __future__ import annotations

import bisect
import re
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    ValidationInfo,
    field_validator,
    model_validator,
)

from omni_accum.context import StreamContext


#: One line of :meth:`TunedTable._build_index`'s error: ``cells[i]``, an optional ``.field``, then the problem.
_CELL_PROBLEM = re.compile(r"^cells\[(\d+)\](?:\.(\w+))? (.+)$")


def cell_problems(text: str) -> list[tuple[tuple[Any, ...], str]]:
    """``(loc, message)`` of each cell problem in the text of a table's error (``loc``: ``("tuned", "cells", i)``
    and the field when one is named, the message without the cell), or [] for text that is not only those."""
    out: list[tuple[tuple[Any, ...], str]] = []
    for line in text.splitlines():
        m = _CELL_PROBLEM.match(line)
        if m is None:
            return []
        loc: tuple[Any, ...] = ("tuned", "cells", int(m[1]))
        out.append(((*loc, m[2]), f"{m[2]} {m[3]}") if m[2] else (loc, line))
    return out


class TunedCell(BaseModel):
    """The tuner's decision for one key in one bucket."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = Field(min_length=1)
    """Key path the decision applies to (exact path)."""
    context_len: int = Field(ge=0, strict=True)  # an int, never "8000" or true (a hand edit)
    """Lower edge of the context-length bucket."""
    concurrency: int = Field(ge=1, strict=True)
    """Lower edge of the concurrency bucket."""
    strategy: str = Field(min_length=1)
    """Winning strategy."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Winning params."""
    baseline: str = "default"
    """Arm the win is measured against."""
    margin: float | None = None
    """Relative gain of the winner over the baseline (0.25 = 25 % faster)."""
    ci: tuple[float, float] | None = None
    """Bootstrap confidence interval of that gain."""
    timings_us: dict[str, float] = Field(default_factory=dict)
    """Median step cost in microseconds of every candidate measured (label -> us)."""
    excluded: dict[str, str] = Field(default_factory=dict)
    """Candidates excluded, with the reason (wrong views, raised, over memory budget)."""
    peak_bytes: dict[str, int] = Field(default_factory=dict)
    """Peak bytes the key's state held under each candidate (label -> bytes)."""
    reason: str | None = None
    """Why the baseline was kept (below the noise, below ``--min-gain-us``, every candidate excluded, ...),
    or why it was left although no candidate beat it (its views are wrong, it raised); None for a win."""


class TunedTable(BaseModel):
    """Per-bucket decisions written by ``omni-accum tune``.

    Buckets use floor semantics: a value v falls in the bucket of the largest edge <= v; values
    below the first edge or above the last clamp to the end buckets (and are counted).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    context_len_edges: list[Annotated[int, Strict()]] = Field(min_length=1)
    """Ascending lower edges of context-length buckets."""
    concurrency_edges: list[Annotated[int, Strict()]] = Field(min_length=1)
    """Ascending lower edges of concurrency buckets."""
    cells: list[TunedCell] = Field(default_factory=list)
    """Decisions, one per key per bucket."""
    fingerprint: dict[str, Any] = Field(default_factory=dict)
    """Environment the table was measured in; a mismatch disables the table (with one warning)."""
    workload: str = ""
    """Workload the table was tuned on."""
    wire: str = "inproc"
    """Wire mode the table was tuned with."""
    complete: bool = Field(default=True, strict=True)
    """False while (or when) the tuner stopped before measuring every bucket; ``--resume`` goes on."""
    skipped: dict[str, str] = Field(default_factory=dict)
    """Workload keys not tuned, with the reason (carried once, decided by an explicit rule)."""

    _index: dict[tuple[str, int, int], TunedCell] = PrivateAttr(default_factory=dict)
    _clamped: int = PrivateAttr(default=0)

    @field_validator("fingerprint")
    @classmethod
    def _plugins_map(cls, v: dict[str, Any]) -> dict[str, Any]:
        plugins = v.get("plugins")
        if plugins is not None and not isinstance(plugins, dict):  # a map with other values: a stale table, ignored
            raise ValueError(
                f"'plugins' must map each strategy to its plugin's version, as omni-accum tune writes it "
                f"({{prealloc: omni-accum==0.3.0}}), got {plugins!r}: tune again to rewrite the table"
            )
        return v

    @field_validator("context_len_edges", "concurrency_edges")
    @classmethod
    def _ascending(cls, v: list[int]) -> list[int]:
        if any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"bucket edges must be strictly ascending, got {v}")
        if v and v[0] < 0:
            raise ValueError(f"bucket edges must be >= 0, got {v}")
        return v

    @model_validator(mode="after")
    def _build_index(self, info: ValidationInfo) -> TunedTable:
        """Index the cells; every bad cell is listed at once, a line each starting ``cells[i]`` (the loader reports
        each at its cell's own line). With ``allow_cell_problems`` in the validation context (the loader's second
        pass, which then checks every cell's strategy) the bad cells are left out of the index instead."""
        problems: list[str] = []
        for i, c in enumerate(self.cells):
            bad = False
            for field, value, edges in (
                ("context_len", c.context_len, self.context_len_edges),
                ("concurrency", c.concurrency, self.concurrency_edges),
            ):
                if value not in edges:
                    problems.append(f"cells[{i}].{field} {value} is not one of {field}_edges {edges}")
                    bad = True
            k = (c.key, c.context_len, c.concurrency)
            if k in self._index:
                j = next(n for n, other in enumerate(self.cells) if other is self._index[k])
                problems.append(
                    f"cells[{i}] repeats cells[{j}] (key {c.key!r}, context_len {c.context_len}, concurrency "
                    f"{c.concurrency}): a bucket has one cell per key; remove one"
                )
            elif not bad:
                self._index[k] = c
        if problems and not (info.context or {}).get("allow_cell_problems"):
            raise ValueError("\n".join(problems))
        return self

    @staticmethod
    def floor(edges: list[int], value: int) -> tuple[int, bool]:
        """Return ``(edge, clamped)``: the largest edge <= ``value``.

        A value below the first edge clamps to the first bucket, one above the last edge to the
        last bucket (the tuner measured at the edges, so both are extrapolations): ``clamped``
        is True for those.
        """
        i = bisect.bisect_right(edges, value) - 1
        if i < 0:
            return edges[0], True
        return edges[i], value > edges[-1]

    def bucket(self, context: StreamContext) -> tuple[int, int, bool]:
        """Return ``(context_len edge, concurrency edge, clamped)`` for ``context``."""
        cl = context.context_len if context.context_len is not None else self.context_len_edges[0]
        c_edge, c_clamp = self.floor(self.context_len_edges, cl)
        k_edge, k_clamp = self.floor(self.concurrency_edges, context.concurrency)
        return c_edge, k_edge, c_clamp or k_clamp

    def lookup(self, key: str, context: StreamContext) -> TunedCell | None:
        c_edge, k_edge, clamped = self.bucket(context)
        cell = self._index.get((key, c_edge, k_edge))
        if cell is not None and clamped:
            self._clamped += 1
        return cell

    def strategy_names(self) -> frozenset[str]:
        """Every strategy the table's decisions depend on: winners, baselines and the candidates it timed,
        excluded or weighed (labels such as ``prealloc{growth_factor=4.0}`` count as ``prealloc``)."""
        labels: set[str] = set()
        for c in self.cells:
            labels.update((c.strategy, c.baseline, *c.timings_us, *c.excluded, *c.peak_bytes))
        return frozenset(label.partition("{")[0] for label in labels if label)

    def partial_note(self) -> str | None:
        """What a user must know about a table whose tuning run stopped early (``complete: false``), or None."""
        if self.complete:
            return None
        done = len({(c.context_len, c.concurrency) for c in self.cells})
        total = len(self.context_len_edges) * len(self.concurrency_edges)
        return (
            f"partial tuned table: {done} of {total} buckets measured (the tuning run stopped early); requests in "
            "the others get the rules and the default; finish it with omni-accum tune --resume"
        )

    @property
    def clamped_lookups(self) -> int:
        """How many lookups fell outside the measured edges and were clamped."""
        return self._clamped
