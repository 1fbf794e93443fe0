"""One compatibility step between vllm-omni 0.30.0's ``MooncakeStoreConnector`` and Mooncake 0.3.13.post1.

vllm-omni 0.30.0 builds its replication config with ``ReplicateConfig().with_soft_pin = True``.
Mooncake 0.3.13 replaced that boolean with ``soft_pin_action`` (``SoftPinAction.PRESERVE`` /
``ENABLE`` / ``DISABLE``), so constructing the connector fails with ``AttributeError`` and no stage
can use the store. The only Mooncake builds that still have the attribute (0.3.12.post1 and older)
link ``libcudart.so.12`` even in their "non-CUDA" wheel, so they do not load on a CPU-only machine;
``omni-accum[mooncake]`` therefore pins ``mooncake-transfer-engine-non-cuda==0.3.13.post1`` and this
module gives its ``ReplicateConfig`` class back a ``with_soft_pin`` property:

* set ``True`` -> ``soft_pin_action = ENABLE``; set ``False`` -> ``DISABLE``;
* read -> ``soft_pin_action == ENABLE``.

A second gap stops the chunk transfer adapter even with that fixed: the adapter reads
``self.connector.stage_id`` (its put and get keys, and whether it receives at all), which only
``SharedMemoryConnector`` sets; vllm-omni 0.30.0's ``MooncakeStoreConnector`` keeps ``stage_id`` in its
``config`` (the adapter's ``resolve_connector_spec`` puts it there) but has no such attribute, so every
send and every receive raises ``AttributeError``. :func:`apply` also gives ``MooncakeStoreConnector`` a
``stage_id`` property reading ``config["stage_id"]`` (-1 when absent, as ``SharedMemoryConnector``).

Nothing else is touched (no vllm-omni method, no other Mooncake attribute). A Mooncake that already
has ``with_soft_pin`` (older, or a future release that brings it back) is left alone, and so is one
that has neither attribute (the connector then fails as it would without omni-accum).

The same entry point registers ``OmniAccumMooncakeConnector`` (:mod:`.mooncake_connector`: 0.30.0's connector
with a tensor fast path over the store's registered buffers) with vllm-omni's ``OmniConnectorFactory``.

It is applied by its own plugin entry point ``omni_accum_mooncake`` in vllm-omni's
``vllm_omni.general_plugins`` group and vLLM's ``vllm.general_plugins`` group (the stage engine-core
processes load only the latter, see :func:`omni_accum.integrations.vllm_omni.activate_from_vllm`),
independently of whether omni-accum itself is installed: ``OMNI_ACCUM_VLLM_OMNI=0`` (upstream code
only) still gets a working connector. ``OMNI_ACCUM_MOONCAKE_COMPAT=0`` turns this step off. With
``VLLM_PLUGINS`` set, list ``omni_accum_mooncake`` in it too.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from omni_accum.switches import SettingError, env_flag

logger = logging.getLogger("omni_accum.vllm_omni")

#: ``OMNI_ACCUM_MOONCAKE_COMPAT=0`` turns the compatibility step off.
ENV_SWITCH = "OMNI_ACCUM_MOONCAKE_COMPAT"


def _store_module() -> Any:
    try:
        import mooncake.store as store  # noqa: PLC0415 - optional dependency, imported on demand
    except Exception:  # noqa: BLE001 - not installed, or a build that does not load here
        return None
    return store


def needed() -> bool:
    """True when the installed Mooncake's ``ReplicateConfig`` lacks ``with_soft_pin`` but has ``soft_pin_action``
    (and this module has not supplied it)."""
    store = _store_module()
    if store is None:
        return False
    cls = store.ReplicateConfig
    return not hasattr(cls, "with_soft_pin") and hasattr(cls, "soft_pin_action")


def is_applied() -> bool:
    store = _store_module()
    return store is not None and isinstance(store.ReplicateConfig.__dict__.get("with_soft_pin"), _CompatProperty)


def _connector_class() -> Any:
    try:
        from vllm_omni.distributed.omni_connectors.connectors.mooncake_store_connector import (  # noqa: PLC0415
            MooncakeStoreConnector,
        )
    except Exception:  # noqa: BLE001 - no vllm-omni here
        return None
    return MooncakeStoreConnector


def stage_id_needed() -> bool:
    """True when vllm-omni's ``MooncakeStoreConnector`` has no ``stage_id`` (0.30.0) and none was added."""
    cls = _connector_class()
    return cls is not None and not hasattr(cls, "stage_id")


def apply_stage_id() -> bool:
    """Give ``MooncakeStoreConnector`` a ``stage_id`` property (``config["stage_id"]``) when it has none."""
    cls = _connector_class()
    if cls is None:
        return False
    if hasattr(cls, "stage_id"):
        return True

    def _get(self: Any) -> int:
        return (getattr(self, "config", None) or {}).get("stage_id", -1)

    def _set(self: Any, value: int) -> None:
        self.config["stage_id"] = value

    setattr(cls, "stage_id", _CompatProperty(_get, _set, doc="the connector config's stage_id (added by omni-accum)"))
    return True


def apply() -> bool:
    """Add both properties where missing; True when the installed Mooncake now has ``with_soft_pin``."""
    apply_stage_id()
    return apply_soft_pin()


def apply_soft_pin() -> bool:
    """Add the ``with_soft_pin`` property when :func:`needed`; True when the installed Mooncake now has it."""
    store = _store_module()
    if store is None:
        return False
    cls = store.ReplicateConfig
    if hasattr(cls, "with_soft_pin"):
        return True
    if not hasattr(cls, "soft_pin_action") or not hasattr(store, "SoftPinAction"):
        logger.warning("omni-accum: Mooncake's ReplicateConfig has neither with_soft_pin nor soft_pin_action")
        return False
    action = store.SoftPinAction

    def _get(self: Any) -> bool:
        return self.soft_pin_action == action.ENABLE

    def _set(self: Any, value: bool) -> None:
        self.soft_pin_action = action.ENABLE if value else action.DISABLE

    setattr(cls, "with_soft_pin", _CompatProperty(_get, _set, doc="vllm-omni 0.30.0's name for soft_pin_action"))
    return True


class _CompatProperty(property):
    """The property this module adds (so :func:`remove` only ever removes its own)."""


def remove() -> None:
    """Take both properties away again (tests); attributes Mooncake or vllm-omni have themselves are never removed."""
    store = _store_module()
    if store is not None and is_applied():
        delattr(store.ReplicateConfig, "with_soft_pin")
    cls = _connector_class()
    if cls is not None and isinstance(cls.__dict__.get("stage_id"), _CompatProperty):
        delattr(cls, "stage_id")


def activate() -> None:
    """Entry point ``omni_accum_mooncake`` (both plugin groups): apply unless switched off; never raises."""
    try:
        if not env_flag(ENV_SWITCH, True):
            return
    except SettingError as e:  # neither on nor off: do nothing rather than guess
        logger.error("omni-accum: %s; not applied", e)
        return
    try:
        steps = [
            name
            for name, todo in (
                ("ReplicateConfig.with_soft_pin", needed()),
                ("MooncakeStoreConnector.stage_id", stage_id_needed()),
            )
            if todo
        ]
        if steps:
            apply()
            logger.info(
                "omni-accum: Mooncake compatibility for vllm-omni 0.30.0: %s (pid=%d)", ", ".join(steps), os.getpid()
            )
    except Exception as e:  # noqa: BLE001 - a plugin never fails vllm-omni
        logger.error("omni-accum: Mooncake compatibility step failed: %s", e)
    try:
        register_connector()
    except Exception as e:  # noqa: BLE001 - a plugin never fails vllm-omni
        logger.error("omni-accum: could not register OmniAccumMooncakeConnector: %s", e)


def register_connector() -> bool:
    """Register ``OmniAccumMooncakeConnector`` with ``OmniConnectorFactory`` (once); True when it is registered."""
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory  # noqa: PLC0415

    from omni_accum.integrations.vllm_omni import mooncake_connector  # noqa: PLC0415
    from omni_accum.integrations.vllm_omni.mooncake_connector import NAME, MooncakeFastConnector  # noqa: PLC0415

    mooncake_connector._prepare, mooncake_connector._inner_class = apply, _connector_class
    if NAME not in OmniConnectorFactory.list_registered_connectors():
        OmniConnectorFactory.register_connector(NAME, MooncakeFastConnector)
    return True


def activate_from_vllm() -> None:
    """Entry point in vLLM's group: only in a vllm-omni process (``vllm_omni`` imported), as omni-accum's own."""
    if "vllm_omni" in sys.modules:
        activate()
