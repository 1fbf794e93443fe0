"""Which strategies the tuner times for a key: filtered by applicability before any timing.

A candidate applies to a key when the key's kind is one of the strategy's declared kinds (a
``static`` key also takes ``replace``-kind strategies: it is a replace key whose value does not
change). Built-ins and plugins are treated alike; a strategy's ``params_grid`` adds variants.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from omni_accum.manager import StrategyManager
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
