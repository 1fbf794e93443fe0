"""The wrapped-method table: every vllm-omni 0.30.0 method omni-accum wraps, with its signature, and
the all-or-nothing patching that checks them first.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omni_accum.errors import OmniAccumError
from omni_accum.integrations.vllm_omni import full_payload, receive, runner, send
from omni_accum.integrations.vllm_omni.binding import _policy_source, connector_extra

SUPPORTED_VERSION = "0.30.0"

_ADAPTER = "vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter:OmniChunkTransferAdapter"
_MIXIN = (
    "vllm_omni.distributed.omni_connectors.model_runner.omni_connector_payload_transport"
    ":_OmniConnectorPayloadTransportMixin"
)
_RUNTIME = "vllm_omni.distributed.omni_connectors.model_runner.omni_connector_runtime:_OmniConnectorRuntimeMixin"
_DATA_PLANE = "vllm_omni.worker_v2.omni_data_plane:OmniRunnerDataPlane"


class InstallRefused(OmniAccumError):
    """The installed vllm-omni does not have the methods omni-accum wraps, with their 0.30.0 signatures."""


@dataclass(frozen=True)
class Target:
    """One method omni-accum wraps: where it is, its 0.30.0 signature, and the wrapper factory."""

    owner: str
    name: str
    signature: str
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
    static: bool = False

    @property
    def label(self) -> str:
        return f"{self.owner.rpartition(':')[2]}.{self.name}"


TARGETS: tuple[Target, ...] = (
    Target(_ADAPTER, "_send_single_request_for_generation", "(self, task, sender_token=None)", send.wrap_send),
    Target(
        _ADAPTER,
        "_commit_received_chunk",
        "(self, request, result, *, stage_id, req_id, chunk_id, connector_get_key)",
        receive.wrap_commit,
    ),
    Target(_ADAPTER, "_clear_receiver_state_locked", "(self, request_id)", receive.wrap_clear_receiver),
    Target(_ADAPTER, "_clear_sender_state_locked", "(self, external_req_id)", send.wrap_clear_sender),
    Target(
        _MIXIN,
        "_accumulate_payload",
        "(self, req_id, payload_data)",
        lambda f: runner.wrap_accumulate(f, decode_spans=False),
    ),
    Target(
        _DATA_PLANE,
        "_accumulate_payload",
        "(self, req_id, payload_data)",
        lambda f: runner.wrap_accumulate(f, decode_spans=True),
    ),
    Target(
        _MIXIN,
        "accumulate_full_payload_output",
        "(self, req_id, pooler_output, request)",
        full_payload.wrap_accumulate_full,
    ),
    Target(_MIXIN, "_materialize_full_payload_entry", "(entry)", full_payload.wrap_materialize, static=True),
)
#: Constructors probed by :func:`activate` when no process-wide policy is set: the connector
#: ``extra`` is only visible once an adapter / transport exists.
PROBES: tuple[Target, ...] = (
    Target(_ADAPTER, "__init__", "(self, vllm_config)", lambda f: wrap_probe(f)),
    Target(
        _RUNTIME,
        "init_omni_connectors",
        "(self, model_config, kv_transfer_manager=None, *, synchronous=False)",
        lambda f: wrap_probe(f),
    ),
)

_patched: dict[tuple[str, str], tuple[type, Any]] = {}  # (owner, name) -> (class, original raw attribute)


def _resolve(owner: str) -> type:
    module, _, name = owner.partition(":")
    return getattr(importlib.import_module(module), name)


def signature_shape(func: Any) -> str:
    """A callable's signature without annotations: ``(self, task, sender_token=None)``."""
    sig = inspect.signature(func)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def installed_versions() -> str:
    out = []
    for dist in ("vllm-omni", "vllm"):
        try:
            from importlib.metadata import version

            out.append(f"{dist} {version(dist)}")
        except Exception:  # noqa: BLE001 - not installed
            out.append(f"{dist} (not installed)")
    return ", ".join(out)


def check_signatures(targets: tuple[Target, ...] = TARGETS + PROBES) -> list[str]:
    """Every mismatch between the installed vllm-omni and 0.30.0, one message per method (empty: OK)."""
    problems = []
    for t in targets:
        try:
            cls = _resolve(t.owner)
            raw = inspect.getattr_static(cls, t.name)
        except Exception as e:  # noqa: BLE001 - missing module, class or method
            problems.append(f"{t.label}: not found ({type(e).__name__}: {e})")
            continue
        if (t.owner, t.name) in _patched:
            continue  # ours; its original was checked when it was patched
        if t.static != isinstance(raw, staticmethod):
            problems.append(f"{t.label}: expected {'a' if t.static else 'no'} staticmethod")
            continue
        shape = signature_shape(raw.__func__ if isinstance(raw, staticmethod) else raw)
        if shape != t.signature:
            problems.append(f"{t.label}: signature is {shape}, vllm-omni {SUPPORTED_VERSION} has {t.signature}")
    return problems


def _patch(targets: tuple[Target, ...], checked: tuple[Target, ...] = TARGETS + PROBES) -> None:
    """Check every method of ``checked``, then patch those of ``targets`` not yet patched; all or nothing."""
    problems = check_signatures(checked)
    if problems:
        raise InstallRefused(
            f"omni-accum supports vllm-omni {SUPPORTED_VERSION}; installed: {installed_versions()}. Refusing to "
            "install, nothing was patched:\n  " + "\n  ".join(problems)
        )
    todo = [(t, _resolve(t.owner)) for t in targets if (t.owner, t.name) not in _patched]
    for t, cls in todo:
        raw = inspect.getattr_static(cls, t.name)
        func = raw.__func__ if isinstance(raw, staticmethod) else raw
        wrapped = t.wrap(func)
        wrapped.__omni_accum_original__ = func  # type: ignore[attr-defined]
        _patched[(t.owner, t.name)] = (cls, raw)
        setattr(cls, t.name, staticmethod(wrapped) if t.static else wrapped)


#: Called with an adapter / transport whose connector ``extra`` names a policy (set by activation).
def _no_policy_hook(obj: Any) -> None:
    return None


on_extra_policy: Callable[[Any], None] = _no_policy_hook


def wrap_probe(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Constructor probe: after construction, a connector extra naming a policy calls :data:`on_extra_policy`."""

    @functools.wraps(orig)
    def probe(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, *args, **kwargs)
        extra = connector_extra(self)
        if isinstance(extra, Mapping) and _policy_source(extra)[0] is not None:
            on_extra_policy(self)
        return result

    return probe
