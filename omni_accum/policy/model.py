"""Policies: which strategy each key gets. The pydantic model and its resolution.

A policy is data (YAML, JSON, TOML or a mapping): a default strategy, ordered rules matching key
paths or globs, and an optional tuned table over context length x concurrency written by
``omni-accum tune`` (:mod:`omni_accum.policy.tuned`). Resolution order for a key: an exact rule,
then the first matching glob rule, then the tuned table (when its fingerprint matches this
environment), then the default. Loading (files, presets, ``OMNI_ACCUM_POLICY``) is
:mod:`omni_accum.policy.loader`.

This module knows nothing of the plugin manager: whether a tuned table was measured with the
strategy plugins installed here is checked against the plugins the loader binds to the policy
(:meth:`Policy.bind_plugins`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import heapq
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from omni_accum.context import DEFAULT_CONTEXT, StreamContext
from omni_accum.policy.fingerprint import check_fingerprint
from omni_accum.policy.tuned import TunedTable

GLOB_CHARS = frozenset("*?[")

#: Keys that are per-chunk flags of vllm-omni's protocol: replace-kind whatever the default, unless a rule
#: names them. ``meta.finished`` vllm-omni itself always replaces; ``meta.is_segment_finished`` is the 0-d
#: bool tensor 0.30.0's Qwen3-Omni processor puts in every chunk (its consumers read it per chunk; 0.30.0's
#: own ``_accumulate_payload`` would raise on it, a ``torch.cat`` of 0-d tensors, where omni-accum replaces it).
PROTOCOL_REPLACE_KEYS = frozenset({"meta.finished", "meta.is_segment_finished"})


def is_glob(pattern: str) -> bool:
    """True when ``pattern`` uses glob syntax (``*``, ``?`` or ``[...]``)."""
    return any(c in GLOB_CHARS for c in pattern)


def _literal_prefix(pattern: str) -> str:
    """The text of ``pattern`` before its first wildcard: every key it matches starts with it."""
    return pattern[: min((i for i in map(pattern.find, GLOB_CHARS) if i >= 0), default=len(pattern))]


_FILLS = {"*": ("", "x", "a.b_9", "\u2603Z-"), "?": ("x", ".", "9", "\u2603")}


def _glob_samples(pattern: str) -> list[str]:
    """Keys ``pattern`` matches, each wildcard filled in several ways (``[...]`` by its first and last choice)."""
    parts: list[tuple[str, ...]] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        end = pattern.find("]", i + 2) if c == "[" else -1
        if c in _FILLS:
            parts.append(_FILLS[c])
        elif end > 0:
            body = pattern[i + 1 : end]
            parts.append(("\u2603",) if body[0] in "!^" else tuple({body[0], body[-1]} - {"-"}) or (body[0],))
            i = end
        else:
            parts.append((c,))
        i += 1
    n = max(len(p) for p in parts) if parts else 1
    return ["".join(p[k % len(p)] for p in parts) for k in range(n)]


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

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: str = Field(min_length=1)
    """Name of a registered strategy (``omni-accum strategies`` lists them)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Params validated by the strategy's own ``Params`` model."""


class Rule(BaseModel):
    """One rule: keys matching ``match`` use ``strategy`` with ``params``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    match: str = Field(min_length=1)
    """A key path (``embed.decode``, ``thinker_embeddings``) or a glob (``embed.*``); no leading or trailing space."""
    strategy: str = Field(min_length=1)
    """Name of a registered strategy."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Params validated by the strategy's own ``Params`` model."""
    description: str = ""
    """Free text: why this rule exists."""

    @field_validator("match")
    @classmethod
    def _no_outer_space(cls, v: str) -> str:
        if v != v.strip():
            raise ValueError(
                f"match {v!r} has a leading or trailing space, which no key path has (write {v.strip()!r})"
            )
        return v


#: An A/B arm's name: it travels in the wire marker and becomes a metric label, so it is short and plain.
ARM_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,15}")
#: Loads an A/B split's arm policies (the loader sets it: this module does not import the loader).
ARM_RESOLVER: Callable[[Any], dict[str, Any]] | None = None
#: The hash that splits requests between arms (:meth:`ABSplit.arm_for`): BLAKE2b, this personalization.
ARM_HASH_PERSON = b"omni-accum-ab"


def _arm_name(name: str) -> str:
    if not ARM_NAME.fullmatch(name):
        raise ValueError(
            f"arm name {name!r} is not allowed: names travel in the wire marker and become a metric label, so they "
            "start with a letter and hold only letters, digits and '_', at most 16 characters (e.g. control, "
            "treatment)"
        )
    return name


#: An arm's name as a dict key: checked beside its arm's fields (a bad name and a bad weight are both reported).
ArmName = Annotated[str, AfterValidator(_arm_name)]


class ABArm(BaseModel):
    """One arm of an A/B split: the policy its requests run and its share of them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str = Field(min_length=1)
    """The arm's policy: a preset name or a policy file (a relative path is read from the folder of the file
    holding the split first). It may not split again."""
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False, strict=True)  # a number, never a string ("1")
    """Its share of the requests: this weight over the sum of every arm's weight (default 1)."""

    @field_validator("weight", mode="before")
    @classmethod
    def _weight_not_bool(cls, v: Any) -> Any:
        if isinstance(v, bool) or (isinstance(v, (int, float)) and not v > 0):
            raise ValueError(f"Input should be a number > 0, a share of the requests (got {v!r})")
        return v


class ABSplit(BaseModel):
    """A live A/B split: each request runs one arm's policy, picked from a stable hash of its request id.

    Example (YAML)::

        ab:
          arms:
            control: {policy: default, weight: 1}
            treatment: {policy: qwen3-omni, weight: 1}
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    arms: dict[ArmName, ABArm]
    """Two or more arms by name, in the order their shares are laid out (names: a letter, then letters, digits
    or ``_``, at most 16 characters)."""

    @field_validator("arms")
    @classmethod
    def _two_or_more(cls, v: dict[str, ABArm]) -> dict[str, ABArm]:
        if len(v) < 2:
            raise ValueError(f"an A/B split needs two or more arms, got {len(v)} ({', '.join(map(repr, v)) or 'none'})")
        return v

    def arm_for(self, request_id: Any) -> str:
        """The arm of ``request_id``: its BLAKE2b hash with an 8-byte digest (``digest_size=8``, of
        ``str(request_id)`` as UTF-8, personalization :data:`ARM_HASH_PERSON`), read big-endian as a fraction of
        2**64, laid over the arms' weights in order.
        The same id gives the same arm in every process and on every host."""
        h = hashlib.blake2b(str(request_id).encode("utf-8", "surrogatepass"), digest_size=8, person=ARM_HASH_PERSON)
        x = int.from_bytes(h.digest(), "big") / 2.0**64 * sum(a.weight for a in self.arms.values())
        name = ""
        for name, arm in self.arms.items():
            if x < arm.weight:
                return name
            x -= arm.weight
        return name  # rounding at the very end: the last arm


class _Rules(list):  # type: ignore[type-arg]
    """``Policy.rules``: a list (it compares, dumps and pickles as one) that refuses changes, since the policy
    indexed its rules when it was validated: a rule appended later would be dumped but never applied."""

    def _read_only(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "Policy.rules is read-only (the policy indexed its rules when it was validated): load a new policy with "
            "the rules you want: load_policy({**policy.model_dump(mode='json'), 'rules': [...]})"
        )

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only  # type: ignore[assignment]
    append = extend = insert = pop = remove = clear = sort = reverse = _read_only  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Rules, (list(self),))


def repeat_message(i: int, j: int, match: str) -> str:
    """The problem of ``rules[i]`` repeating ``rules[j]``'s match, as one line that starts ``rules[i].match ``."""
    why = " (its second copy can never match)" if is_glob(match) else ""
    return f"rules[{i}].match {match!r} repeats rules[{j}].match{why}; remove one"


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

    model_config = ConfigDict(extra="forbid", frozen=True)

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
    rules: list[Rule] = Field(default_factory=_Rules)
    """Ordered rules; an exact key path beats any glob, and among globs the first listed wins. Read-only (a list
    that refuses changes): the rules are indexed when the policy is validated."""
    tuned: TunedTable | None = None
    """Decisions of ``omni-accum tune`` per bucket; explicit rules still beat it."""
    ab: ABSplit | None = None
    """A live A/B split between named policies (off when absent). A policy with one takes every strategy from
    its arms: it sets nothing else but ``version`` and ``description``."""

    _exact: dict[str, tuple[int, Rule]] = PrivateAttr(default_factory=dict)
    _globs: list[tuple[int, Rule]] = PrivateAttr(default_factory=list)
    _tuned_ok: bool | None = PrivateAttr(default=None)
    _plugins: Callable[[], Mapping[str, str]] | None = PrivateAttr(default=None)
    _arms: dict[str, Policy] | None = PrivateAttr(default=None)

    _coerce_default = field_validator("default", mode="before")(classmethod(lambda cls, v: _coerce_strategy_ref(v)))

    @field_validator("version", mode="before")
    @classmethod
    def _version_not_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):  # YAML ``true`` would otherwise pass as 1
            raise ValueError(f"Input should be 1 (got {v!r})")
        return v

    @field_validator("rules")
    @classmethod
    def _read_only_rules(cls, v: list[Rule]) -> list[Rule]:
        return _Rules(v)

    @model_validator(mode="after")
    def _index_rules(self, info: ValidationInfo) -> Policy:
        first: dict[str, int] = {}
        repeats: list[str] = []
        for i, rule in enumerate(self.rules):
            j = first.setdefault(rule.match, i)
            if j != i:
                repeats.append(repeat_message(i, j, rule.match))
            elif is_glob(rule.match):
                self._globs.append((i, rule))
            else:
                self._exact[rule.match] = (i, rule)
        if repeats and not (info.context or {}).get("allow_repeats"):  # the loader's second pass allows them
            raise ValueError("\n".join(repeats))  # every one, a line each (the loader reports each at its rule's line)
        return self

    @field_validator("ab")
    @classmethod
    def _ab_alone(cls, v: ABSplit | None, info: ValidationInfo) -> ABSplit | None:
        d = info.data  # the fields declared before ``ab`` (every other one)
        if v is not None:
            also = [
                name
                for name, is_set in (
                    ("default", d.get("default", StrategyRef(strategy="cat")) != StrategyRef(strategy="cat")),
                    ("max_bytes_per_request", d.get("max_bytes_per_request", 0) != 0),
                    ("honor_override_keys", d.get("honor_override_keys", True) is not True),
                    ("rules", bool(d.get("rules"))),
                    ("tuned", d.get("tuned") is not None),
                )
                if is_set
            ]
            if also:
                raise ValueError(
                    f"a policy with an ab section takes every strategy from its arms' policies, but this one also sets "
                    f"{', '.join(also)}: move {'it' if len(also) == 1 else 'them'} into an arm's policy"
                )
        return v

    def arm_policies(self) -> dict[str, Policy]:
        """The resolved policy of each A/B arm, in order (empty without an ``ab`` section). ``load_policy``
        resolves them; a policy built otherwise resolves them here, at the first call (raises ``PolicyError``)."""
        if self.ab is None:
            return {}
        if self._arms is None:
            if ARM_RESOLVER is None:  # pragma: no cover - omni_accum.policy imports the loader, which sets it
                raise RuntimeError("omni_accum.policy.loader was not imported: no arm resolver")
            self._arms = ARM_RESOLVER(self)
        return self._arms

    def shadowed_rules(self) -> list[tuple[int, int]]:
        """``(later, earlier)`` glob rules where the earlier glob matches every key the later one matches.

        An exact rule beats every glob, so only globs can be shadowed (``embed.*`` listed before
        ``embed.tts_*``): the later rule never decides a key. Checked on sample keys of the later
        glob (each wildcard filled in several ways), so a report is near-certain, not a proof.
        """
        out = []
        # A glob matches only keys that start with its literal prefix (the text before its first wildcard), so
        # the only earlier globs to try on a later one are those whose prefix starts its first sample key.
        by_prefix: dict[str, list[int]] = {}  # literal prefix -> positions in self._globs, ascending
        for n, (j, later) in enumerate(self._globs):
            samples = _glob_samples(later.match)
            lists = (by_prefix.get(samples[0][:k], ()) for k in range(len(samples[0]) + 1))
            for m in heapq.merge(*lists):
                i, earlier = self._globs[m]
                if all(fnmatch.fnmatchcase(k, earlier.match) for k in samples):
                    out.append((j, i))
                    break
            by_prefix.setdefault(_literal_prefix(later.match), []).append(n)
        return out

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

    def bind_plugins(self, installed: Callable[[], Mapping[str, str]]) -> None:
        """Say where the installed strategy plugins come from (``name -> "dist==version"``).

        ``load_policy`` binds every policy with a tuned table it loads or is given; ``installed``
        is called once, at the first resolution that reaches the table. A policy that already has
        a source keeps it; one without a tuned table needs none (it stays equal to ``Policy()``).
        """
        if self.tuned is not None and self._plugins is None:
            self._plugins = installed

    def tuned_usable(self, warn: bool = True) -> bool:
        """True when the tuned table exists and was measured in an environment like this one.

        The strategy plugins are those :meth:`bind_plugins` names; a policy never loaded through
        ``load_policy`` has none bound, so its table is reported as not checkable and not used.
        ``warn=False``: a stale table is not said (nor remembered: the first lookup says it).
        """
        if self.tuned is None:
            return False
        if self._tuned_ok is None:
            plugins = self._plugins() if self._plugins is not None else None
            names = self.tuned.strategy_names()
            ok = check_fingerprint(self.tuned.fingerprint, plugins=plugins, warn=warn, strategies=names)
            if not warn:
                return ok
            self._tuned_ok = ok
        return self._tuned_ok

    def resolve(self, key: str, context: StreamContext = DEFAULT_CONTEXT) -> StrategyChoice:
        """Return the strategy ``key`` gets under this policy in ``context``, and why. A policy with an ``ab``
        section resolves as its first arm (the live integration picks an arm per request)."""
        if self.ab is not None:
            name, arm = next(iter(self.arm_policies().items()))
            got = arm.resolve(key, context)
            return StrategyChoice(got.strategy, got.params, f"ab arm {name!r}: {got.source}")
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
