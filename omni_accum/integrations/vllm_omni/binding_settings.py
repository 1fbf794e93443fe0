"""Which policy an adapter or transport runs: the process-wide :class:`Settings` that ``install`` writes, and
the connector ``extra`` keys a deploy YAML sets per connector (``omni_accum_policy``, ``omni_accum_adapter_keys``).

:mod:`.binding` makes a binding from what :func:`check_extra` reads here; :mod:`.activation` checks a connector's
``extra`` with it as soon as an adapter or transport is built with one, so that a bad setting is named before a request
runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from omni_accum.context import StreamContext
from omni_accum.errors import PolicyError, close_matches, key_form, setting_given
from omni_accum.integrations.vllm_omni.deployment import deployment_context
from omni_accum.policy import Policy, load_policy
from omni_accum.policy.loader import POLICY_OFF

#: Connector ``extra`` keys read by the integration.
EXTRA_POLICY = "omni_accum_policy"
EXTRA_ADAPTER_KEYS = "omni_accum_adapter_keys"
#: Keys an AR receiving adapter accumulates (when their strategy is append-kind, other than ``cat``)
#: before handing the view over: the prefill rows that chunked prefill (vllm-omni PR #2997) splits
#: over several chunks.
#: Other keys are handed over as raw deltas, as in 0.30.0 (the talker keeps its own decode cache).
DEFAULT_ADAPTER_KEYS = ("embed.prefill", "hidden_states.output")


class Settings:
    """Process-wide settings written by ``install``: the global policy and the AR adapter keys."""

    policy: Policy | None = None
    adapter_keys: tuple[str, ...] = DEFAULT_ADAPTER_KEYS
    #: True while the method wrappers are in place (``install`` .. ``uninstall``).
    installed: bool = False
    #: Where the process-wide policy came from (``OMNI_ACCUM_POLICY``, a preset name, a path ...).
    policy_source: str = "no policy"
    #: Why the plugin's activation installed nothing in this process (None: it did, or was not asked to).
    refused: str | None = None
    #: Called after a binding is made or a request released (the status file, when one is asked for).
    on_change: Callable[[], None] | None = None


def extra_keys() -> tuple[str, ...]:
    """Every ``omni_accum_*`` key omni-accum reads from a connector ``extra``."""
    from omni_accum.integrations.vllm_omni.capture import EXTRA_CAPTURE, EXTRA_MAX_BYTES, EXTRA_VALUES
    from omni_accum.integrations.vllm_omni.deployment import EXTRA_CONCURRENCY, EXTRA_CONTEXT_LEN

    return (EXTRA_POLICY, EXTRA_ADAPTER_KEYS, EXTRA_CONTEXT_LEN, EXTRA_CONCURRENCY, EXTRA_CAPTURE, EXTRA_VALUES,
            EXTRA_MAX_BYTES)  # fmt: skip


def unknown_extra_keys(extra: Any) -> str | None:
    """What is wrong with the ``omni_accum_*`` keys of a connector ``extra`` that omni-accum does not read (a typo:
    its setting would not apply, and ``omni_accum_polcy`` would leave omni-accum off without a word), or None."""
    if not isinstance(extra, Mapping):
        return None
    known = extra_keys()
    unknown = sorted(str(k) for k in extra if key_form(k).startswith("omni_accum_") and k not in known)
    if not unknown:
        return None
    close = {k: close_matches(k, known, cutoff=0.75) for k in unknown}
    named = ", ".join(f"{k!r}" + (f" (did you mean {close[k][0]!r}?)" if close[k] else "") for k in unknown)
    return f"connector extra: unknown key(s) {named}; omni-accum reads {', '.join(known)}"


def _policy_source(extra: Any) -> tuple[Any, str]:
    problem = unknown_extra_keys(extra)
    if problem:
        raise PolicyError(problem)
    value = setting_given(extra, EXTRA_POLICY)  # empty or blank: the key left out (OMNI_ACCUM_POLICY), as arena_name
    if value is not None:
        if value is False or (isinstance(value, str) and value.strip().lower() in POLICY_OFF):
            return None, f"connector extra {EXTRA_POLICY}={value!r} (off)"
        if not isinstance(value, (str, Mapping)):
            raise PolicyError(
                f"connector extra {EXTRA_POLICY}={value!r} is not a policy: give a preset name, a policy file, "
                "inline YAML or a mapping (false or 'off': vllm-omni's own accumulation)"
            )
        return value, f"connector extra {EXTRA_POLICY}"
    if Settings.policy is not None:
        return Settings.policy, "install()"
    return None, "no policy"


def _adapter_keys(keys: Any) -> tuple[str, ...] | None:
    """``omni_accum_adapter_keys`` of a connector extra: a list of key paths (None: not given)."""
    if keys is None:
        return None
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) and k.strip() for k in keys):
        raise PolicyError(
            f"connector extra {EXTRA_ADAPTER_KEYS}={keys!r} is not a list of key paths (e.g. [embed.prefill])"
        )
    if not keys:  # it was read as "not given": the defaults applied without a word
        raise PolicyError(
            f"connector extra {EXTRA_ADAPTER_KEYS}=[] names no key: give key paths, or leave it out for the defaults "
            f"({', '.join(DEFAULT_ADAPTER_KEYS)})"
        )
    return tuple(keys)


def check_extra(extra: Any) -> tuple[Policy, str, tuple[str, ...], StreamContext | None] | None:
    """What a binding for this connector ``extra`` is made of: ``(policy, source, adapter keys, context)``, or
    None when no policy applies. Raises what :func:`binding_for` logs (a bad policy, adapter keys or context)."""
    spec, source = _policy_source(extra)
    if spec is None:
        return None
    keys = _adapter_keys(extra.get(EXTRA_ADAPTER_KEYS) if isinstance(extra, Mapping) else None)
    from omni_accum.integrations.vllm_omni.capture import settings as capture_settings

    capture_settings(extra)  # a bad omni_accum_capture* is named here, not at the first chunk (capture then off)
    return load_policy(spec), source, keys or Settings.adapter_keys, deployment_context(extra)


def connector_extra(obj: Any) -> Any:
    """The deploy YAML connector ``extra`` of an adapter or transport (``connector.config``)."""
    conn = getattr(obj, "connector", None)
    return getattr(conn, "config", None)
