"""Which strategies the tuner times for a key: filtered by applicability before any timing.

A candidate applies to a key when the key's kind is one of the strategy's declared kinds (a
``static`` key also takes ``replace``-kind strategies: it is a replace key whose value does not
change). Built-ins and plugins are treated alike; a strategy's ``params_grid`` adds variants.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from omni_accum.manager import StrategyManager, get_manager
from omni_accum.strategy import StrategySpec


@dataclass(frozen=True)
class Candidate:
    """One strategy with one set of params."""

    strategy: str
    params: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def label(self) -> str:
        if not self.params:
            return self.strategy
        inner = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.strategy}{{{inner}}}"


def parse_label(label: str) -> tuple[str, list[dict[str, Any]]]:
    """The strategy of a :attr:`Candidate.label` and readings of its params: the values as written (strings),
    then as YAML scalars (``4.0`` -> 4.0, ``[1, 2]`` -> a list). A label without params reads as ``{}``."""
    name, brace, rest = label.partition("{")
    if not brace or not rest.endswith("}"):
        return label, [{}]
    raw: dict[str, Any] = {}
    for item in re.split(r",(?=[A-Za-z_]\w*=)", rest[:-1]):
        k, eq, v = item.partition("=")
        if not eq:
            return label, [{}]  # not a label the tuner wrote: compare it as a plain name
        raw[k] = v
    typed: dict[str, Any] = {}
    for k, v in raw.items():
        try:
            typed[k] = yaml.safe_load(v)
        except yaml.YAMLError:
            typed[k] = v
    return name, [raw, typed]


def normalised(strategy: str, params: Mapping[str, Any], manager: StrategyManager | None = None) -> dict[str, Any]:
    """``params`` as the strategy's params model reads them (defaults filled in, ``4`` -> ``4.0`` for a float); as
    given when the strategy is not registered here or the params do not validate (``"4"`` for a strict number)."""
    spec = (manager or get_manager()).get_spec(strategy)
    if spec is not None:
        try:
            return spec.params_model.model_validate(dict(params)).model_dump(mode="json")
        except ValidationError:
            pass
    return dict(params)


def same_choice(strategy: str, params: Mapping[str, Any], label: str, manager: StrategyManager | None = None) -> bool:
    """True when ``strategy`` with ``params`` is the choice ``label`` names (e.g. a cell's ``baseline``), compared
    as normalised strategy and params, not as strings: ``prealloc`` ``{'growth_factor': 4}`` is
    ``prealloc{growth_factor=4.0}``, and an explicit default is the same as none."""
    if Candidate(strategy, dict(params)).label == label:
        return True
    name, readings = parse_label(label)
    if name != strategy:
        return False
    mine = normalised(strategy, params, manager)
    return any(normalised(name, r, manager) == mine for r in readings)


def applies(spec: StrategySpec, kind: str) -> bool:
    """True when ``spec`` may be timed on a key of ``kind``."""
    if kind in spec.kinds:
        return True
    return kind == "static" and "replace" in spec.kinds


def candidates_for(kind: str, manager: StrategyManager, *, grid: bool = True) -> list[Candidate]:
    """Candidates for a key of ``kind``: each applicable strategy with its defaults and grid variants."""
    out: list[Candidate] = []
    for spec in manager.specs():
        if not applies(spec, kind):
            continue
        defaults = spec.params_model().model_dump()
        out.append(Candidate(spec.name, {}))
        if not grid:
            continue
        for variant in spec.params_grid:
            full = spec.params_model.model_validate(variant).model_dump()
            changed = {k: v for k, v in full.items() if defaults.get(k) != v}
            if changed and Candidate(spec.name, changed) not in out:
                out.append(Candidate(spec.name, changed))
    return out


def candidate_set_hash(per_key: dict[str, list[Candidate]], manager: StrategyManager) -> str:
    """Short hash of what was timed (candidates per key, plugin versions) — recorded in the fingerprint."""
    data = {
        "keys": {k: [c.label for c in cs] for k, cs in sorted(per_key.items())},
        "plugins": {s.name: list(s.distribution or (s.plugin, "")) for s in manager.specs()},
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
