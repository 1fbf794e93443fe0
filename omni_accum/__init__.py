"""omni-accum: per-key accumulation policies for vllm-omni's multi-stage payload chunks.

Public API (stable names)::

    import omni_accum
    policy = omni_accum.load_policy("qwen3-omni")
    ctx = omni_accum.StreamContext(context_len=8000, concurrency=10)
    tx = omni_accum.Sender(policy, context=ctx)
    rx = omni_accum.Receiver(policy, context=ctx)
    view = rx.merge("req-1", tx.encode("req-1", chunk))
    tx.release("req-1"); rx.release("req-1")
"""

from __future__ import annotations

from omni_accum.engine import WIRE_MARKER, GroupView, Receiver, RequestView, Sender
from omni_accum.context import KeyMeta, StreamContext
from omni_accum.errors import (
    AccumulationError,
    DuplicateStrategyError,
    InvalidArgumentError,
    OmniAccumError,
    PluginError,
    PolicyArgumentError,
    PolicyError,
    SettingError,
    UnknownRequestError,
    UnknownStrategyError,
)
from omni_accum.hookspecs import hookimpl, hookspec
from omni_accum.manager import StrategyManager, get_manager, reset_manager
from omni_accum.policy import Policy, Rule, StrategyChoice, dump_policy, load_policy, preset_names
from omni_accum.strategy import (
    OMIT,
    Accumulator,
    AppendAccumulator,
    Encoder,
    KeyInfo,
    Strategy,
    StrategySpec,
)

__version__ = "0.1.0"

__all__ = [
    "OMIT",
    "WIRE_MARKER",
    "AccumulationError",
    "Accumulator",
    "AppendAccumulator",
    "DuplicateStrategyError",
    "Encoder",
    "GroupView",
    "InvalidArgumentError",
    "KeyInfo",
    "KeyMeta",
    "OmniAccumError",
    "PluginError",
    "Policy",
    "PolicyArgumentError",
    "PolicyError",
    "Receiver",
    "RequestView",
    "Rule",
    "Sender",
    "SettingError",
    "Strategy",
    "StrategyChoice",
    "StrategyManager",
    "StrategySpec",
    "StreamContext",
    "UnknownRequestError",
    "UnknownStrategyError",
    "__version__",
    "dump_policy",
    "get_manager",
    "hookimpl",
    "hookspec",
    "load_policy",
    "preset_names",
    "reset_manager",
]
