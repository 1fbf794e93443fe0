"""The wrapped-method table of the installed vllm-omni release family, and the all-or-nothing
patching that checks it first.

The tables themselves live in :mod:`.families` (one module per release family). ``TARGETS``,
``PROBES`` and ``SUPPORTED_VERSION`` are those of the installed release's family (read when asked
for; the newest family's when the installed vllm-omni is unsupported or absent);
``SUPPORTED_VERSIONS`` lists every supported release.
"""

from __future__ import annotations

import inspect
from typing import Any

from omni_accum.integrations.vllm_omni import families
from omni_accum.integrations.vllm_omni.families import SUPPORTED_VERSIONS, installed_versions
from omni_accum.integrations.vllm_omni.families.base import (
    Family,
    InstallRefused,
    ProbeHook,
    Target,
    _resolve,
    signature_shape,
    wrap_probe,
)

# Also ``TARGETS``, ``PROBES`` and ``SUPPORTED_VERSION`` (module ``__getattr__``, read when asked for).
__all__ = [
    "SUPPORTED_VERSIONS",
    "InstallRefused",
    "ProbeHook",
    "Target",
    "_patch",
    "_patched",
    "_resolve",
    "active_family",
    "check_signatures",
    "installed_versions",
    "signature_shape",
    "wrap_probe",
]

_patched: dict[tuple[str, str], tuple[type, Any]] = {}  # (owner, name) -> (class, original raw attribute)
#: The family whose methods are patched (None while nothing is).
_active: list[Family] = []


def active_family() -> Family | None:
    """The family omni-accum patched in this process (None while nothing is patched)."""
    return _active[0] if _active and _patched else None


def __getattr__(name: str) -> Any:  # PEP 562: the installed family's table, read when asked for
    if name == "TARGETS":
        return (active_family() or families.current()).targets
    if name == "PROBES":
        return (active_family() or families.current()).probes
    if name == "SUPPORTED_VERSION":
        return (active_family() or families.current()).version
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_signatures(targets: tuple[Target, ...] | None = None) -> list[str]:
    """Every mismatch between the installed vllm-omni and its family's methods (``targets``: only
    those), one message per method; an unsupported or missing vllm-omni is one message (empty: OK)."""
    version = families.installed_version()
    fam = active_family() or families.family_for(version)
    if fam is None:
        return [families.unsupported_message(version)]
    return families.probe(fam, targets, patched=_patched)


def _patch(kind: str) -> Family:
    """Select the installed family (version, then a probe of every method it wraps), then patch its
    ``targets`` or ``probes`` (``kind``) not yet patched; all or nothing. Returns the family."""
    fam = active_family() or families.select(patched=_patched)
    if active_family() is not None:
        problems = families.probe(fam, patched=_patched)
        if problems:
            raise InstallRefused(
                f"vllm-omni {fam.version} (family {fam.name}) changed under omni-accum; nothing more was "
                "patched:\n  " + "\n  ".join(problems)
            )
    todo = [(t, _resolve(t.owner)) for t in getattr(fam, kind) if (t.owner, t.name) not in _patched]
    for t, cls in todo:
        raw = inspect.getattr_static(cls, t.name)
        func = raw.__func__ if isinstance(raw, staticmethod) else raw
        wrapped = t.wrap(func)
        wrapped.__omni_accum_original__ = func  # type: ignore[attr-defined]
        _patched[(t.owner, t.name)] = (cls, raw)
        setattr(cls, t.name, staticmethod(wrapped) if t.static else wrapped)
    _active[:] = [fam]
    return fam
