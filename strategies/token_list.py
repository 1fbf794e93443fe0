"""``token_list``: keep every chunk in a list, concatenate on read, cache until the next append.

Appends are O(chunk) (a copy of the chunk, as ``torch.cat`` takes its rows when it runs: the sender may
reuse its tensor). A read after new chunks concatenates all of them (O(context)), so this suits
keys read once (at flush, when prefill completes) and not keys read every step. It is the
strategy of vllm-omni #1656's review revision (a list of ``[1, 2048]`` rows).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict

from omni_accum.hookspecs import hookimpl
from omni_accum.strategy import AppendAccumulator, KeyInfo, Strategy, StrategySpec, value_nbytes


class Params(BaseModel):
    """``token_list`` takes no params."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class TokenListAccumulator(AppendAccumulator):
    """A list of chunk tensors and a cached concatenation."""

    __slots__ = ("_chunks", "_cached")

    def __init__(self, key: KeyInfo) -> None:
        super().__init__(key)
        self._chunks: list[torch.Tensor] = []
        self._cached: torch.Tensor | None = None

    def start_tensor(self, value: torch.Tensor) -> None:
        self._chunks = [value]
        self._cached = value

    def append_tensor(self, value: torch.Tensor) -> None:
        # Each chunk is kept as it is now, as torch.cat would have copied it (a sender may reuse its tensor
        # for the next chunk): O(chunk) per step. The first stays the sender's own until the second arrives,
        # as upstream's accumulator keeps it, and is copied then.
        chunks = self._chunks
        if len(chunks) == 1:
            chunks[0] = chunks[0].clone()
        chunks.append(value.clone())
        self._cached = None

    def read_tensor(self) -> torch.Tensor:
        if self._cached is None:
            self._cached = torch.cat(self._chunks, dim=0)
        return self._cached

    def current_tensor_meta(self) -> torch.Tensor:
        return self._chunks[0]

    def clear_tensor(self) -> None:
        self._chunks, self._cached = [], None

    def tensor_nbytes(self) -> int:
        held = sum(value_nbytes(c) for c in self._chunks)
        if self._cached is not None and len(self._chunks) > 1:
            held += value_nbytes(self._cached)
        return held

    def projected_tensor_nbytes(self, value: torch.Tensor) -> int:
        """The chunks plus the concatenation the next read caches."""
        held = sum(value_nbytes(c) for c in self._chunks) + value_nbytes(value)
        return 2 * held

    def parts(self) -> list[object]:
        return list(self._chunks) if self._mode == 1 else [self.read()]


class TokenList(Strategy):
    name = "token_list"
    Params = Params

    def new_accumulator(self, key: KeyInfo) -> TokenListAccumulator:
        return TokenListAccumulator(key)


@hookimpl
def omni_accum_register_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="token_list",
            factory=TokenList,
            params_model=Params,
            kinds=frozenset({"append"}),
            description="list of chunks, concatenated on read and cached until the next append",
        )
    ]
