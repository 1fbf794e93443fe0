"""``replace``: the latest value wins (vllm-omni's override keys, ``meta.*`` flags)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from omni_accum.hookspecs import hookimpl
from omni_accum.strategy import Accumulator, KeyInfo, Strategy, StrategySpec, value_nbytes


class Params(BaseModel):
    """``replace`` takes no params."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplaceAccumulator(Accumulator):
    """Holds the latest value."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Any = None

    def merge(self, value: Any) -> None:
        self.value = value

    def read(self) -> Any:
        return self.value

    def nbytes(self) -> int:
        return value_nbytes(self.value)

    def projected_nbytes(self, value: Any) -> int:
        return value_nbytes(value)


class Replace(Strategy):
    name = "replace"
    Params = Params

    def new_accumulator(self, key: KeyInfo) -> ReplaceAccumulator:
        return ReplaceAccumulator()


@hookimpl
def omni_accum_register_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="replace",
            factory=Replace,
            params_model=Params,
            kinds=frozenset({"replace", "static"}),
            description="the latest value wins",
        )
    ]
