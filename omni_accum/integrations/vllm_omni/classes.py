"""Lazy access to the vllm-omni classes the replay engine uses (serializer, SHM connector,
transport mixin). vllm-omni is imported only when one of them is asked for, and only here (and in
the other ``integrations`` modules): the core never imports it.
"""

from __future__ import annotations

import importlib
from typing import Any

from omni_accum.errors import OmniAccumError

SERIALIZER = ("vllm_omni.distributed.omni_connectors.utils.serialization", "OmniSerializer")
SHM_CONNECTOR = ("vllm_omni.distributed.omni_connectors.connectors.shm_connector", "SharedMemoryConnector")


def _import_module(name: str) -> Any:
    return importlib.import_module(name)


class VllmOmniUnavailable(OmniAccumError):
    """A mode needs vllm-omni (the upstream arm, the serializer or shm wire) and it cannot be imported."""


def vllm_omni_attr(module: str, attr: str, why: str) -> Any:
    """Import ``attr`` from vllm-omni's ``module``; :class:`VllmOmniUnavailable` says why it is needed."""
    try:
        return getattr(_import_module(module), attr)
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken CUDA wheel beside CPU torch
        raise VllmOmniUnavailable(
            f"{why} needs vllm-omni (a supported release), which cannot be imported here ({type(e).__name__}: {e}). "
            "Install it with: pip install 'omni-accum[vllm]', or use --wire inproc without the upstream arm"
        ) from e


def serializer() -> Any:
    """vllm-omni's ``OmniSerializer`` (serialize / deserialize)."""
    return vllm_omni_attr(*SERIALIZER, "the serializer wire / view hop")


def shm_connector() -> Any:
    """vllm-omni's ``SharedMemoryConnector`` class."""
    return vllm_omni_attr(*SHM_CONNECTOR, "the shm wire")


def transport_mixin() -> Any:
    """The class whose ``_accumulate_payload`` is the installed release's own runner merge (the upstream
    arm): ``_OmniConnectorPayloadTransportMixin`` in 0.30, ``OmniConnectorModelRunnerMixin`` in 0.28, the chunk
    transfer adapter in 0.16 (see :mod:`.families`)."""
    from omni_accum.integrations.vllm_omni.families import current

    module, _, name = current().runner_accumulate.partition(":")
    return vllm_omni_attr(module, name, "the upstream arm")
