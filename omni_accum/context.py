"""Stream context and key metadata: what strategy selection may depend on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import yaml

from omni_accum.errors import InvalidArgumentError

ValueType = Literal["tensor", "list", "other"]


@dataclass(frozen=True)
class StreamContext:
    """Where a stream runs: used by tuned tables and passed to selection hooks.

    Attributes:
        context_len: prompt (context) length of the request in tokens, when known.
        concurrency: number of requests streaming at once on this stage.
        length_hints: expected final rows per key path, for strategies that preallocate
            (``{"embed.decode": 100}``); keys without a hint grow geometrically. Copied when the
            context is made, read-only.

    A field of the wrong type or value raises :class:`~omni_accum.errors.InvalidArgumentError` (also a
    ``ValueError`` and a ``TypeError``) naming it.
    """

    context_len: int | None = None
    concurrency: int = 1
    length_hints: Mapping[str, int] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.context_len is not None and not _is_int(self.context_len, 0):
            raise _bad("context_len", self.context_len, "an int >= 0 or None")
        if not _is_int(self.concurrency, 1):
            raise _bad("concurrency", self.concurrency, "an int >= 1")
        hints = self.length_hints
        if not isinstance(hints, Mapping):
            raise _bad("length_hints", hints, "a mapping of key paths to rows ({'embed.decode': 100})")
        for path, rows in hints.items():
            if not isinstance(path, str) or not _is_int(rows, 0):
                raise InvalidArgumentError(
                    f"StreamContext.length_hints must map key paths (str) to rows (an int >= 0), got {path!r}: {rows!r}"
                )
        # A read-only copy: the caller's dict may change later, and the context is frozen (its hints too).
        object.__setattr__(self, "length_hints", _Hints(hints))

    def __reduce__(self) -> tuple[Any, ...]:  # copies and pickles are made by the constructor: checked, read-only
        return (type(self), (self.context_len, self.concurrency, dict(self.length_hints)))

    @property
    def cache_key(self) -> tuple[Any, ...]:
        """Everything a strategy selection may read from the context: length, concurrency and length hints."""
        return (self.context_len, self.concurrency, frozenset(self.length_hints.items()))


class _Hints(dict):
    """``StreamContext.length_hints``: a dict (it serialises as one: JSON, ``asdict``, pickle, copies give plain dicts)
    that refuses changes, since the context checked it when it was made."""

    def _read_only(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("StreamContext.length_hints is read-only (it was checked when the context was made): make a "
                        "new StreamContext with the hints you want")  # fmt: skip

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _read_only  # type: ignore

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))


for _dumper in (yaml.SafeDumper, yaml.Dumper):  # yaml.safe_dump(dataclasses.asdict(ctx)) writes a plain mapping
    _dumper.add_representer(_Hints, _dumper.represent_dict)


def _is_int(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _bad(name: str, value: Any, valid: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"StreamContext.{name} must be {valid}, got {value!r}")


DEFAULT_CONTEXT = StreamContext()


@dataclass(frozen=True)
class KeyMeta:
    """What the first value seen for a key looks like.

    Attributes:
        path: key path.
        value_type: ``"tensor"``, ``"list"`` or ``"other"``.
        dtype: tensor dtype name (``"bfloat16"``), or None.
        trailing_shape: tensor shape without dim 0, or None.
        ndim: tensor rank, or None.
    """

    path: str
    value_type: ValueType
    dtype: str | None = None
    trailing_shape: tuple[int, ...] | None = None
    ndim: int | None = None

    @classmethod
    def of(cls, path: str, value: Any) -> KeyMeta:
        if isinstance(value, torch.Tensor):
            return cls(
                path,
                "tensor",
                str(value.dtype).removeprefix("torch."),
                None if value.is_nested else tuple(value.shape[1:]),  # a nested tensor's .shape raises
                value.dim(),
            )
        if isinstance(value, list):
            return cls(path, "list")
        return cls(path, "other")

    @property
    def cache_key(self) -> tuple[Any, ...]:
        return (self.path, self.value_type, self.dtype, self.trailing_shape, self.ndim)
