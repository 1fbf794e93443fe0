"""Hook specifications of omni-accum (pluggy project name ``omni_accum``).

Plugins are modules or objects with functions marked ``@omni_accum.hookimpl``, exposed through
the ``omni_accum`` entry-point group. The five built-in strategies are plugins of exactly this
kind and register through the same path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from omni_accum.context import KeyMeta, StreamContext
    from omni_accum.policy.model import Policy, StrategyChoice
    from omni_accum.strategy import StrategySpec

PROJECT = "omni_accum"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---------------------------------------------------------------------------------------------- #
# Registration hooks
# ---------------------------------------------------------------------------------------------- #


@hookspec
def omni_accum_register_strategies() -> list[StrategySpec]:
    """Return the strategies this plugin provides.

    Called once per plugin when the plugin manager loads plugins; every plugin's result is
    collected (not ``firstresult``). A plugin that raises here, or returns records that are not
    valid, is reported and skipped (an error with ``OMNI_ACCUM_STRICT_PLUGINS=1``). A name already
    registered by another plugin is a :class:`~omni_accum.errors.DuplicateStrategyError` naming
    both plugins.

    Returns:
        A list of :class:`~omni_accum.strategy.StrategySpec` records: ``name``, ``factory``
        (called with a validated params instance, returns a :class:`~omni_accum.strategy.Strategy`),
        ``params_model`` (pydantic, ``extra="forbid"``), ``kinds`` (subset of ``append``,
        ``replace``, ``static``), ``description`` and an optional ``params_grid`` for the tuner.

    Example::

        import torch
        from pydantic import BaseModel, ConfigDict
        import omni_accum
        from omni_accum.strategy import AppendAccumulator, Strategy, StrategySpec


        class Params(BaseModel):
            model_config = ConfigDict(extra="forbid")


        class _Acc(AppendAccumulator):
            __slots__ = ("_t",)

            def start_tensor(self, value):
                self._t = value

            def append_tensor(self, value):
                self._t = torch.cat([self._t, value])

            def read_tensor(self):
                return self._t

            def current_tensor_meta(self):
                return self._t


        class MyCat(Strategy):
            name = "my_cat"
            Params = Params

            def new_accumulator(self, key):
                return _Acc(key)


        @omni_accum.hookimpl
        def omni_accum_register_strategies():
            return [StrategySpec(name="my_cat", factory=MyCat, params_model=Params,
                                 kinds=frozenset({"append"}), description="torch.cat, my way")]
    """


# ---------------------------------------------------------------------------------------------- #
# Selection hooks
# ---------------------------------------------------------------------------------------------- #


@hookspec(firstresult=True)
def omni_accum_select_strategy(
    key: str, meta: KeyMeta, context: StreamContext, policy: Policy
) -> StrategyChoice | None:
    """Choose the strategy (and params) for one key of one request.

    Called when a ``Sender`` or ``Receiver`` meets a key's first value in a request, unless it already
    chose for the same arguments (each endpoint keeps its latest 4,096 choices, keyed by the key path, the
    first value's kind, dtype, trailing shape and rank, and the context's length, concurrency and length
    hints): once per endpoint and distinct arguments, not once per request. Stops at the first
    non-``None`` result. The built-in implementation is ``trylast`` and applies the policy: exact
    rule, then globs in order, then the tuned table for ``context``, then the default. A plugin
    returns a choice to override it, or ``None`` to let the policy decide. Sender and receiver
    must choose alike, so the choice must depend only on these arguments.

    Args:
        key: the key path, ``"embed.decode"`` (nested payloads) or ``"thinker_embeddings"`` (flat).
        meta: what the first value of the key looks like (type, dtype, trailing shape, rank).
        context: the stream's context length, concurrency and length hints.
        policy: the validated policy in force.

    Returns:
        A :class:`~omni_accum.policy.StrategyChoice` naming a registered strategy, or ``None``.

    Example::

        import omni_accum
        from omni_accum.policy import StrategyChoice


        @omni_accum.hookimpl
        def omni_accum_select_strategy(key, meta, context, policy):
            if meta.value_type == "tensor" and (context.context_len or 0) > 16000:
                return StrategyChoice(strategy="prealloc", params={"growth_factor": 1.5},
                                      source="plugin long-context")
            return None
    """


ALL_HOOKS: tuple[str, ...] = ("omni_accum_register_strategies", "omni_accum_select_strategy")
