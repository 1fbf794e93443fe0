"""YAML and JSON parsing that refuses duplicate mapping keys (at every nesting level).

PyYAML's and the stdlib's JSON parsers keep the last of two equal keys silently
(``default: cat`` then ``default: prealloc``). Policies and workloads are parsed here instead,
so a duplicate is an error naming the key and both lines. YAML stays on the safe loader: tags
that build Python objects (``!!python/...``) are still refused.
"""

from __future__ import annotations

import json
from typing import Any

import yaml
from yaml.constructor import ConstructorError

__all__ = ["DuplicateKeyError", "UniqueKeySafeLoader", "load_json", "load_yaml"]

_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(ConstructorError):
    """A mapping names the same key twice. A ``yaml.MarkedYAMLError``: its problem mark is the second key.

    Attributes: ``key``, ``first_line`` and ``second_line`` (1-based; ``None`` where unknown, in JSON).
    """

    def __init__(self, key: Any, first: Any = None, second: Any = None, *, lines: tuple[int, int] | None = None):
        self.key = key
        if lines is None and first is not None and second is not None:
            lines = (first.line + 1, second.line + 1)
        self.first_line, self.second_line = lines if lines else (None, None)
        where = f": first at line {self.first_line}, again at line {self.second_line}" if lines else ""
        super().__init__(None, None, f"duplicate key {key!r}{where} (a key may appear once per mapping)", second)


class UniqueKeySafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose mappings refuse a key given twice (merge keys ``<<`` may be overridden)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base constructor reports it
                    continue
                if first is not key_node:
                    raise DuplicateKeyError(key, first.start_mark, key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """Parse YAML with the safe loader, refusing duplicate keys (raises ``yaml.YAMLError``)."""
    return yaml.load(text, Loader=UniqueKeySafeLoader)  # noqa: S506 - a SafeLoader subclass


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKeyError(k)
        out[k] = v
    return out


def load_json(text: str) -> Any:
    """Parse JSON, refusing duplicate keys: :class:`DuplicateKeyError` names the key and, where found, both lines."""
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except DuplicateKeyError as e:
        try:  # JSON text is (nearly always) YAML: the YAML parser knows the lines
            load_yaml(text)
        except DuplicateKeyError as located:
            if located.key == e.key:
                raise located from None
        except (yaml.YAMLError, RecursionError, ValueError, TypeError):
            pass
        raise


def yaml_error_parts(e: yaml.YAMLError) -> tuple[str, str]:
    """``("line L, column C: ", problem)`` of a YAML error, on one line (PyYAML's own text spans several)."""
    if not isinstance(e, yaml.MarkedYAMLError):
        return "", " ".join(str(e).split())
    mark = e.problem_mark or e.context_mark
    line = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    problem = e.problem or " ".join(str(e).split())
    ctx = e.context_mark
    if e.context and ctx is not None and mark is not None and ctx.line != mark.line:
        problem += f" ({e.context} at line {ctx.line + 1}, column {ctx.column + 1})"
    return line, problem
