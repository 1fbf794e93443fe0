"""Policies: which strategy each key gets. Pydantic models, loading and resolution.

A policy is data (YAML, JSON, TOML or a mapping): a default strategy, ordered rules matching key
paths or globs, and an optional tuned table over context length x concurrency written by
``omni-accum tune``. Resolution order for a key: an exact rule, then the first matching glob
rule, then the tuned table (when its fingerprint matches this environment), then the default.
"""

from __future__ import annotations

import bisect
import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from omni_accum.context import DEFAULT_CONTEXT, StreamContext

GLOB_CHARS = frozenset("*?[")

#: Keys vllm-omni itself always replaces (``meta.finished``): replace-kind whatever the default,
#: unless a rule names them.
PROTOCOL_REPLACE_KEYS = frozenset({"meta.finished"})


def is_glob(pattern: str) -> bool:
    """True when ``pattern`` uses glob syntax (``*``, ``?`` or ``[...]``)."""
    return any(c in GLOB_CHARS for c in pattern)


@dataclass(frozen=True)
class StrategyChoice:
    """A resolved choice: strategy name, params mapping, and why it was chosen.

    Attributes:
        strategy: registered strategy name.
        params: params for the strategy's ``Params`` model.
        source: human-readable reason (``"rules[2] match 'embed.*'"``, ``"default"``, ...).
    """

    strategy: str
    params: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""


def _coerce_strategy_ref(value: Any) -> Any:
    if isinstance(value, str):
        return {"strategy": value}
    return value


class StrategyRef(BaseModel):
    """A strategy name with its params."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    strategy: str = Field(min_length=1)
    """Name of a registered strategy (``omni-accum strategies`` lists them)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Params validated by the strategy's own ``Params`` model."""


class Rule(BaseModel):
    """One rule: keys matching ``match`` use ``strategy`` with ``params``."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    match: str = Field(min_length=1)
    """A key path (``embed.decode``, ``thinker_embeddings``) or a glob (``embed.*``)."""
    strategy: str = Field(min_length=1)
    """Name of a registered strategy."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Params validated by the strategy's own ``Params`` model."""
    description: str = ""
    """Free text: why this rule exists."""


class TunedCell(BaseModel):
    """The tuner's decision for one key in one bucket."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    key: str = Field(min_length=1)
    """Key path the decision applies to (exact path)."""
    context_len: int = Field(ge=0)
    """Lower edge of the context-length bucket."""
    concurrency: int = Field(ge=1)
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


class TunedTable(BaseModel):
    """Per-bucket decisions written by ``omni-accum tune``.

    Buckets use floor semantics: a value v falls in the bucket of the largest edge <= v; values
    below the first edge or above the last clamp to the end buckets (and are counted).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    context_len_edges: list[int] = Field(min_length=1)
    """Ascending lower edges of context-length buckets."""
    concurrency_edges: list[int] = Field(min_length=1)
    """Ascending lower edges of concurrency buckets."""
    cells: list[TunedCell] = Field(default_factory=list)
    """Decisions, one per key per bucket."""
    fingerprint: dict[str, Any] = Field(default_factory=dict)
    """Environment the table was measured in; a mismatch disables the table (with one warning)."""
    workload: str = ""
    """Workload the table was tuned on."""
    wire: str = "inproc"
    """Wire mode the table was tuned with."""
    complete: bool = True
    """False while (or when) the tuner stopped before measuring every bucket; ``--resume`` goes on."""
    skipped: dict[str, str] = Field(default_factory=dict)
    """Workload keys not tuned, with the reason (carried once, decided by an explicit rule)."""

    _index: dict[tuple[str, int, int], TunedCell] = PrivateAttr(default_factory=dict)
    _clamped: int = PrivateAttr(default=0)

    @field_validator("context_len_edges", "concurrency_edges")
    @classmethod
    def _ascending(cls, v: list[int]) -> list[int]:
        if any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"bucket edges must be strictly ascending, got {v}")
        if v and v[0] < 0:
            raise ValueError(f"bucket edges must be >= 0, got {v}")
        return v

    @model_validator(mode="after")
    def _build_index(self) -> TunedTable:
        for i, c in enumerate(self.cells):
            if c.context_len not in self.context_len_edges:
                raise ValueError(f"cells[{i}].context_len {c.context_len} is not one of context_len_edges")
            if c.concurrency not in self.concurrency_edges:
                raise ValueError(f"cells[{i}].concurrency {c.concurrency} is not one of concurrency_edges")
            self._index[(c.key, c.context_len, c.concurrency)] = c
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

    @property
    def clamped_lookups(self) -> int:
        """How many lookups fell outside the measured edges and were clamped."""
        return self._clamped


class Policy(BaseModel):
    """An accumulation policy.

    Example (YAML)::

        version: 1
        default: cat
        rules:
          - match: embed.decode
            strategy: prealloc
            params: {growth_factor: 2.0}
          - match: "meta.*"
            strategy: replace
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    version: Literal[1] = 1
    """Schema version; 1 is the only version so far."""
    description: str = ""
    """What the policy is for."""
    default: StrategyRef = StrategyRef(strategy="cat")
    """Strategy of keys no rule matches: a name, or ``{strategy: NAME, params: {...}}``."""
    max_bytes_per_request: int = Field(default=0, ge=0, strict=True)
    """Guard: a merge that would hold more than this many bytes for one request raises (0 = off)."""
    honor_override_keys: bool = Field(default=True, strict=True)
    """Replace, for one chunk, the keys that chunk lists in ``meta.override_keys`` (vllm-omni 0.30.0)."""
    rules: list[Rule] = Field(default_factory=list)
    """Ordered rules; an exact key path beats any glob, and among globs the first listed wins."""
    tuned: TunedTable | None = None
    """Decisions of ``omni-accum tune`` per bucket; explicit rules still beat it."""

    _exact: dict[str, tuple[int, Rule]] = PrivateAttr(default_factory=dict)
    _globs: list[tuple[int, Rule]] = PrivateAttr(default_factory=list)
    _tuned_ok: bool | None = PrivateAttr(default=None)

    _coerce_default = field_validator("default", mode="before")(classmethod(lambda cls, v: _coerce_strategy_ref(v)))

    @field_validator("version", mode="before")
    @classmethod
    def _version_not_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):  # YAML ``true`` would otherwise pass as 1
            raise ValueError(f"Input should be 1 (got {v!r})")
        return v

    @model_validator(mode="after")
    def _index_rules(self) -> Policy:
        for i, rule in enumerate(self.rules):
            if is_glob(rule.match):
                self._globs.append((i, rule))
            elif rule.match in self._exact:
                first = self._exact[rule.match][0]
                raise ValueError(f"rules[{i}].match {rule.match!r} repeats rules[{first}].match; remove one")
            else:
                self._exact[rule.match] = (i, rule)
        return self

    # -- resolution -------------------------------------------------------------------------- #
    def match_rule(self, key: str) -> tuple[int, Rule] | None:
        """Return ``(index, rule)`` of the rule that decides ``key``, or None."""
        hit = self._exact.get(key)
        if hit is not None:
            return hit
        for i, rule in self._globs:
            if fnmatch.fnmatchcase(key, rule.match):
                return i, rule
        return None

    def tuned_usable(self) -> bool:
        """True when the tuned table exists and was measured in an environment like this one."""
        if self.tuned is None:
            return False
        if self._tuned_ok is None:
            from omni_accum.fingerprint import check_fingerprint

            self._tuned_ok = check_fingerprint(self.tuned.fingerprint, warn=True)
        return self._tuned_ok

    def resolve(self, key: str, context: StreamContext = DEFAULT_CONTEXT) -> StrategyChoice:
        """Return the strategy ``key`` gets under this policy in ``context``, and why."""
        hit = self.match_rule(key)
        if hit is not None:
            i, rule = hit
            kind = "glob" if is_glob(rule.match) else "exact"
            return StrategyChoice(rule.strategy, rule.params, f"rules[{i}] ({kind} match {rule.match!r})")
        if key in PROTOCOL_REPLACE_KEYS:
            return StrategyChoice("replace", {}, "protocol key (vllm-omni always replaces it)")
        if self.tuned is not None and self.tuned_usable():
            cell = self.tuned.lookup(key, context)
            if cell is not None:
                return StrategyChoice(
                    cell.strategy,
                    cell.params,
                    f"tuned bucket context_len>={cell.context_len}, concurrency>={cell.concurrency}",
                )
        return StrategyChoice(self.default.strategy, self.default.params, "default")

    def strategy_refs(self) -> list[tuple[str, str, dict[str, Any]]]:
        """Every (location, strategy, params) the policy names, for validation."""
        refs = [("default", self.default.strategy, self.default.params)]
        refs += [(f"rules[{i}]", r.strategy, r.params) for i, r in enumerate(self.rules)]
        if self.tuned is not None:
            refs += [(f"tuned.cells[{i}]", c.strategy, c.params) for i, c in enumerate(self.tuned.cells)]
        return refs
