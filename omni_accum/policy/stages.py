"""The checks that come after a policy's schema, run on what parsed when the schema did not.

Validation has two stages: the schema (fields, types, unknown fields, repeated matches: pydantic lists them all at
once), then each strategy name and its params against the loaded plugins. When the schema fails there is no
:class:`~omni_accum.policy.model.Policy` to run the second stage on, so a file with an unknown field, an unknown
strategy and a bad param reported the unknown field alone, and the others once it was fixed.
:func:`later_stage_problems` runs the second stage on the ``default`` and on every rule that is valid on its own,
each reported at its own index and line, and gives the partial policy they make (for warnings such as a glob an
earlier glob covers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from omni_accum.manager import StrategyManager
from omni_accum.policy.model import Policy, Rule, repeat_message
from omni_accum.policy.parsing import LineIndex

__all__ = ["later_stage_problems"]


class _RuleLines(LineIndex):
    """The lines of the partial policy's fields: its ``rules[j]`` is the file's ``rules[index[j]]``."""

    def __init__(self, lines: LineIndex, index: dict[int, int]) -> None:
        super().__init__(lines.text)
        self._lines = lines
        self._index = index

    def __call__(self, loc: tuple[Any, ...]) -> int | None:
        if len(loc) > 1 and loc[0] == "rules" and isinstance(loc[1], int):
            loc = ("rules", self._index.get(loc[1], loc[1]), *loc[2:])
        return self._lines(loc)


#: The second stage: ``loader.strategy_problems`` (passed in, so that the loader can call this module too).
Check = Callable[[Policy, StrategyManager, LineIndex], list[dict[str, Any]]]


def later_stage_problems(
    data: Any, lines: LineIndex, manager: StrategyManager, check: Check
) -> tuple[list[dict[str, Any]], Policy | None, dict[int, int]]:
    """``(problems, partial policy, index)`` after a failed schema: ``check``'s problems (the strategy names and
    params) of the ``default`` and of every rule valid on its own (``{"loc", "line", "msg"}`` at the file's own
    index and line), the policy those make (None when nothing parsed), and ``index``: its rule ``j`` is the file's
    rule ``index[j]``."""
    if not isinstance(data, Mapping):
        return [], None, {}
    kept: list[dict[str, Any]] = []
    index: dict[int, int] = {}
    rules = data.get("rules")
    for i, rule in enumerate(rules if isinstance(rules, list) else []):
        try:
            kept.append(Rule.model_validate(rule).model_dump())
        except (ValidationError, TypeError, ValueError):
            continue
        index[len(kept) - 1] = i
    partial: dict[str, Any] = {"rules": kept}
    if "default" in data:
        try:
            Policy.model_validate({"default": data["default"]})
            partial["default"] = data["default"]
        except (ValidationError, TypeError, ValueError):
            pass
    try:
        policy = Policy.model_validate(partial, context={"allow_repeats": True})
    except (ValidationError, TypeError, ValueError):
        return [], None, {}
    problems = check(policy, manager, _RuleLines(lines, index)) + _repeats(policy, lines, index)
    for p in problems:
        loc = str(p.get("loc") or "")
        if loc.startswith("rules["):
            j, rest = loc[len("rules[") :].split("]", 1)
            p["loc"] = f"rules[{index.get(int(j), int(j))}]{rest}"
    return problems, policy, index


def _repeats(policy: Policy, lines: LineIndex, index: dict[int, int]) -> list[dict[str, Any]]:
    """The repeated matches among the rules kept (the schema's own check of them runs only when the rest passed)."""
    first: dict[str, int] = {}
    out = []
    for j, rule in enumerate(policy.rules):
        k = first.setdefault(rule.match, j)
        if k != j:
            i = index.get(j, j)
            msg = repeat_message(i, index.get(k, k), rule.match).split(" ", 1)[1]
            out.append({"loc": f"rules[{i}].match", "line": lines(("rules", i, "match")), "msg": msg})
    return out
