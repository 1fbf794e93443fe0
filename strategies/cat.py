"""``cat``: concatenate on every chunk (vllm-omni 0.30.0's own behaviour).

Tensors are joined with ``torch.cat`` along dim 0 and lists with ``+`` on every chunk; any other
value replaces the previous one. Each append copies the whole accumulated value: O(context) per
step. This is the reference every other strategy is checked against, and the ``default`` preset.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from omni_accum.hookspecs import hookimpl
from omni_accum.strategy import AppendAccumulator, KeyInfo, Strategy, StrategySpec, value_nbytes


class Params(BaseModel):
    """``cat`` takes no params."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class CatAccumulator(AppendAccumulator):
    """Holds one tensor (or list), replaced by the concatenation on every append."""

    __slots__ = ("_t", "_lst")

    def __init__(self, key: KeyInfo) -> None:
        super().__init__(key)
        self._t: torch.Tensor | None = None
        self._lst: list[Any] = []

    def start_tensor(self, value: torch.Tensor) -> None:
        self._t = value

    def append_tensor(self, value: torch.Tensor) -> None:
        self._t = torch.cat([self._t, value], dim=0)

    def read_tensor(self) -> torch.Tensor:
        return self._t  # type: ignore[return-value]

    def current_tensor_meta(self) -> torch.Tensor:
        return self._t  # type: ignore[return-value]

    def clear_tensor(self) -> None:
        self._t = None

    def start_list(self, value: list[Any]) -> None:
        self._lst = value

    def append_list(self, value: list[Any]) -> None:
        self._lst = self._lst + value

    def read_list(self) -> list[Any]:
        return self._lst

    def list_nbytes(self) -> int:
        return value_nbytes(self._lst)  # the list itself is the view: no copy

    def projected_list_nbytes(self, value: list[Any]) -> int:
        return (value_nbytes(self._lst) if self._mode == 2 else 0) + value_nbytes(value)


class Cat(Strategy):
    name = "cat"
    Params = Params

    def new_accumulator(self, key: KeyInfo) -> CatAccumulator:
        return CatAccumulator(key)


@hookimpl
def omni_accum_register_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="cat",
            factory=Cat,
            params_model=Params,
            kinds=frozenset({"append"}),
            description="torch.cat / list + on every chunk (upstream vllm-omni 0.30.0); O(context) per step",
        )
    ]
