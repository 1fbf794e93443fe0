"""``omni-accum doctor``'s checks of the connectors a deploy YAML selects: each one registered (by vllm-omni or by
omni-accum's plugins), and omni-accum's own loaded in the stage processes (entry points, switches, ``VLLM_PLUGINS``)."""

from __future__ import annotations

import os
from importlib import metadata
from typing import Any

from omni_accum.cli.doctor_policy import Check, _read_deploy
from omni_accum.errors import OmniAccumError, close_matches
from omni_accum.switches import SettingError, env_flag

#: The entry-point groups vLLM and vllm-omni load general plugins from (each stage process loads both).
PLUGIN_GROUPS = ("vllm_omni.general_plugins", "vllm.general_plugins")


#: omni-accum's connectors: (the name a deploy selects, the entry point that registers it, its on/off switch, label).
OUR_CONNECTORS = (
    ("OmniAccumArenaConnector", "omni_accum_arena", "OMNI_ACCUM_ARENA_CONNECTOR", "arena connector"),
    ("OmniAccumMooncakeConnector", "omni_accum_mooncake", "OMNI_ACCUM_MOONCAKE_COMPAT", "mooncake connector"),
    # vllm-omni 0.30.0's own: it fails with Mooncake 0.3.13 without the compatibility plugin (docs/mooncake.md)
    ("MooncakeStoreConnector", "omni_accum_mooncake", "OMNI_ACCUM_MOONCAKE_COMPAT", "mooncake compatibility"),
)


def _connector_names(node: Any, parent: str = "") -> list[str]:
    """The ``name`` of every connector a parsed deploy YAML selects (a mapping with a ``name`` and an ``extra``, or
    a ``name`` under a key about connectors), in order."""
    out: list[str] = []
    if isinstance(node, dict):
        name = node.get("name")
        if isinstance(name, str) and ("extra" in node or "connector" in parent.lower()):
            out.append(name)
        for k, v in node.items():
            out += _connector_names(v, str(k))
    elif isinstance(node, list):
        for v in node:
            out += _connector_names(v, parent)
    return out


def _known_connectors() -> list[str] | None:
    """The connectors vllm-omni registers itself (None: its factory cannot be read here)."""
    try:
        from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

        return list(OmniConnectorFactory.list_registered_connectors())
    except Exception:  # noqa: BLE001 - another release or no vllm-omni: check_versions says so
        return None


def check_arena_connector(deploy: str | None) -> list[Check]:
    """Every connector the deploy YAML selects (its parsed ``name`` values): one vllm-omni or omni-accum registers
    (a misspelt one fails the stage with "Unknown connector"), and for omni-accum's (``OmniAccumArenaConnector``,
    ``OmniAccumMooncakeConnector``) and for ``MooncakeStoreConnector`` (which needs omni-accum's compatibility
    plugin): the registering entry point is installed in both plugin groups, its switch (``OMNI_ACCUM_ARENA_CONNECTOR``
    / ``OMNI_ACCUM_MOONCAKE_COMPAT``) is not off and ``VLLM_PLUGINS`` (if set) lets vLLM load it."""
    if not deploy:
        return []
    try:
        names = list(dict.fromkeys(_connector_names(_read_deploy(deploy))))
    except OmniAccumError:
        return []  # check_policy already reported it
    out: list[Check] = []
    known = _known_connectors()
    ours = [c[0] for c in OUR_CONNECTORS]
    registered = [n for n in ours if n.startswith("OmniAccum")]  # omni-accum's own; the rest are vllm-omni's
    if known is not None:
        for name in names:
            if name not in known and name not in ours:
                close = close_matches(name, [*known, *registered])
                hint = f" (did you mean {close[0]}?)" if close else ""
                detail = f"{deploy} selects connector {name!r}, which no plugin registers{hint}: vllm-omni fails with "
                detail += "'Unknown connector' when the stage builds it"
                out.append(Check("connector", False, detail, "one of: " + ", ".join([*known, *registered])))
    allowed = os.environ.get("VLLM_PLUGINS")
    for name, entry, switch, label in OUR_CONNECTORS:
        if name not in names:
            continue
        missing = [g for g in PLUGIN_GROUPS if not any(e.name == entry for e in metadata.entry_points(group=g))]
        try:
            on = env_flag(switch, True)
        except SettingError as e:
            on, bad = False, str(e)
        else:
            bad = f"{switch}={os.environ.get(switch)!r} turns off the plugin that "
            bad += "registers it" if name in registered else "makes it work with Mooncake 0.3.13"
        if missing:
            detail = f"{deploy} selects {name} but entry point {entry} is not in {missing[0]}"
            out.append(Check(label, False, detail, "reinstall omni-accum (pip install omni-accum)"))
        elif not on:
            out.append(Check(label, False, f"{deploy} selects {name} but {bad}", f"unset {switch}"))
        elif allowed is not None and entry not in [p.strip() for p in allowed.split(",")]:
            detail = (f"{deploy} selects {name} but VLLM_PLUGINS={allowed!r} does not list {entry}: vllm-omni will not "
                      "load it")  # fmt: skip
            out.append(Check(label, False, detail, f"add {entry} to VLLM_PLUGINS"))
        else:
            detail = f"{deploy} selects {name}; {entry} " + (
                "registers it" if name in registered else "is loaded (Mooncake 0.3.13 compatibility)")
            if name == "OmniAccumArenaConnector" and known is not None:
                from omni_accum.integrations.vllm_omni.arena_abort import when_unlinked

                detail += "; " + when_unlinked()
            out.append(Check(label, True, detail))
    return out


def _selected(deploy: str | None) -> list[str]:
    """The connectors the deploy YAML selects ([] without one, or when it cannot be read: check_policy says so)."""
    try:
        return _connector_names(_read_deploy(deploy)) if deploy else []
    except OmniAccumError:
        return []
