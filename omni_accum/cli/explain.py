"""``omni-accum explain``: which strategy and params a key gets under a policy, and why.

Also the helpers ``explain`` and ``show`` share: a POLICY argument that does not load is a usage error (exit 2),
with, under ``--json``, a JSON record of the errors on stdout (not nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

from omni_accum.bench.workloads import MAX_ROWS
from omni_accum.cli.args import int_value, positive_int
from omni_accum.context import KeyMeta, StreamContext
from omni_accum.errors import OmniAccumError, PolicyError, close_matches
from omni_accum.manager import StrategyManager, get_manager
from omni_accum.policy.environment import table_mismatches
from omni_accum.policy.loader import build_policy, load_policy, parse_text, read_policy_argument
from omni_accum.policy.model import PROTOCOL_REPLACE_KEYS, Policy, is_glob

VALUE_TYPES = ("tensor", "list", "other")


def _out(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _json(data: Any) -> None:
    _out(json.dumps(data, indent=2, sort_keys=False))


def _label(name: str) -> str:
    """How ``--json`` names the POLICY argument: ``-`` is ``<stdin>``, as ``show`` and ``validate`` name it."""
    return "<stdin>" if name == "-" else name


def _policy_argument(command: str, name: str, manager: StrategyManager, as_json: bool = False) -> Policy | None:
    """The POLICY argument of ``explain`` / ``show``; one that does not load is a usage error (exit 2), as a bad
    ``--base`` or ``--workload`` is (``validate`` is the command whose verdict on a policy is its exit status).
    With ``--json`` the errors also go to stdout as ``{"policy", "valid": false, "errors": [...]}`` (it printed
    nothing there, and a script reading it found no JSON)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if name == "-":  # stdin, as validate reads it (a policy's text, never a file's name)
                label, text, fmt = read_policy_argument(name)
                return build_policy(parse_text(text, fmt, label), label, text, manager)
            return load_policy(name, manager=manager)
    except OmniAccumError as e:
        print(f"omni-accum {command}: error: {e}", file=sys.stderr)
        if as_json:
            details = getattr(e, "details", None) if isinstance(e, PolicyError) else None
            errors = [{"loc": d.get("loc"), "line": d.get("line"), "msg": d["msg"]} for d in details or []]
            errors = errors or [{"loc": None, "line": None, "msg": m} for m in getattr(e, "errors", None) or [str(e)]]
            _json({"policy": _label(name), "valid": False, "errors": errors})
        return None


def explain_key(
    policy: Policy,
    key: str,
    context: StreamContext,
    value_type: str = "tensor",
    manager: StrategyManager | None = None,
    arm: str | None = None,
) -> dict[str, Any]:
    """Which strategy and params ``key`` gets under ``policy`` in ``context``, and why. An A/B split is explained
    under one arm's policy (``arm``, default the first: the one ``Sender``/``Receiver`` run; in vllm-omni each
    request runs its own arm's), named in ``arm`` / ``arms``; ``ValueError`` for an arm the split lacks."""
    if policy.ab is not None:
        arms = policy.arm_policies()
        name = next(iter(arms)) if arm is None else arm
        if name not in arms:
            raise ValueError(f"--arm {arm!r}: the split has no such arm (arms: {', '.join(arms)})")
        info = explain_key(arms[name], key, context, value_type, manager)
        info["notes"].insert(
            0,
            f"the policy is an A/B split (arms {', '.join(arms)}): in vllm-omni each request runs its arm's policy; "
            f"this is arm {name!r}" + (" (the first, which Sender and Receiver run; --arm for another)" if arm is None else ""),
        )
        return {**info, "source": f"ab arm {name!r}: {info['source']}", "arm": name, "arms": list(arms)}
    if arm is not None:
        raise ValueError(f"--arm {arm!r}: the policy has no ab section (no arms)")
    manager = manager or get_manager()
    meta = KeyMeta(key, value_type)  # type: ignore[arg-type]
    notes: list[str] = []
    with warnings.catch_warnings():  # a stale table's warning: the notes below say it (no Python warning text)
        warnings.simplefilter("ignore")
        choice = manager.select(key, meta, context, policy)
        by_policy = policy.resolve(key, context)
        usable = policy.tuned_usable()  # a key a rule decides never reached the table
    reason: dict[str, Any]
    hit = policy.match_rule(key)
    if (choice.strategy, dict(choice.params)) != (by_policy.strategy, dict(by_policy.params)):
        reason = {"kind": "plugin", "detail": "a plugin's omni_accum_select_strategy hook overrode the policy"}
        notes.append(f"the policy alone would give {by_policy.strategy!r} ({by_policy.source})")
    elif hit is not None:
        i, rule = hit
        reason = {"kind": "rule", "rule_index": i, "match": rule.match, "glob": is_glob(rule.match)}
        if rule.description:
            reason["description"] = rule.description
        if is_glob(rule.match):
            others = [
                r.match for j, r in enumerate(policy.rules) if j > i and is_glob(r.match) and _fnmatch(key, r.match)
            ]
            if others:
                notes.append(f"later globs also match and lose (first listed wins): {', '.join(others)}")
    elif key in PROTOCOL_REPLACE_KEYS:
        reason = {"kind": "protocol", "detail": "vllm-omni always replaces this key; a rule naming it would win"}
    elif choice.source.startswith("tuned"):
        assert policy.tuned is not None
        c_edge, k_edge, clamped = policy.tuned.bucket(context)
        reason = {"kind": "tuned", "context_len_bucket": c_edge, "concurrency_bucket": k_edge, "clamped": clamped}
        t = policy.tuned
        cell = t.lookup(key, context)
        if cell is not None:  # what the tuner decided by, as its table records it
            reason.update(baseline=cell.baseline, margin=cell.margin, ci=cell.ci, decision=cell.reason)
        cl = context.context_len if context.context_len is not None else t.context_len_edges[0]
        if context.context_len is None:
            notes.append(
                f"no --context-len given: the table's first context bucket (context_len>={c_edge}) is used; give "
                "--context-len for another"
            )
        for name, value, edges in (
            ("context_len", cl, t.context_len_edges),
            ("concurrency", context.concurrency, t.concurrency_edges),
        ):
            if value < edges[0]:
                notes.append(
                    f"{name} {value} is below the smallest edge measured ({edges[0]}): "
                    f"the first bucket's decision is used"
                )
            elif value > edges[-1]:
                notes.append(
                    f"{name} {value} is above the largest edge measured ({edges[-1]}): the last bucket's "
                    f"decision is extrapolated"
                )
    else:
        reason = {"kind": "default"}
        if policy.tuned is not None and not usable:  # no tuned cell was looked for: the table is stale
            reason["tuned_table"] = "stale"
        notes += _unknown_key_notes(key)
    if policy.tuned is not None and reason["kind"] in ("default", "rule"):
        if not usable:
            diffs = "; ".join(table_mismatches(policy.tuned))
            notes.append(f"tuned table not used: measured in another environment ({diffs})")
        elif reason["kind"] == "default":
            notes.append("tuned table has no cell for this key in this bucket")
    elif policy.tuned is None and (context.context_len is not None or context.concurrency != 1):
        if selectors := manager.selectors():  # a selection plugin may read the context itself
            notes.append(
                "the policy has no tuned table, so --context-len / --concurrency change the choice only through "
                f"the selection plugin(s) {', '.join(selectors)}"
            )
        else:
            notes.append("the policy has no tuned table, so --context-len / --concurrency do not change the choice")
    where = f"key {key!r} ({choice.source})"
    spec = manager.spec(choice.strategy, where=where)
    resolved = manager.params(choice.strategy, choice.params, where).model_dump(mode="json")
    if value_type == "other" and "append" in spec.kinds:
        notes.append(f"{choice.strategy!r} appends tensors and lists; a value of another type is just replaced")
    if value_type != "other" and "append" not in spec.kinds:
        notes.append(f"{choice.strategy!r} is {'/'.join(sorted(spec.kinds))}-kind: the latest value wins")
    if policy.honor_override_keys and "append" in spec.kinds and value_type != "other":
        notes.append("a chunk listing this key in meta.override_keys replaces it for that chunk")
    return {
        "key": key,
        "value_type": value_type,
        "context": {"context_len": context.context_len, "concurrency": context.concurrency},
        "strategy": choice.strategy,
        "params": resolved,
        "params_given": dict(choice.params),
        "kinds": sorted(spec.kinds),
        "plugin": spec.plugin,
        "source": choice.source,
        "reason": reason,
        "notes": notes,
    }


def _unknown_key_notes(key: str) -> list[str]:
    """A note when ``key`` is not one that a supported vllm-omni release sends (a typo takes the default silently),
    with the closest such keys."""
    from omni_accum.integrations.vllm_omni.families.keys import SENT_KEYS

    sent = sorted(set().union(*SENT_KEYS.values()))
    if key in sent:
        return []
    close = close_matches(key, sent, n=3)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return [f"{key!r} is not a key a supported vllm-omni release sends (Qwen3-Omni's stages){hint}"]


def _fnmatch(key: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(key, pattern)


def _edge_label(name: str, value: int | None, edge: int) -> str:
    """``context_len>=8000`` for the bucket ``value`` falls in; ``context_len<1000 (first bucket, 1000)`` below it."""
    if value is not None and value < edge:
        return f"{name}<{edge} (first bucket, edge {edge})"
    return f"{name}>={edge}"


def cmd_explain(args: argparse.Namespace) -> int:
    manager = get_manager()
    policy = _policy_argument("explain", args.policy, manager, args.json)
    if policy is None:
        return 2
    try:
        context = StreamContext(context_len=args.context_len, concurrency=args.concurrency)
    except ValueError as e:
        print(f"omni-accum explain: error: {e}", file=sys.stderr)
        return 2
    try:
        info = explain_key(policy, args.key, context, args.value_type, manager, args.arm)
    except ValueError as e:
        print(f"omni-accum explain: error: {e}", file=sys.stderr)
        return 2
    info = {"policy": _label(args.policy), **info}
    explained = policy.arm_policies()[info["arm"]] if "arm" in info else policy
    if args.json:
        _json(info)
        return 0
    params = ", ".join(f"{k}={v!r}" for k, v in info["params"].items()) or "no params"
    _out(f"key {info['key']!r} -> {info['strategy']} ({params})")
    r = info["reason"]
    why = {
        "rule": lambda: (
            f"rules[{r['rule_index']}] {'glob' if r['glob'] else 'exact'} match {r['match']!r}"
            + (f" ({r['description']})" if r.get("description") else "")
        ),
        "protocol": lambda: f"protocol key: {r['detail']}",
        "tuned": lambda: (
            f"tuned table, bucket {_edge_label('context_len', context.context_len, r['context_len_bucket'])}, "
            f"{_edge_label('concurrency', context.concurrency, r['concurrency_bucket'])}"
        ),
        "default": lambda: "the policy's default (no rule matches, " + (
            "no tuned table)" if explained.tuned is None
            else "tuned table not used: measured in another environment, see the note)"
            if r.get("tuned_table") == "stale" else "no tuned cell)"
        ),
        "plugin": lambda: r["detail"],
    }[r["kind"]]()
    _out(f"  why: {'arm ' + repr(info['arm']) + ': ' if 'arm' in info else ''}{why}")
    if r["kind"] == "tuned" and "baseline" in r:  # the cell's own record of why (a win, or why no win)
        if r.get("decision"):
            _out(f"  tuned against {r['baseline']!r}: {r['decision']}")
        elif r.get("margin") is not None:
            ci = f" (95 % interval {r['ci'][0]:.1%} to {r['ci'][1]:.1%})" if r.get("ci") else ""
            _out(f"  tuned: {r['margin']:.1%} faster than {r['baseline']!r}{ci}")
    _out(f"  strategy kinds: {', '.join(info['kinds'])}; plugin {info['plugin']!r}")
    ctx = info["context"]
    _out(
        f"  assumed: value type {info['value_type']!r} (--value-type), context_len "
        f"{ctx['context_len'] if ctx['context_len'] is not None else 'unknown'}, concurrency {ctx['concurrency']}"
    )
    for n in info["notes"]:
        _out(f"  note: {n}")
    return 0


def _key_path(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"expected a key path such as embed.decode or thinker_embeddings, got {text!r} (a blank key)"
        )
    return text


def _context_len(text: str) -> int:
    """argparse type: one context length, 1 to bench's :data:`~omni_accum.bench.workloads.MAX_ROWS`."""
    n = int_value(text)
    if n > MAX_ROWS:
        raise argparse.ArgumentTypeError(
            f"{n} is over {MAX_ROWS} ({MAX_ROWS // 1000}k), the longest context bench takes"
        )
    return n


def register(subparsers: Any, formatter_class: type[argparse.HelpFormatter], policy_help: str) -> None:
    fmt = formatter_class
    p = subparsers.add_parser(
        "explain",
        help="which strategy and params a key gets under a policy, and why",
        description="Resolve one key path under POLICY, the way Sender and Receiver do (plugins' selection "
        "hooks included): an exact rule, else the first matching glob rule, else a protocol flag that is always "
        "replaced (meta.finished, meta.is_segment_finished), else the tuned table for the context's bucket (when "
        "measured in this environment), else the default. Prints the strategy, its params with defaults filled, and why.",
        epilog="examples:\n  omni-accum explain qwen3-omni --key embed.decode\n"
        "  omni-accum explain tuned.yaml --key embed.prefill --context-len 8000 --concurrency 10 --json",
        formatter_class=fmt,
    )
    p.add_argument("policy", metavar="POLICY", help=policy_help)
    p.add_argument(
        "--key", required=True, type=_key_path, help="key path: group.qualifier (embed.decode) or a flat name"
    )
    p.add_argument(
        "--context-len",
        type=_context_len,
        default=None,
        metavar="N",
        help=f"context length in tokens, e.g. 8000 or 8k, at most {MAX_ROWS // 1000}k (as bench); without it a tuned "
        "table's first context bucket is used, and explain says so",
    )
    p.add_argument("--concurrency", type=positive_int, default=1, metavar="C", help="concurrent requests (default 1)")
    p.add_argument(
        "--value-type",
        choices=VALUE_TYPES,
        default="tensor",
        help="type of the key's first value, for selection plugins (default tensor)",
    )
    p.add_argument(
        "--arm",
        default=None,
        metavar="NAME",
        help="of a policy with an ab section (an A/B split): the arm whose policy to explain (default the first, "
        "which Sender and Receiver run; in vllm-omni each request runs its own arm's)",
    )
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(func=cmd_explain)
