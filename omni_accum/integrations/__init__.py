"""Integrations with serving engines.

``omni_accum.integrations.vllm_omni`` installs omni-accum into vllm-omni 0.30.0 (it is the only
module that imports vllm / vllm_omni; import it only where vllm-omni is installed).
"""
