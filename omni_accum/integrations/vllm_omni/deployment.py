"""The deployment context a binding's strategy selection sees (tuned tables): one per binding.

``omni_accum_context_len`` / ``omni_accum_concurrency`` in the connector ``extra`` win over
``OMNI_ACCUM_CONTEXT_LEN`` / ``OMNI_ACCUM_CONCURRENCY``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from omni_accum.context import DEFAULT_CONTEXT, StreamContext
from omni_accum.errors import OmniAccumError
from omni_accum.policy import Policy

logger = logging.getLogger("omni_accum.vllm_omni")

EXTRA_CONTEXT_LEN = "omni_accum_context_len"
EXTRA_CONCURRENCY = "omni_accum_concurrency"
ENV_CONTEXT_LEN = "OMNI_ACCUM_CONTEXT_LEN"
ENV_CONCURRENCY = "OMNI_ACCUM_CONCURRENCY"
_warned_no_context = False


def reset_warning() -> None:
    """Warn again about a tuned table without a context (uninstall)."""
    global _warned_no_context
    _warned_no_context = False


class ContextSettingError(OmniAccumError, ValueError):
    """``OMNI_ACCUM_CONTEXT_LEN`` / ``OMNI_ACCUM_CONCURRENCY`` (or their connector extra keys) hold an invalid value."""


_INT = re.compile(r"\s*(\d+)\s*([kK]?)\s*")


def _context_setting(extra: Any, key: str, env: str, what: str) -> int | None:
    if isinstance(extra, Mapping) and extra.get(key) is not None:
        value, where = extra[key], f"connector extra {key}"
    else:
        value, where = os.environ.get(env, ""), f"environment variable {env}"
        if not value.strip():
            return None
    n: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and (m := _INT.fullmatch(value)):
        n = int(m.group(1)) * (1000 if m.group(2) else 1)
    if n is None or n < 1:
        raise ContextSettingError(
            f"{where}={value!r}: expected the deployment's {what} as a whole number >= 1 (such as 8000 or 8k)"
        )
    return n


def deployment_context(extra: Any = None) -> StreamContext | None:
    """The stream context every binding of this process uses for strategy selection (tuned tables).

    ``omni_accum_context_len`` / ``omni_accum_concurrency`` in the connector ``extra``, else
    ``OMNI_ACCUM_CONTEXT_LEN`` / ``OMNI_ACCUM_CONCURRENCY``: the typical prompt length (tokens) and
    the number of requests streaming at once. Read once per binding, never per request: a sender and
    its receiver must select the same strategy for keys whose strategy has an encoder, so give every
    stage the same values. None when neither is set.

    Raises:
        ContextSettingError: a value that is not a whole number >= 1 (names the variable and value).
    """
    context_len = _context_setting(extra, EXTRA_CONTEXT_LEN, ENV_CONTEXT_LEN, "context length (prompt tokens)")
    concurrency = _context_setting(extra, EXTRA_CONCURRENCY, ENV_CONCURRENCY, "concurrency (requests at once)")
    if context_len is None and concurrency is None:
        return None
    return StreamContext(context_len=context_len, concurrency=concurrency or 1)


def _warn_untuned_context(policy: Policy, context: StreamContext | None, source: str) -> None:
    global _warned_no_context
    if context is not None or policy.tuned is None or _warned_no_context:
        return
    _warned_no_context = True
    c_edge, k_edge, _ = policy.tuned.bucket(DEFAULT_CONTEXT)
    logger.warning(
        "omni-accum: the policy from %s has a tuned table, but no deployment context is set: inside vllm-omni "
        "every stream resolves in the table's first bucket (context_len>=%s, concurrency>=%s). Set %s and %s "
        "(or %s / %s in the connector extra) to the deployment's typical prompt length and concurrency, the "
        "same on every stage",
        source,
        c_edge,
        k_edge,
        ENV_CONTEXT_LEN,
        ENV_CONCURRENCY,
        EXTRA_CONTEXT_LEN,
        EXTRA_CONCURRENCY,
    )
