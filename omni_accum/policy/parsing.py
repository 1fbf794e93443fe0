"""YAML and JSON parsing that refuses duplicate mapping keys (at every nesting level).

PyYAML's and the stdlib's JSON parsers keep the last of two equal keys silently
(``default: cat`` then ``default: prealloc``). Policies and workloads are parsed here instead,
so a duplicate is an error naming the key and both lines. YAML stays on the safe loader: tags
that build Python objects (``!!python/...``) are still refused.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml
from yaml.constructor import ConstructorError

__all__ = [
    "DuplicateKeyError",
    "LineIndex",
    "TomlText",
    "UniqueKeySafeLoader",
    "bad_scalar_line",
    "load_json",
    "load_yaml",
    "toml_line",
]

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


def bad_scalar_line(text: str) -> int | None:
    """1-based line of the first scalar the safe loader cannot construct, or None."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError):
        return None
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.ScalarNode):
            try:
                yaml.SafeLoader("").construct_object(node, deep=True)
            except Exception:  # noqa: BLE001 - any failure locates the bad scalar
                return node.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(reversed(node.value))
        elif isinstance(node, yaml.MappingNode):
            stack.extend(n for kv in reversed(node.value) for n in reversed(kv))
    return None


class TomlText(str):
    """Policy text known to be TOML: error messages find a field's line with :func:`toml_line`."""


_TOML_KEY = r'(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|\'[^\']*\')'
_TOML_DOTTED = re.compile(rf"\s*({_TOML_KEY}(?:\s*\.\s*{_TOML_KEY})*)\s*")
_TOML_PART = re.compile(_TOML_KEY)
_TOML_HEADER = re.compile(rf"^(\[\[?)\s*({_TOML_KEY}(?:\s*\.\s*{_TOML_KEY})*)\s*\]\]?\s*(?:#.*)?$")


def _toml_parts(dotted: str) -> tuple[str, ...]:
    return tuple(json.loads(p) if p[0] == '"' else p.strip("'") for p in _TOML_PART.findall(dotted))


def toml_line(text: str, loc: tuple[Any, ...]) -> int | None:
    """Best-effort 1-based line of the field at ``loc`` (``("rules", 1, "strategy")``) in TOML text: table
    headers (``[a]``, and ``[[a]]`` whose n-th one is item n) and ``key = value`` lines define paths; the
    line of the longest prefix of ``loc`` defined is returned, None when none is."""
    return _toml_lookup(_toml_index(text), loc)


def _toml_lookup(where: dict[tuple[Any, ...], int], loc: tuple[Any, ...]) -> int | None:
    key = tuple(loc)
    for i in range(len(key), 0, -1):
        if key[:i] in where:
            return where[key[:i]]
    return None


def _toml_index(text: str) -> dict[tuple[Any, ...], int]:
    """The line of every path a TOML text defines (see :func:`toml_line`)."""
    where: dict[tuple[Any, ...], int] = {}
    arrays: dict[tuple[Any, ...], int] = {}
    table: tuple[Any, ...] = ()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        head = _TOML_HEADER.match(line)
        if head is not None:
            raw = _toml_parts(head[2])
            parts: tuple[Any, ...] = ()
            for j, name in enumerate(raw):
                parts = (*parts, name)
                # a part naming an array of tables means its latest element: [rules.params] after [[rules]]
                if parts in arrays and not (j == len(raw) - 1 and head[1] == "[["):
                    parts = (*parts, arrays[parts])
            if head[1] == "[[":
                arrays[parts] = arrays.get(parts, -1) + 1
                parts = (*parts, arrays[parts])
            table = parts
        else:
            m = _TOML_DOTTED.match(line)
            if m is None or not line[m.end() :].startswith("="):
                continue
            parts = (*table, *_toml_parts(m[1]))
        for i in range(1, len(parts) + 1):
            where.setdefault(parts[:i], n)
    return where


_UNPARSED = object()


class LineIndex:
    """The 1-based lines of a policy's fields in its text, for error messages only.

    The text is parsed (YAML, or JSON as YAML) or scanned (:class:`TomlText`) once, at the first lookup, and
    every later lookup walks that one tree: a policy with many problems costs one parse, a valid one none.
    ``LineIndex(None)`` (no text: a mapping) answers None.
    """

    def __init__(self, text: str | None) -> None:
        self.text = text
        self._root: Any = _UNPARSED

    def __call__(self, loc: tuple[Any, ...]) -> int | None:
        """Best-effort line of the node at ``loc`` (``("rules", 0, "match")``): the deepest part found, or None."""
        if self.text is None:
            return None
        toml = isinstance(self.text, TomlText)
        if self._root is _UNPARSED:
            self._root = _toml_index(self.text) if toml else _compose(self.text)
        if toml:
            return _toml_lookup(self._root, loc)
        return _node_line(self._root, loc)


def _compose(text: str) -> yaml.Node | None:
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError):
        return None


def _node_line(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if getattr(k, "value", None) == str(part)), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            nxt = node.value[part]
        else:
            nxt = None
        if nxt is None:
            break
        node, line = nxt, nxt.start_mark.line + 1
    return line
