"""vllm-omni release families: which releases omni-accum supports, and what it wraps in each.

A family (:class:`~.base.Family`) is a set of releases whose wrapped methods have the same places
and signatures: :mod:`.v030` (0.30.0), :mod:`.v028` (0.28.0) and :mod:`.v016` (0.16.0). Everything that differs per
release lives in the family's module (the wrapped-method table with its signatures, the runner
receive hooks, the decode-span rule); :mod:`.v016` (0.16.0) wraps the adapter's whole-payload merge; the wrappers themselves (:mod:`..send`, :mod:`..receive`,
:mod:`..runner`, :mod:`..full_payload`) are shared.

:func:`select` picks the family at activation: from the installed vllm-omni version, then a
signature probe of every method of that family. An unknown release, or a known one whose
methods differ, is refused (:class:`~.base.InstallRefused`) before anything is patched.
"""

from __future__ import annotations

import inspect

from omni_accum.integrations.vllm_omni.families import v016, v028, v030
from omni_accum.integrations.vllm_omni.families.base import (
    Family,
    InstallRefused,
    Target,
    _release,
    _resolve,
    signature_shape,
)
from omni_accum.policy.fingerprint import dist_version

#: Every supported family, oldest first.
FAMILIES: tuple[Family, ...] = (v016.FAMILY, v028.FAMILY, v030.FAMILY)
#: Every supported vllm-omni release, oldest first.
SUPPORTED_VERSIONS: tuple[str, ...] = tuple(v for f in FAMILIES for v in f.versions)
#: The family used where no vllm-omni is installed (or an unsupported one), to say what would be wrapped.
NEWEST: Family = FAMILIES[-1]


def installed_version(dist: str = "vllm-omni") -> str | None:
    """The installed version of ``dist`` (None: not installed)."""
    return dist_version(dist)


def installed_versions() -> str:
    """``vllm-omni 0.30.0, vllm 0.30.0`` (``(not installed)`` for a missing one)."""
    return ", ".join(f"{d} {installed_version(d) or '(not installed)'}" for d in ("vllm-omni", "vllm"))


def family_for(version: str | None) -> Family | None:
    """The family that covers ``version`` (None: an unsupported release, or none)."""
    for fam in FAMILIES:
        if fam.covers(version):
            return fam
    return None


def by_name(name: str) -> Family:
    """A family by name (``"0.28"``) or release (``"0.28.0"``)."""
    for fam in FAMILIES:
        if name == fam.name or _release(name) in fam.versions:
            return fam
    raise KeyError(f"no vllm-omni release family {name!r}; supported: {', '.join(SUPPORTED_VERSIONS)}")


def current() -> Family:
    """The installed release's family, by version alone (no probe): the newest family when the
    installed release is unsupported or absent (what :func:`select` would check against)."""
    return family_for(installed_version()) or NEWEST


def probe(family: Family, targets: tuple[Target, ...] | None = None, patched: object = ()) -> list[str]:
    """Every mismatch between the installed vllm-omni and ``family``'s methods, one message per method.

    ``patched``: ``(owner, name)`` pairs already wrapped by omni-accum (their originals were checked
    when they were patched).
    """
    problems = []
    for t in family.targets + family.probes + family.relies_on if targets is None else targets:
        try:
            cls = _resolve(t.owner)
            raw = inspect.getattr_static(cls, t.name)
        except Exception as e:  # noqa: BLE001 - missing module, class or method
            problems.append(f"{t.label}: not found ({type(e).__name__}: {e})")
            continue
        if (t.owner, t.name) in patched:  # type: ignore[operator]
            continue
        if t.name not in vars(cls):  # inherited: the release defines it elsewhere (another family's layout)
            problems.append(
                f"{t.label}: not defined by {cls.__name__} itself (vllm-omni {family.version} defines it there)"
            )
            continue
        if t.static != isinstance(raw, staticmethod):
            problems.append(f"{t.label}: expected {'a' if t.static else 'no'} staticmethod")
            continue
        shape = signature_shape(raw.__func__ if isinstance(raw, staticmethod) else raw)
        if shape != t.signature:
            problems.append(f"{t.label}: signature is {shape}, vllm-omni {family.version} has {t.signature}")
    return problems


def unsupported_message(version: str | None) -> str:
    supported = ", ".join(SUPPORTED_VERSIONS)
    if version is None:
        return f"vllm-omni is not installed; omni-accum supports vllm-omni {supported}"
    return (
        f"vllm-omni {version} is not a supported release (installed: {installed_versions()}); omni-accum "
        f"supports vllm-omni {supported}. Refusing to install, nothing was patched"
    )


def select(patched: object = ()) -> Family:
    """The family to install: the installed version's, confirmed by a probe of every method it wraps.

    Raises:
        InstallRefused: vllm-omni is missing or an unsupported release (naming it and the supported
            ones), or a wrapped method of its family is missing or has another signature (naming each).
    """
    version = installed_version()
    fam = family_for(version)
    if fam is None:
        raise InstallRefused(unsupported_message(version))
    problems = probe(fam, patched=patched)
    if problems:
        raise InstallRefused(
            f"omni-accum supports vllm-omni {', '.join(SUPPORTED_VERSIONS)}; installed: {installed_versions()} "
            f"(family {fam.name}, expects vllm-omni {fam.version}). Refusing to install, nothing was patched:\n  "
            + "\n  ".join(problems)
        )
    return fam


__all__ = [
    "FAMILIES",
    "Family",
    "InstallRefused",
    "NEWEST",
    "SUPPORTED_VERSIONS",
    "Target",
    "by_name",
    "current",
    "family_for",
    "installed_version",
    "installed_versions",
    "probe",
    "select",
    "unsupported_message",
]
