"""Activation: install / uninstall, and the plugin entry points (``activate``, ``activate_from_vllm``).

See the package docstring (:mod:`omni_accum.integrations.vllm_omni`) for what is wrapped and why.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

from omni_accum.switches import SettingError, check_switches, env_flag
from omni_accum.errors import OmniAccumError
from omni_accum.integrations.vllm_omni import binding, capture, deployment, handoff, instances, peer, reporting, send
from omni_accum.integrations.vllm_omni.handshake import text_source
from omni_accum.integrations.vllm_omni.binding_settings import (
    DEFAULT_ADAPTER_KEYS,
    Settings,
    check_extra,
    connector_extra,
)
from omni_accum.integrations.vllm_omni.processor import adopt as adopt_processor
from omni_accum.integrations.vllm_omni.targets import ProbeHook, _patch, _patched, active_family
from omni_accum.policy import ENV_POLICY, Policy, load_policy
from omni_accum.policy.loader import POLICY_OFF as _OFF

logger = logging.getLogger("omni_accum.vllm_omni")

#: ``OMNI_ACCUM_VLLM_OMNI=0`` makes :func:`activate` a no-op (nothing patched, not even probes).
ENV_SWITCH = "OMNI_ACCUM_VLLM_OMNI"
#: ``OMNI_ACCUM_REQUIRED=1``: a failed activation ends the process (with the reason) instead of serving
#: without omni-accum.
ENV_REQUIRED = "OMNI_ACCUM_REQUIRED"
_lock = threading.RLock()


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
        InstallRefused: the installed vllm-omni is not a supported release, or a method of its release
            family is missing or has another signature (nothing patched; see :mod:`.families`).
        PolicyError: the policy is invalid (nothing patched).
        ContextSettingError: ``OMNI_ACCUM_CONTEXT_LEN`` / ``OMNI_ACCUM_CONCURRENCY`` is not a whole number
            >= 1 (nothing patched).
        SettingError: an ``OMNI_ACCUM_*`` on/off switch is set to something else, ``OMNI_ACCUM_HANDOFF_SAMPLE``
            is not a whole number >= 0, or an ``OMNI_ACCUM_CAPTURE*`` setting is bad (nothing patched).
    """
    check_switches()  # a switch neither on nor off refuses here (nothing patched)
    loaded = load_policy(policy) if policy is not None else None
    deployment.deployment_context()  # a bad OMNI_ACCUM_CONTEXT_LEN / OMNI_ACCUM_CONCURRENCY refuses here, not in a hook
    peer.deployment_token()  # OMNI_ACCUM_DEPLOYMENT, inherited by the stage processes started from here
    handoff.read_settings()  # a bad OMNI_ACCUM_HANDOFF_SAMPLE refuses here (nothing patched)
    capture.settings()  # and a bad OMNI_ACCUM_CAPTURE* (it was found at the first chunk, and capture went off)
    with _lock:
        _patch("targets")
        if _wraps_sends():
            send.wrap_connector_classes()
        Settings.policy = loaded
        Settings.installed, Settings.refused = True, None
        if policy is not None:
            Settings.policy_source = _describe_source(policy)
        if adapter_keys is not None:
            Settings.adapter_keys = tuple(adapter_keys)
    reporting.register_exit_dump()  # OMNI_ACCUM_STATUS_DIR: installed from code too, not only by the plugin


def ensure_patched() -> None:
    """Patch the wrapped methods (signature-checked, idempotent) without touching the process-wide
    policy or adapter keys: an earlier :func:`install`'s policy stays; instances without a policy run
    upstream code. For code that binds its own instances (:func:`.binding.bind`)."""
    with _lock:
        _patch("targets")
        if _wraps_sends():
            send.wrap_connector_classes()


def _wraps_sends() -> bool:
    """The active family has a send hook (0.28, 0.30: the connectors' ``put`` then encodes omni-accum's wire); 0.16
    has none, and its connectors are left as they are."""
    fam = active_family()
    return fam is not None and any(t.wrap is send.wrap_send for t in fam.targets)


def uninstall() -> None:
    """Restore every patched method and forget the process-wide policy. Safe to call when not installed.

    Every instance omni-accum bound is detached (:func:`.instances.detach`): its state is
    released, its binding dropped, its accumulator store a plain dict again (same contents), every
    connector class's ``put`` its own again, and its pending full-payload entries turned into upstream's
    representation, so upstream's code carries on alone, and a later :func:`install` starts clean
    (re-seeding in-progress requests from upstream's store). Call it while no chunk is in transfer:
    a hook already running on another thread may finish on the state it started with.
    """
    with _lock:
        for (_owner, name), (cls, raw) in reversed(list(_patched.items())):
            setattr(cls, name, raw)
        _patched.clear()
        instances.detach_all()
        send.restore_connector_classes()
        Settings.policy = None
        Settings.installed = False
        Settings.policy_source = "no policy"
        Settings.adapter_keys = DEFAULT_ADAPTER_KEYS


def is_installed() -> bool:
    """True when the method wrappers (not just the constructor probes) are in place."""
    fam = active_family()
    return fam is not None and all((t.owner, t.name) in _patched for t in fam.targets)


def _probes_patched() -> bool:
    fam = active_family()
    return fam is not None and all((t.owner, t.name) in _patched for t in fam.probes)


def _on_extra_policy(obj: Any) -> None:
    """An adapter or transport was built with a connector extra naming a policy: install the wrappers, and
    check its settings now (its binding is made on first use, on whichever thread vllm-omni calls from), so
    that ``OMNI_ACCUM_REQUIRED=1`` ends the process here when they are bad."""
    try:
        if not is_installed():
            install(None)
        check_extra(connector_extra(obj))
    except OmniAccumError as e:
        logger.error("omni-accum: connector extra of %s names a policy, but %s", type(obj).__name__, e)
        try:
            required = _flag(ENV_REQUIRED)
        except SettingError:
            required = True  # activation refused it already; asked for strictness, most likely
        if required:
            raise SystemExit(f"omni-accum: {ENV_REQUIRED}=1 and {type(obj).__name__}'s connector extra: {e}") from e


def _on_made(obj: Any) -> None:
    """An adapter or transport was just made: a receiving adapter with a policy says hello (:mod:`.peer`); a stage
    input processor it resolved before the wrappers were installed becomes the wrapper (:mod:`.processor`); a
    receiving adapter on ``OmniAccumMooncakeConnector`` is made known to it (a chunk whose parts the store lost then
    fails its request at once, :mod:`.mooncake_get`)."""
    adopt_processor(obj)
    attach = getattr(getattr(obj, "connector", None), "attach_receiver", None)
    if callable(attach) and peer.receives(obj):
        try:
            attach(obj)
        except Exception as e:  # noqa: BLE001 - a hook never fails vllm-omni
            logger.warning("omni-accum: could not attach %s to its connector: %s", type(obj).__name__, e)
    if Settings.installed and peer.receives(obj):
        b = binding.binding_for(obj)
        if b is not None:
            peer.announce(obj, b)


ProbeHook.on_extra_policy = _on_extra_policy
ProbeHook.on_made = _on_made


def _describe_source(policy: Any) -> str:
    if isinstance(policy, (str, os.PathLike)):
        return text_source(os.fspath(policy))
    if isinstance(policy, Policy):
        return "a Policy object"
    return "a mapping"


def _flag(name: str) -> bool:
    return env_flag(name)  # SettingError for a value neither on nor off (see activate)


def activate() -> None:
    """Entry point of group ``vllm_omni.general_plugins`` (called in every vllm-omni process that loads
    vllm-omni's plugins) and, through :func:`activate_from_vllm`, of vLLM's ``vllm.general_plugins``.

    ``OMNI_ACCUM_POLICY`` set: install that policy (``off``: no process-wide policy; a connector whose
    extra names one still installs it). Unset: only the two constructors are probed, and the first
    adapter / transport whose connector ``extra`` has ``omni_accum_policy`` installs the wrappers.
    ``OMNI_ACCUM_VLLM_OMNI=0``: nothing. A refusal (a bad policy; an on/off switch neither on nor off, whether
    ``OMNI_ACCUM_POLICY`` is set or not: then not even the probes) is logged and leaves vllm-omni as is, unless
    ``OMNI_ACCUM_REQUIRED=1``: then the process exits with the reason (``SystemExit``). One INFO line per
    process says what happened (installed, or why not). Idempotent: a process that loads both plugin
    groups activates (and logs) once.
    """
    try:
        required = _flag(ENV_REQUIRED)
    except SettingError as e:  # what was meant is unknown: asked for strictness, most likely
        raise SystemExit(f"omni-accum: {e}") from e
    try:
        on = _flag(ENV_SWITCH)
    except SettingError as e:  # neither switched on nor off: do nothing rather than guess
        reporting.ensure_visible_logging()
        Settings.refused = str(e)
        logger.error("omni-accum not installed (pid=%d): %s", os.getpid(), e)
        if required:
            raise SystemExit(f"omni-accum: {ENV_REQUIRED}=1 and {e}") from e
        reporting.register_exit_dump()  # the status file says why
        return
    if not on:
        if required:
            raise SystemExit(f"omni-accum: {ENV_REQUIRED}=1 but {ENV_SWITCH}=0 disables it")
        return
    peer.deployment_token()  # before any stage process is started from this one (.peer)
    env = os.environ.get(ENV_POLICY, "").strip()
    off = env.lower() in _OFF
    with _lock:
        if env and not off:
            if is_installed() and Settings.policy_source == ENV_POLICY:
                return
        elif _probes_patched():
            return
    reporting.ensure_visible_logging()
    where = reporting.process_label()
    try:
        if env and not off:
            install(load_policy(None))
            Settings.policy_source, Settings.refused = ENV_POLICY, None
            policy = Settings.policy
            fp = binding.policy_fingerprint(policy) if policy else "-"
            ctx = deployment.context_label(policy, deployment.deployment_context())
            logger.info(
                "omni-accum installed into vllm-omni (pid=%d, process=%s, policy from %s, fingerprint %s; %s; %s)",
                os.getpid(),
                where,
                ENV_POLICY,
                fp,
                deployment.policy_summary(policy),
                ctx,
            )
        else:
            check_switches()  # a switch neither on nor off refuses here too, as install() does (nothing patched)
            with _lock:
                _patch("probes")
            logger.info(
                "omni-accum not installed in this process yet (pid=%d, process=%s): %s; a connector whose extra "
                "names omni_accum_policy installs it",
                os.getpid(),
                where,
                f"{ENV_POLICY}={env}" if off else f"{ENV_POLICY} is not set",
            )
    except Exception as e:  # noqa: BLE001 - a plugin never fails vllm-omni unless asked to
        Settings.refused = str(e)  # in status() and the status file too
        logger.error("omni-accum not installed (pid=%d, process=%s): %s", os.getpid(), where, e)
        if required:
            raise SystemExit(f"omni-accum: {ENV_REQUIRED}=1 and activation failed in pid {os.getpid()}: {e}") from e
    reporting.register_exit_dump()


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
