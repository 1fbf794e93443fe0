"""What every release family is made of: a wrapped method (:class:`Target`), a :class:`Family`, the
refusal (:class:`InstallRefused`), the signature shape and the constructor probe.

Nothing here imports vllm-omni; a class is imported only when :func:`_resolve` is asked for it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omni_accum.errors import OmniAccumError
from omni_accum.integrations.vllm_omni.binding_settings import _policy_source, connector_extra


class InstallRefused(OmniAccumError):
    """The installed vllm-omni is not a supported release, or lacks a method omni-accum wraps with its
    release's signature. Nothing was patched."""


@dataclass(frozen=True)
class Target:
    """One method omni-accum wraps: where it is, its signature in the release family, and the wrapper factory.

    ``owner`` is ``module:Class`` for a method, or a bare ``module`` for a module-level function (a stage
    input processor, looked up by its dotted path when a stage starts)."""

    owner: str
    name: str
    signature: str
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
    static: bool = False

    @property
    def label(self) -> str:
        module, _, cls = self.owner.partition(":")
        return f"{cls or module.rpartition('.')[2]}.{self.name}"


@dataclass(frozen=True)
class Family:
    """One vllm-omni release family: the releases it covers and everything omni-accum does differently there.

    Attributes:
        name: ``"0.30"``.
        versions: the vllm-omni releases of the family (each installed with the vllm of the same version).
        targets: the wrapped methods, with their signatures in these releases.
        probes: constructors wrapped by :func:`~omni_accum.integrations.vllm_omni.activate` when no
            process-wide policy is set.
        runner_accumulate: ``module:Class`` whose ``_accumulate_payload`` is the runner transport's own
            chunk merge (the ``upstream`` arm of the bench, the reference of the equivalence tests).
        runner_class: ``module:Class`` a runner transport is made of (the integration tests build theirs).
        span_merge: ``module:Class`` of every ``_accumulate_payload`` that merges ``embed.decode`` by
            token span (``decode_token_start`` / ``decode_token_end``).
        data_plane: ``module:Class`` of the MRv2 data plane, or None where the release has none.
        empty_span_takes_incoming: the release's ``merge_tensor_spans`` hands an incoming span over
            as it is when the held span is empty (0.30); False: ``torch.cat`` of both (0.28).
        differences: what differs from the other families, one line (``omni-accum doctor`` says it).
        relies_on: methods omni-accum does not wrap but whose behaviour a wrapper relies on (``wrap`` None):
            signature-checked with the targets, all or nothing, never patched.
    """

    name: str
    versions: tuple[str, ...]
    targets: tuple[Target, ...]
    probes: tuple[Target, ...]
    runner_accumulate: str
    runner_class: str
    span_merge: tuple[str, ...]
    data_plane: str | None
    empty_span_takes_incoming: bool
    differences: str = ""
    relies_on: tuple[Target, ...] = ()

    @property
    def version(self) -> str:
        """The newest release of the family."""
        return self.versions[-1]

    def covers(self, version: str | None) -> bool:
        return version is not None and _release(version) in self.versions


def _release(version: str) -> str:
    """``0.30.0+cpu`` -> ``0.30.0`` (a local build label is the same release)."""
    return version.split("+", 1)[0].strip()


def _resolve(owner: str) -> Any:
    """The class ``module:Class`` names, or the module a bare ``module`` names."""
    module, _, name = owner.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, name) if name else mod


def signature_shape(func: Any) -> str:
    """A callable's signature without annotations: ``(self, task, sender_token=None)``."""
    sig = inspect.signature(func)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


#: Called with an adapter / transport whose connector ``extra`` names a policy (set by activation).
def _no_policy_hook(obj: Any) -> None:
    return None


class ProbeHook:
    """Where :func:`wrap_probe` reports an instance whose connector ``extra`` names a policy."""

    on_extra_policy: Callable[[Any], None] = _no_policy_hook
    #: Called with every instance made (the peer hello of a receiving adapter, :mod:`..peer`).
    on_made: Callable[[Any], None] = _no_policy_hook


def wrap_probe(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Constructor probe: after construction, a connector extra naming a policy calls ``ProbeHook.on_extra_policy``;
    then ``ProbeHook.on_made`` (a receiving adapter's hello). The adapter's constructor is wrapped so both when
    omni-accum is installed (a target) and before (a probe)."""

    @functools.wraps(orig)
    def probe(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, *args, **kwargs)
        extra = connector_extra(self)
        try:
            named = isinstance(extra, Mapping) and _policy_source(extra)[0] is not None
        except Exception:  # noqa: BLE001 - a bad value: on_extra_policy reports it
            named = True
        if named:
            ProbeHook.on_extra_policy(self)
        ProbeHook.on_made(self)
        return result

    return probe
