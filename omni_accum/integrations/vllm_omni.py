"""Live integration with vllm-omni 0.30.0: install omni-accum into the real chunk-transfer classes.

Turn it on by configuration (the ``vllm_omni.general_plugins`` entry point calls :func:`activate`
in every vllm-omni process) or from code::

    from omni_accum.integrations import vllm_omni
    vllm_omni.install("qwen3-omni")     # preset name, path, mapping or Policy; None: connector extra only
    ...
    vllm_omni.uninstall()

Where the policy comes from, per adapter / transport instance: ``omni_accum_policy`` in its
connector ``extra`` (deploy YAML; ``off`` opts one connector out), else the policy given to
:func:`install` (``OMNI_ACCUM_POLICY`` for :func:`activate`). Instances with neither run upstream
code untouched.

Methods wrapped (all signature-checked against 0.30.0 before anything is patched):

* ``OmniChunkTransferAdapter._send_single_request_for_generation``: the payload goes through a
  :class:`~omni_accum.Sender` at ``connector.put``; ``send_once`` values unchanged since their
  last send are left off the wire.
* ``OmniChunkTransferAdapter._commit_received_chunk``: omitted values are restored from a
  :class:`~omni_accum.Receiver`; for an AR receiver the adapter keys (``embed.prefill``,
  ``hidden_states.output``) are accumulated with their append-kind strategy before hand-over
  (not under ``cat``, which hands raw deltas over as 0.30.0 does).
* ``OmniChunkTransferAdapter._clear_receiver_state_locked`` / ``_clear_sender_state_locked``:
  release, where upstream releases.
* ``_OmniConnectorPayloadTransportMixin._accumulate_payload`` and
  ``OmniRunnerDataPlane._accumulate_payload`` (decode-span semantics kept): accumulate through a
  Receiver; upstream's accumulator dict pops release it.
* ``_OmniConnectorPayloadTransportMixin.accumulate_full_payload_output`` /
  ``_materialize_full_payload_entry``: per-key strategies in the full-payload accumulator.

A chunk omni-accum refuses (``AccumulationError``: a dtype change mid-stream, a legacy empty tensor
followed by rows, which 0.30.0's ``torch.cat`` takes) never fails vllm-omni: the hook logs a warning
(once per request), releases omni-accum's state for the request and lets upstream's code take the
chunk; the next chunk re-seeds from upstream's state (the full-payload accumulator: that request's
entry stays upstream's until it is flushed). The library API (``Receiver.merge``) still refuses.

Strategy selection (tuned tables) sees one deployment context per binding, read when the binding is
made: ``OMNI_ACCUM_CONTEXT_LEN`` / ``OMNI_ACCUM_CONCURRENCY`` or ``omni_accum_context_len`` /
``omni_accum_concurrency`` in the connector extra (see ``vllm_omni_hooks.deployment_context``).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omni_accum.errors import OmniAccumError
from omni_accum.integrations import vllm_omni_full_payload as full_payload
from omni_accum.integrations import vllm_omni_hooks as hooks
from omni_accum.integrations import vllm_omni_status as status
from omni_accum.loader import ENV_POLICY, load_policy
from omni_accum.policy import Policy

logger = logging.getLogger("omni_accum.vllm_omni")

SUPPORTED_VERSION = "0.30.0"
#: ``OMNI_ACCUM_VLLM_OMNI=0`` makes :func:`activate` a no-op (nothing patched, not even probes).
ENV_SWITCH = "OMNI_ACCUM_VLLM_OMNI"

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
    Target(_ADAPTER, "_send_single_request_for_generation", "(self, task, sender_token=None)", hooks.wrap_send),
    Target(
        _ADAPTER,
        "_commit_received_chunk",
        "(self, request, result, *, stage_id, req_id, chunk_id, connector_get_key)",
        hooks.wrap_commit,
    ),
    Target(_ADAPTER, "_clear_receiver_state_locked", "(self, request_id)", hooks.wrap_clear_receiver),
    Target(_ADAPTER, "_clear_sender_state_locked", "(self, external_req_id)", hooks.wrap_clear_sender),
    Target(
        _MIXIN,
        "_accumulate_payload",
        "(self, req_id, payload_data)",
        lambda f: hooks.wrap_accumulate(f, decode_spans=False),
    ),
    Target(
        _DATA_PLANE,
        "_accumulate_payload",
        "(self, req_id, payload_data)",
        lambda f: hooks.wrap_accumulate(f, decode_spans=True),
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
    Target(_ADAPTER, "__init__", "(self, vllm_config)", lambda f: hooks.wrap_probe(f, _on_extra_policy)),
    Target(
        _RUNTIME,
        "init_omni_connectors",
        "(self, model_config, kv_transfer_manager=None, *, synchronous=False)",
        lambda f: hooks.wrap_probe(f, _on_extra_policy),
    ),
)

_lock = threading.RLock()
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


def install(
    policy: Policy | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    adapter_keys: tuple[str, ...] | list[str] | None = None,
) -> None:
    """Install omni-accum into vllm-omni's classes (idempotent).

    Args:
        policy: process-wide policy (preset name, path, mapping or Policy) for every adapter /
            transport whose connector ``extra`` names none; None: only those whose extra names one.
            A later call replaces it for instances that have not bound a policy yet.
        adapter_keys: key paths an AR receiving adapter accumulates before hand-over (default
            ``embed.prefill``, ``hidden_states.output``); ``omni_accum_adapter_keys`` in the extra wins.

    Raises:
        InstallRefused: a wrapped method is missing or its signature differs from 0.30.0 (nothing patched).
        PolicyError: the policy is invalid (nothing patched).
        ContextSettingError: ``OMNI_ACCUM_CONTEXT_LEN`` / ``OMNI_ACCUM_CONCURRENCY`` is not a whole number
            >= 1 (nothing patched).
    """
    loaded = load_policy(policy) if policy is not None else None
    hooks.deployment_context()  # a bad OMNI_ACCUM_CONTEXT_LEN / OMNI_ACCUM_CONCURRENCY refuses here, not in a hook
    with _lock:
        _patch(TARGETS)
        hooks.Settings.policy = loaded
        hooks.Settings.installed = True
        if policy is not None:
            hooks.Settings.policy_source = _describe_source(policy)
        if adapter_keys is not None:
            hooks.Settings.adapter_keys = tuple(adapter_keys)


def ensure_patched() -> None:
    """Patch the wrapped methods (signature-checked, idempotent) without touching the process-wide
    policy or adapter keys: an earlier :func:`install`'s policy stays; instances without a policy run
    upstream code. For code that binds its own instances (:func:`vllm_omni_hooks.bind`)."""
    with _lock:
        _patch(TARGETS)


def uninstall() -> None:
    """Restore every patched method and forget the process-wide policy. Safe to call when not installed.

    Every instance omni-accum bound is detached (:func:`vllm_omni_hooks.detach`): its state is
    released, its binding dropped, its accumulator store a plain dict again (same contents), its
    connector's ``put`` unwrapped, and its pending full-payload entries turned into upstream's
    representation, so upstream's code carries on alone, and a later :func:`install` starts clean
    (re-seeding in-progress requests from upstream's store). Call it while no chunk is in transfer:
    a hook already running on another thread may finish on the state it started with.
    """
    with _lock:
        for (_owner, name), (cls, raw) in reversed(list(_patched.items())):
            setattr(cls, name, raw)
        _patched.clear()
        hooks.detach_all()
        hooks.Settings.policy = None
        hooks.Settings.installed = False
        hooks.Settings.policy_source = "no policy"
        hooks.Settings.adapter_keys = hooks.DEFAULT_ADAPTER_KEYS


def is_installed() -> bool:
    """True when the method wrappers (not just the constructor probes) are in place."""
    return all((t.owner, t.name) in _patched for t in TARGETS)


def _on_extra_policy(obj: Any) -> None:
    try:
        if not is_installed():
            install(None)
    except OmniAccumError as e:
        logger.error("omni-accum: connector extra of %s names a policy, but %s", type(obj).__name__, e)


def _describe_source(policy: Any) -> str:
    if isinstance(policy, (str, os.PathLike)):
        text = os.fspath(policy)
        return text if "\n" not in text and len(text) <= 120 else "inline policy text"
    if isinstance(policy, Policy):
        return "a Policy object"
    return "a mapping"


def activate() -> None:
    """Entry point of group ``vllm_omni.general_plugins`` (called in every vllm-omni process that loads
    vllm-omni's plugins) and, through :func:`activate_from_vllm`, of vLLM's ``vllm.general_plugins``.

    ``OMNI_ACCUM_POLICY`` set: install that policy. Unset: only the two constructors are probed,
    and the first adapter / transport whose connector ``extra`` has ``omni_accum_policy`` installs
    the wrappers. ``OMNI_ACCUM_VLLM_OMNI=0``: nothing. A refusal is logged and leaves vllm-omni as is.
    Idempotent: a process that loads both plugin groups activates (and logs) once.
    """
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return
    with _lock:
        if os.environ.get(ENV_POLICY, "").strip():
            if is_installed() and hooks.Settings.policy_source == ENV_POLICY:
                return
        elif all((t.owner, t.name) in _patched for t in PROBES):
            return
    status.ensure_visible_logging()
    where = status.process_label()
    try:
        if os.environ.get(ENV_POLICY, "").strip():
            install(load_policy(None))
            hooks.Settings.policy_source = ENV_POLICY
            logger.info(
                "omni-accum installed into vllm-omni (pid=%d, process=%s, policy from %s)",
                os.getpid(),
                where,
                ENV_POLICY,
            )
        else:
            with _lock:
                _patch(PROBES)
            logger.info(
                "omni-accum ready in vllm-omni (pid=%d, process=%s): %s is not set; a connector whose extra names "
                "omni_accum_policy installs it",
                os.getpid(),
                where,
                ENV_POLICY,
            )
    except OmniAccumError as e:
        logger.error("omni-accum not installed (pid=%d, process=%s): %s", os.getpid(), where, e)
    status.register_exit_dump()


def activate_from_vllm() -> None:
    """Entry point of vLLM's group ``vllm.general_plugins``.

    vllm-omni 0.30.0's stage engine-core processes (``StageEngineCoreProc``, where the scheduler
    builds the chunk transfer adapter) never call vllm-omni's ``load_omni_general_plugins()``; they
    only run vLLM's ``EngineCore.__init__``, which loads vLLM's plugin group before it builds the
    scheduler. So omni-accum registers there too, and activates when the process is a vllm-omni one
    (``vllm_omni`` already imported). A plain vLLM process is left alone: vllm-omni is never imported
    into it.
    """
    if "vllm_omni" not in sys.modules:
        return
    activate()
