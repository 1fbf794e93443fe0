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


_INT = re.compile(r"\s*(\d+)\s*([kK]?)\s*", re.ASCII)  # ASCII digits only, as every size setting takes them


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
            f"{where}={value!r}: expected the deployment's {what} as a whole number >= 1 "
            + ("(such as 8000 or 8k)" if "context" in what else "(such as 4)")
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
    got: list[int | None] = []
    bad: list[str] = []
    for key, env, what in (
        (EXTRA_CONTEXT_LEN, ENV_CONTEXT_LEN, "context length (prompt tokens)"),
        (EXTRA_CONCURRENCY, ENV_CONCURRENCY, "concurrency (requests at once)"),
    ):
        try:
            got.append(_context_setting(extra, key, env, what))
        except ContextSettingError as e:  # both are named, not only the first
            bad.append(str(e))
    if bad:
        raise ContextSettingError("; ".join(bad))
    context_len, concurrency = got
    if context_len is None and concurrency is None:
        return None
    return StreamContext(context_len=context_len, concurrency=concurrency or 1)


def _warn_untuned_context(policy: Policy, context: StreamContext | None, source: str) -> None:
    global _warned_no_context
    if context is not None or policy.tuned is None or _warned_no_context:
        return
    _warned_no_context = True
    c_edge, k_edge, _ = policy.tuned.bucket(DEFAULT_CONTEXT)
    logger.info(
        "omni-accum: the policy from %s has a tuned table and no deployment context is set: a sending stage "
        "with omni-accum decides each request's bucket from its first chunk, and the receiving stage follows; "
        "a request that arrives without that decision (a sender without omni-accum, the full-payload "
        "accumulator) resolves in the table's first bucket (context_len>=%s, concurrency>=%s). Setting %s and "
        "%s (or %s / %s in the connector extra) fixes one bucket for every request instead, the same on every stage",
        source,
        c_edge,
        k_edge,
        ENV_CONTEXT_LEN,
        ENV_CONCURRENCY,
        EXTRA_CONTEXT_LEN,
        EXTRA_CONCURRENCY,
    )


def ab_shares(policy: Policy) -> dict[str, tuple[str, float]]:
    """``{arm: (its policy, its share of the requests)}`` of a policy with an ``ab`` section."""
    total = sum(a.weight for a in policy.ab.arms.values())
    return {n: (a.policy, a.weight / total) for n, a in policy.ab.arms.items()}


def policy_summary(policy: Policy | None) -> str:
    """The per-key choices of ``policy`` in a few words, for the activation log line: its default, its
    rules (``match -> strategy``) and the size of its tuned table."""
    if policy is None:
        return "no policy"
    if policy.ab is not None:  # its own default and rules are its first arm's
        return "an A/B split by request id: " + ", ".join(f"{n} {s:.0%} {p}" for n, (p, s) in ab_shares(policy).items())
    rules = ", ".join(f"{r.match} -> {r.strategy}" for r in policy.rules) or "none"
    text = f"default {policy.default.strategy}, rules {rules}"
    if policy.tuned is not None:
        t = policy.tuned
        text += f", tuned table of {len(t.context_len_edges)}x{len(t.concurrency_edges)} buckets ({len(t.cells)} cells"
        partial = ", PARTIAL: requests in a bucket it has no cell for get the rules and default"
        text += (partial if not t.complete else "") + ")"
    return text


def context_label(policy: Policy | None, context: StreamContext | None, extra: Any = None) -> str:
    """Where a binding's tuned bucket comes from, for the log lines: the deployment context (and the
    settings that gave it: the connector ``extra``'s keys, else the environment), the sender's decision
    per request, or nothing (no tuned table)."""
    if context is not None:
        where = context_where(extra) or "settings"
        if context.context_len is None:  # only the concurrency set: the sender measures each request's prompt
            return (f"context length per request (the sending stage measures each prompt), concurrency "
                    f"{context.concurrency} for every request from {where}")
        unset = "" if concurrency_given(extra) else " (no concurrency set: 1)"
        return f"deployment context {context.context_len} tokens x {context.concurrency}{unset} from {where}"
    if policy is None or policy.tuned is None:
        return "context unused (no tuned table)"
    return "context per request (the sending stage decides each request's bucket)"


def env_context_source() -> str:
    """The environment variables that set a deployment context, as ``NAME=value`` (empty: none)."""
    return ", ".join(f"{v}={os.environ[v].strip()}" for v in (ENV_CONTEXT_LEN, ENV_CONCURRENCY) if os.environ.get(v))


def concurrency_given(extra: Any) -> bool:
    """Whether the deployment's concurrency is set (the connector extra's key, else the environment variable): a
    context length set alone takes concurrency 1."""
    if isinstance(extra, Mapping) and extra.get(EXTRA_CONCURRENCY) is not None:
        return True
    return bool(os.environ.get(ENV_CONCURRENCY, "").strip())


def context_where(extra: Any) -> str:
    """Which settings gave a binding's deployment context, each value its own (the connector extra's key wins over
    the environment variable): ``the connector extra`` when both are its, else each named."""
    said, keys = [], 0
    for key, env in ((EXTRA_CONTEXT_LEN, ENV_CONTEXT_LEN), (EXTRA_CONCURRENCY, ENV_CONCURRENCY)):
        if isinstance(extra, Mapping) and extra.get(key) is not None:
            said.append(f"the connector extra's {key}={extra[key]!r}")
            keys += 1
        elif os.environ.get(env, "").strip():
            said.append(f"{env}={os.environ[env].strip()}")
    return "the connector extra" if keys == 2 else ", ".join(said)
