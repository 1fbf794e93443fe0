"""Registers :class:`.arena_connector.ArenaConnector` with vllm-omni's ``OmniConnectorFactory`` as
``OmniAccumArenaConnector``.

Entry point ``omni_accum_arena`` in vllm-omni's ``vllm_omni.general_plugins`` group and vLLM's
``vllm.general_plugins`` group (vllm-omni 0.30.0's stage engine-core processes, which build the
connectors of the chunk transfer adapter, load only the latter), independently of whether an
omni-accum policy is installed; registering also extends vllm-omni 0.30.0's abort clean-up of a
``SharedMemoryConnector``'s chunks to the arena connector (:mod:`.arena_abort`). ``OMNI_ACCUM_ARENA_CONNECTOR=0``
turns both off. With ``VLLM_PLUGINS``
set, list ``omni_accum_arena`` in it too.
"""

from __future__ import annotations

import logging
import sys

from omni_accum.switches import SettingError, env_flag

logger = logging.getLogger("omni_accum.vllm_omni")

ENV_SWITCH = "OMNI_ACCUM_ARENA_CONNECTOR"


def register() -> bool:
    """Register ``OmniAccumArenaConnector`` with ``OmniConnectorFactory`` (once); True when it is registered."""
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory  # noqa: PLC0415

    from omni_accum.integrations.vllm_omni import arena_abort  # noqa: PLC0415
    from omni_accum.integrations.vllm_omni.arena_connector import NAME, ArenaConnector  # noqa: PLC0415

    if NAME not in OmniConnectorFactory.list_registered_connectors():
        OmniConnectorFactory.register_connector(NAME, ArenaConnector)
    arena_abort.install()  # an aborted request's inner chunks unlinked at the abort, where the adapter has that
    return True


def activate() -> None:
    """Entry point ``omni_accum_arena`` of ``vllm_omni.general_plugins``: register unless switched off; never raises."""
    try:
        if not env_flag(ENV_SWITCH, True):
            return
    except SettingError as e:  # neither on nor off: do nothing rather than guess
        logger.error("omni-accum: %s; not applied", e)
        return
    try:
        register()
    except Exception as e:  # noqa: BLE001 - a plugin never fails vllm-omni
        logger.error("omni-accum: could not register OmniAccumArenaConnector: %s", e)


def activate_from_vllm() -> None:
    """Entry point in vLLM's group: only in a vllm-omni process (``vllm_omni`` imported)."""
    if "vllm_omni" in sys.modules:
        activate()
