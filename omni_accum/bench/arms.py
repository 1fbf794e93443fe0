"""Bench arms: what each name given to ``omni-accum bench --arms`` replays.

An arm name is one of:

* ``upstream`` — vllm-omni 0.30.0's own ``_accumulate_payload`` (the baseline);
* a strategy name (``cat``, ``token_list``, ``prealloc``, ``send_once``, ``replace`` or a plugin's):
  the strategy on the workload's keys it applies to (append-kind keys for append strategies,
  replace/static keys otherwise), upstream-equivalent behaviour (the ``default`` preset) elsewhere;
* a policy preset name (``qwen3-omni``) or a policy file: the policy as is;
* ``wire-floor`` — no accumulation: the cost of shipping each delta over the wire (and view hop),
  measured in the same run; the floor every arm is compared with.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from omni_accum.bench.replay import UPSTREAM, WIRE_FLOOR, Arm, VllmOmniUnavailable
from omni_accum.bench.workloads import Workload
from omni_accum.errors import InvalidArgumentError, OmniAccumError
from omni_accum.manager import get_manager
from omni_accum.policy.loader import load_policy, preset_names, probe
from omni_accum.policy.model import Policy


class UnknownArmError(OmniAccumError):
    """An arm name that is not ``upstream``, ``wire-floor``, a strategy, a policy preset nor a policy file
    (a usage error: ``omni-accum bench`` exits 2)."""


def strategy_arm(workload: Workload, strategy: str, params: dict[str, Any] | None = None) -> Policy | None:
    """Policy applying ``strategy`` to the workload's keys it fits, the ``default`` preset elsewhere.

    None when no key of the workload fits the strategy's kinds.
    """
    spec = get_manager().spec(strategy)
    kinds = ("append",) if "append" in spec.kinds else tuple(k for k in ("replace", "static") if k in spec.kinds)
    paths = workload.keys_of_kind(*kinds)
    if not paths:
        return None
    base = load_policy("default")
    rules = [{"match": p, "strategy": strategy, "params": dict(params or {})} for p in paths]
    rules += [r.model_dump() for r in base.rules if r.match not in paths]
    return load_policy(
        {
            "description": f"{strategy} on {', '.join(paths)}; default elsewhere",
            "default": base.default.model_dump(),
            "honor_override_keys": base.honor_override_keys,
            "rules": rules,
        }
    )


def policy_misses_workload(policy: Policy, workload: Workload) -> str | None:
    """What to tell a user whose policy decides none of the workload's keys (no rule matches one, no tuned
    cell names one: every key gets the policy's default, and the arm measures that), or None."""
    paths = [k.path for k in workload.keys]
    if any(policy.match_rule(p) is not None for p in paths):
        return None
    if policy.tuned is not None and any(c.key in paths for c in policy.tuned.cells):
        return None
    shown = ", ".join(paths[:6]) + (f", ... ({len(paths)} keys)" if len(paths) > 6 else "")
    return (
        f"no rule or tuned cell of this policy matches a key of workload {workload.name!r} ({shown}): every key "
        f"gets its default {policy.default.strategy!r}, so this arm measures that strategy, not the policy's choices"
    )


def workload_policy_problem(workload: Workload, source: str | None = None) -> str | None:
    """Why the workload's ``policy`` field names no policy preset nor policy file, or None.

    ``source`` (the ``--workload`` value) is named in the message; default: the workload's name.
    """
    if not workload.policy or workload.policy in preset_names() or probe(workload.policy, "is_file"):
        return None
    where = source if source is not None else f"workload {workload.name!r}"
    return (
        f"{where}: field 'policy': {workload.policy!r} is neither a policy preset "
        f"({', '.join(sorted(preset_names()))}) nor a policy file"
    )


def default_arm_names(workload: Workload, through: str = "direct") -> list[str]:
    """``upstream``; ``cat``, ``token_list`` and ``prealloc`` when a key is append-kind; ``wire-floor`` when a key is
    read as deltas (vllm-omni 0.30.0's stream: its receiving adapter hands each chunk over as it came and
    accumulates nothing, so that is the reference its users compare with); ``send_once`` when one is replace or
    static (``replace`` is upstream's behaviour there already); the workload's ``policy``. ``through`` ``vllm-omni``
    (``bench --through``, which takes policy arms and ``upstream``): no ``wire-floor``."""
    names = [UPSTREAM, "cat", "token_list", "prealloc"] if workload.keys_of_kind("append") else [UPSTREAM]
    if through == "direct" and any(k.read == "delta" for k in workload.keys):
        names.append(WIRE_FLOOR)
    if workload.keys_of_kind("replace", "static"):
        names.append("send_once")
    if workload.policy:
        names.append(workload.policy)
    return names


def arm_policy_files(workload: Workload, names: Sequence[str] | None = None) -> list[str]:
    """The policy files among the arms ``names`` (``None``: :func:`default_arm_names`), as :func:`build_arms`
    reads them: names that are not ``upstream``, ``wire-floor``, a strategy nor a preset, and are files."""
    manager = get_manager()
    presets = set(preset_names())
    names = _arm_names(names, "arm_policy_files") if names is not None else default_arm_names(workload)
    return [
        n
        for n in names
        if n not in (UPSTREAM, WIRE_FLOOR) and manager.get_spec(n) is None and n not in presets and probe(n, "is_file")
    ]


def _arm_names(names: Any, where: str) -> list[str]:
    """``names`` as a list, each a str; one str is refused (it would be read as arms of one character each)."""
    if isinstance(names, str) or not isinstance(names, Sequence):
        split = f" ({[n.strip() for n in names.split(',')]!r:.80}?)" if isinstance(names, str) else ""
        raise InvalidArgumentError(
            f"{where}: names must be a list of arm names, got {type(names).__name__} {names!r:.80}{split}"
        )
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise InvalidArgumentError(f"{where}: every arm name must be a str, got {bad[0]!r:.80} in {list(names)!r:.80}")
    return list(names)


def upstream_available() -> bool:
    try:
        from omni_accum.bench.replay import UpstreamEngine

        UpstreamEngine()
    except VllmOmniUnavailable:
        return False
    return True


def build_arms(
    workload: Workload, names: Sequence[str] | None = None, *, warn: TextIO | None = None, through: str = "direct"
) -> dict[str, Arm]:
    """Arms by name (see the module docstring); ``None`` gives :func:`default_arm_names` (for ``through``).

    ``names`` is a sequence of names (``["upstream", "prealloc"]``); one str (``"upstream,prealloc"``, what
    ``--arms`` also takes) is refused with :class:`~omni_accum.errors.InvalidArgumentError`: split it first.
    With the default names, ``upstream`` is left out (with a note) when vllm-omni cannot be imported;
    named explicitly, it raises :class:`VllmOmniUnavailable`.
    """
    explicit = names is not None
    if not explicit:
        problem = workload_policy_problem(workload)
        if problem:
            raise OmniAccumError(problem)
    names = _arm_names(names, "build_arms") if names is not None else default_arm_names(workload, through)
    manager = get_manager()
    presets = set(preset_names())
    arms: dict[str, Arm] = {}
    seen: set[str] = set()
    for name in names:
        if name in seen:  # one arm per name: its table row and --json record are keyed by it
            if warn is not None:
                print(f"note: arm {name!r} given more than once: measured once", file=warn)
            continue
        seen.add(name)
        if name == WIRE_FLOOR:
            if through != "direct":
                raise UnknownArmError(
                    f"arm {name!r} is not measured through {through}: it is no accumulation code to replay there "
                    "(valid arms there: 'upstream', a strategy, a policy preset or a policy file; wire-floor only "
                    "with --through direct)"
                )
            arms[name] = WIRE_FLOOR
        elif name == UPSTREAM:
            if not explicit and not upstream_available():
                if warn is not None:
                    print("note: vllm-omni is not importable; the upstream arm is left out", file=warn)
                continue
            arms[name] = UPSTREAM
        elif manager.get_spec(name) is not None:
            policy = strategy_arm(workload, name)
            if policy is None:
                if warn is not None:
                    print(f"note: arm {name!r} skipped: no key of workload {workload.name!r} fits it", file=warn)
                continue
            arms[name] = policy
        elif name in presets or probe(name, "is_file"):
            arms[name] = load_policy(name)
            unmatched = policy_misses_workload(arms[name], workload)
            if unmatched and warn is not None:
                print(f"note: arm {name!r}: {unmatched}", file=warn)
        elif Path(name).suffix.lower() in (".yaml", ".yml", ".json", ".toml") or "/" in name:
            what = "is a directory" if probe(name, "is_dir") else "no such file"
            raise UnknownArmError(f"arm {name!r}: a policy file? {what} (from {Path.cwd()})")
        else:
            raise UnknownArmError(
                f"unknown arm {name!r}: not 'upstream', 'wire-floor', a strategy ({', '.join(manager.names())}), "
                f"a policy preset ({', '.join(sorted(presets))}) nor a policy file"
            )
    if not arms:
        raise OmniAccumError("no arm to run")
    return arms
