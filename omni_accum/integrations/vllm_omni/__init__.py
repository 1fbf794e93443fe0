"""Live integration with vllm-omni (0.30.0 and 0.28.0): install omni-accum into the real chunk-transfer classes.

Supported releases come as release families (:mod:`.families`: one module per family with its
wrapped-method table, signatures, runner hooks and decode-span rule; everything else is shared).
Activation picks the family from the installed vllm-omni version, confirms it with a signature
probe of every method it wraps, and installs all or nothing; another release is refused
(:class:`InstallRefused`, naming the installed and the supported releases). ``TARGETS``,
``PROBES`` and ``SUPPORTED_VERSION`` are the installed family's; ``SUPPORTED_VERSIONS`` lists all.
The method list below is 0.30.0's; 0.28.0 has the same adapter methods, and one runner mixin
(``OmniConnectorModelRunnerMixin``) whose ``_accumulate_payload`` keeps the decode-span merge and
holds the full-payload accumulator.

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

Methods wrapped in 0.30.0 (all signature-checked before anything is patched):

* ``OmniChunkTransferAdapter._send_single_request_for_generation``: the payload goes through a
  :class:`~omni_accum.Sender` where the connector's class ``put`` receives it (no connector
  instance is changed); ``send_once`` values unchanged since their last send are left off the wire.
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
* ``qwen3_omni.thinker2talker_async_chunk`` (the Qwen3-Omni thinker-to-talker stage input processor, a
  module function): its prefill chunks of ``embed.prefill`` / ``hidden_states.output`` go into those keys'
  strategies under chunked prefill, unless they are ``cat`` (:mod:`.processor`).

A chunk omni-accum refuses (``AccumulationError``: a dtype change mid-stream, a legacy empty tensor
followed by rows, which 0.30.0's ``torch.cat`` takes) never fails vllm-omni: the hook logs a warning
(once per request), releases omni-accum's state for the request and lets upstream's code take the
chunk; the next chunk re-seeds from upstream's state (the full-payload accumulator: that request's
entry stays upstream's until it is flushed). The library API (``Receiver.merge``) still refuses.

Strategy selection (tuned tables) sees one deployment context per binding, read when the binding is
made: ``OMNI_ACCUM_CONTEXT_LEN`` / ``OMNI_ACCUM_CONCURRENCY`` or ``omni_accum_context_len`` /
``omni_accum_concurrency`` in the connector extra (see :func:`.deployment.deployment_context`).

Where omni-accum runs (vllm-omni 0.30.0): the API server, every stage engine-core process
(``StageEngineCoreProc``: vLLM's plugin group ``vllm.general_plugins``, loaded by
``EngineCore.__init__`` before the scheduler builds the chunk transfer adapter) and every worker
(vllm-omni's group ``vllm_omni.general_plugins``). Both entry points are idempotent.

The modules: :mod:`.activation` (install, entry points), :mod:`.families` (the release families:
their wrapped-method tables, signatures and runner hooks), :mod:`.targets` (the installed family's
table and the all-or-nothing patching), :mod:`.binding` (per-instance policy, Sender, Receiver; every wrapper
depends on it and on nothing else of the package), :mod:`.send`, :mod:`.receive` (the adapter),
:mod:`.runner` (runner transports), :mod:`.full_payload`, :mod:`.processor` (the stage input processor),
:mod:`.marker` (the send_once bit mask),
:mod:`.deployment` (the deployment context), :mod:`.reporting` (log lines, :func:`status`, status
files), :mod:`.metrics` (Prometheus),
:mod:`.classes` (lazy access to vllm-omni classes for the bench) and :mod:`.replay` (the
``--through vllm-omni`` replay engine; import it to register it).
"""

from omni_accum.integrations.vllm_omni.activation import (
    ENV_REQUIRED,
    ENV_SWITCH,
    activate,
    activate_from_vllm,
    ensure_patched,
    install,
    is_installed,
    uninstall,
)
from omni_accum.integrations.vllm_omni.deployment import ContextSettingError, deployment_context
from omni_accum.integrations.vllm_omni.reporting import BindingStatus, Status, status
from omni_accum.integrations.vllm_omni.families import FAMILIES, SUPPORTED_VERSIONS, Family
from omni_accum.integrations.vllm_omni.targets import (
    InstallRefused,
    Target,
    _resolve,
    active_family,
    check_signatures,
    installed_versions,
    signature_shape,
)


def __getattr__(name: str):  # PEP 562: the installed release family's table, read when asked for
    if name in ("TARGETS", "PROBES", "SUPPORTED_VERSION"):
        from omni_accum.integrations.vllm_omni import targets

        return getattr(targets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ENV_REQUIRED",
    "ENV_SWITCH",
    "BindingStatus",
    "Status",
    "status",
    "FAMILIES",
    "Family",
    "PROBES",
    "SUPPORTED_VERSION",
    "SUPPORTED_VERSIONS",
    "TARGETS",
    "active_family",
    "_resolve",
    "ContextSettingError",
    "InstallRefused",
    "Target",
    "activate",
    "activate_from_vllm",
    "check_signatures",
    "deployment_context",
    "ensure_patched",
    "install",
    "installed_versions",
    "is_installed",
    "signature_shape",
    "uninstall",
]
