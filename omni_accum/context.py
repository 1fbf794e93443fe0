"""Stream context and key metadata: what strategy selection may depend on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

ValueType = Literal["tensor", "list", "other"]


@dataclass(frozen=True)
class StreamContext:
    """Where a stream runs: used by tuned tables and passed to selection hooks.

    Attributes:
        context_len: prompt (context) length of the request in tokens, when known.
        concurrency: number of requests streaming at once on this stage.
        length_hints: expected final rows per key path, for strategies that preallocate
            (``{"embed.decode": 100}``); keys without a hint grow geometrically.
    """

    context_len: int | None = None
    concurrency: int = 1
    length_hints: Mapping[str, int] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.context_len is not None and (not isinstance(self.context_len, int) or self.context_len < 0):
            raise ValueError(f"StreamContext.context_len must be an int >= 0 or None, got {self.context_len!r}")
        if not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ValueError(f"StreamContext.concurrency must be an int >= 1, got {self.concurrency!r}")

    @property
    def cache_key(self) -> tuple[int | None, int]:
        return (self.context_len, self.concurrency)


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
                tuple(value.shape[1:]),
                value.dim(),
            )
        if isinstance(value, list):
            return cls(path, "list")
        return cls(path, "other")

    @property
    def cache_key(self) -> tuple[Any, ...]:
        return (self.path, self.value_type, self.dtype, self.trailing_shape, self.ndim)
