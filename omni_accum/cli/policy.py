"""``omni-accum strategies | validate | explain | show``: list strategies, check and explain policies.

POLICY arguments are a policy file (``.yaml``, ``.yml``, ``.json``, ``.toml``) or a preset name
(``default``, ``qwen3-omni``, ...). Mistakes in a policy are reported as messages naming the file,
line, field and allowed values (exit 1), never as tracebacks; argparse usage errors exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import annotated_types as at
import yaml
from pydantic import BaseModel

from omni_accum.cli import validate
from omni_accum.cli.args import int_value, positive_int
from omni_accum.context import KeyMeta, StreamContext
from omni_accum.errors import OmniAccumError
from omni_accum.policy.environment import table_mismatches
from omni_accum.policy.loader import load_policy, preset_names
from omni_accum.manager import StrategyManager, get_manager
from omni_accum.policy.model import PROTOCOL_REPLACE_KEYS, Policy, is_glob
from omni_accum.strategy import StrategySpec

POLICY_HELP = "a policy file (.yaml, .yml, .json, .toml) or a preset name ({presets})"
VALUE_TYPES = ("tensor", "list", "other")


def _presets() -> str:
    try:
        return ", ".join(preset_names())
    except Exception:  # noqa: BLE001 - help text must never fail
        return "default, ..."


def _out(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _json(data: Any) -> None:
    _out(json.dumps(data, indent=2, sort_keys=False))


# ---------------------------------------------------------------------------------------------- #
# strategies
# ---------------------------------------------------------------------------------------------- #

_CONSTRAINTS = ((at.Gt, "gt", ">"), (at.Ge, "ge", ">="), (at.Lt, "lt", "<"), (at.Le, "le", "<="))


def param_rows(model: type[BaseModel]) -> list[dict[str, Any]]:
    """Describe the fields of a strategy's ``Params`` model: name, type, default, constraints."""
    rows = []
    for name, field in model.model_fields.items():
        constraints = [
            f"{sym} {getattr(m, attr)}" for m in field.metadata for cls, attr, sym in _CONSTRAINTS if isinstance(m, cls)
        ]
        ann = field.annotation
        rows.append(
            {
                "name": name,
                "type": getattr(ann, "__name__", str(ann)),
                "required": field.is_required(),
                "default": None if field.is_required() else field.get_default(call_default_factory=True),
                "constraints": constraints,
                "description": field.description or "",
            }
        )
    return rows


def spec_record(spec: StrategySpec) -> dict[str, Any]:
    """A JSON-ready description of a registered strategy."""
    dist = spec.distribution
    return {
        "name": spec.name,
        "plugin": spec.plugin,
        "distribution": {"name": dist[0], "version": dist[1]} if dist else None,
        "kinds": sorted(spec.kinds),
        "description": spec.description,
        "params": param_rows(spec.params_model),
    }


class _NoSkippedPluginLog(logging.Filter):
    """Drops the manager's "plugin skipped" warnings: ``strategies`` and ``doctor`` print each problem
    themselves, once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "plugin skipped" not in record.getMessage()


@contextlib.contextmanager
def plugin_problems_reported_here() -> Iterator[None]:
    """While the command loads the plugins, leave their "plugin skipped" warnings to it (printed once)."""
    log, quiet = logging.getLogger("omni_accum"), _NoSkippedPluginLog()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def preset_records() -> list[dict[str, str]]:
    """Name and description of every policy preset shipped in ``config/`` (``omni_accum.config``)."""
    out = []
    for name in preset_names():
        try:
            description = load_policy(name).description or ""
        except OmniAccumError as e:  # a preset a broken plugin makes invalid: say so, list the others
            description = f"(does not load here: {e})"
        out.append({"name": name, "description": " ".join(description.split())})
    return out


def cmd_strategies(args: argparse.Namespace) -> int:
    with plugin_problems_reported_here():
        manager = get_manager()
    records = [spec_record(s) for s in manager.specs()]
    problems = [{"plugin": p, "problem": m} for p, m in manager.problems]
    presets, selectors = preset_records(), manager.selectors()
    if args.json:
        _json({"strategies": records, "presets": presets, "selectors": selectors, "disabled": manager.disabled,
               "problems": problems})  # fmt: skip
        return 0
    for r in records:
        dist = r["distribution"]
        where = f"plugin {r['plugin']!r}" + (f" from {dist['name']} {dist['version']}" if dist else " (not installed)")
        _out(f"{r['name']}  [{', '.join(r['kinds'])}]  {where}")
        if r["description"]:
            _out(f"    {r['description']}")
        if not r["params"]:
            _out("    params: none")
        for p in r["params"]:
            default = "required" if p["required"] else f"default {p['default']!r}"
            cons = f", {' and '.join(p['constraints'])}" if p["constraints"] else ""
            _out(f"    param {p['name']}: {p['type']} ({default}{cons})")
            if p["description"]:
                _out(f"        {p['description']}")
    _out("\npresets (policies to pass by name: --arms, validate/explain/show, omni_accum_policy, OMNI_ACCUM_POLICY):")
    for pr in presets:
        _out(f"{pr['name']}\n    {pr['description']}" if pr["description"] else pr["name"])
    if selectors:  # plugins that choose a strategy per key themselves, over the policy's rules
        _out("\nselection hooks (omni_accum_select_strategy, before the policy): " + ", ".join(selectors))
    if manager.disabled:
        _out(f"\nplugins disabled by OMNI_ACCUM_PLUGINS / OMNI_ACCUM_DISABLED_PLUGINS: {', '.join(manager.disabled)}")
    for p in problems:
        print(f"omni-accum: warning: {p['problem']}; plugin skipped", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------- #
# explain
# ---------------------------------------------------------------------------------------------- #


def explain_key(
    policy: Policy, key: str, context: StreamContext, value_type: str = "tensor", manager: StrategyManager | None = None
) -> dict[str, Any]:
    """Which strategy and params ``key`` gets under ``policy`` in ``context``, and why."""
    manager = manager or get_manager()
    meta = KeyMeta(key, value_type)  # type: ignore[arg-type]
    notes: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        choice = manager.select(key, meta, context, policy)
        by_policy = policy.resolve(key, context)
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
        cl = context.context_len if context.context_len is not None else t.context_len_edges[0]
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
        notes += _unknown_key_notes(key)
    if policy.tuned is not None and reason["kind"] in ("default", "rule"):
        if not policy.tuned_usable():
            diffs = "; ".join(table_mismatches(policy.tuned))
            notes.append(f"tuned table not used: measured in another environment ({diffs})")
        elif reason["kind"] == "default":
            notes.append("tuned table has no cell for this key in this bucket")
    elif policy.tuned is None and (context.context_len is not None or context.concurrency != 1):
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
    import difflib

    from omni_accum.integrations.vllm_omni.families.keys import SENT_KEYS

    sent = sorted(set().union(*SENT_KEYS.values()))
    if key in sent:
        return []
    close = difflib.get_close_matches(key, sent, n=3, cutoff=0.6)
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


def _policy_argument(command: str, name: str, manager: StrategyManager) -> Policy | None:
    """The POLICY argument of ``explain`` / ``show``; one that does not load is a usage error (exit 2), as a bad
    ``--base`` or ``--workload`` is (``validate`` is the command whose verdict on a policy is its exit status)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_policy(name, manager=manager)
    except OmniAccumError as e:
        print(f"omni-accum {command}: error: {e}", file=sys.stderr)
        return None


def cmd_explain(args: argparse.Namespace) -> int:
    manager = get_manager()
    policy = _policy_argument("explain", args.policy, manager)
    if policy is None:
        return 2
    try:
        context = StreamContext(context_len=args.context_len, concurrency=args.concurrency)
    except ValueError as e:
        print(f"omni-accum explain: error: {e}", file=sys.stderr)
        return 2
    info = explain_key(policy, args.key, context, args.value_type, manager)
    info = {"policy": args.policy, **info}
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
        "default": lambda: (
            "the policy's default (no rule matches"
            + (", no tuned cell)" if policy.tuned is not None else ", no tuned table)")
        ),
        "plugin": lambda: r["detail"],
    }[r["kind"]]()
    _out(f"  why: {why}")
    _out(f"  strategy kinds: {', '.join(info['kinds'])}; plugin {info['plugin']!r}")
    ctx = info["context"]
    _out(
        f"  assumed: value type {info['value_type']!r} (--value-type), context_len "
        f"{ctx['context_len'] if ctx['context_len'] is not None else 'unknown'}, concurrency {ctx['concurrency']}"
    )
    for n in info["notes"]:
        _out(f"  note: {n}")
    return 0


# ---------------------------------------------------------------------------------------------- #
# show
# ---------------------------------------------------------------------------------------------- #


def resolved_policy_data(policy: Policy, manager: StrategyManager | None = None) -> dict[str, Any]:
    """The policy as plain data, every field and every strategy param filled with its default."""
    manager = manager or get_manager()

    def full(name: str, params: dict[str, Any]) -> dict[str, Any]:
        return manager.spec(name).params_model.model_validate(params).model_dump(mode="json")

    data = policy.model_dump(mode="json", exclude_none=True)
    data["default"]["params"] = full(policy.default.strategy, policy.default.params)
    for rule, out in zip(policy.rules, data["rules"]):
        out["params"] = full(rule.strategy, rule.params)
    return data


def cmd_show(args: argparse.Namespace) -> int:
    manager = get_manager()
    policy = _policy_argument("show", args.policy, manager)
    if policy is None:
        return 2
    data = resolved_policy_data(policy, manager)
    if args.json:
        _json(data)
    else:
        _out(f"# {args.policy}, resolved: every field and strategy param filled with its default")
        _out(yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120))
    return 0


# ---------------------------------------------------------------------------------------------- #
# registration
# ---------------------------------------------------------------------------------------------- #


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Wraps the description like argparse's default, keeps the examples epilog as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


def _key_path(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a key path such as embed.decode or thinker_embeddings, got ''")
    return text


def register(subparsers: Any) -> None:
    """Add ``strategies``, ``validate``, ``explain`` and ``show`` to the ``omni-accum`` parser."""
    fmt = _HelpFormatter
    policy_help = POLICY_HELP.format(presets=_presets())

    p = subparsers.add_parser(
        "strategies",
        help="list the registered strategies (plugins, kinds, params) and the policy presets",
        description="List every registered strategy: name, providing plugin and its distribution and version, "
        "the key kinds it applies to, and its params with defaults and allowed ranges; then every policy preset "
        "(the policies shipped in omni_accum.config, usable by name wherever a policy is asked for) with its "
        "description.",
        epilog="examples:\n  omni-accum strategies\n  omni-accum strategies --json",
        formatter_class=fmt,
    )
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(func=cmd_strategies)

    validate.register(subparsers, fmt, policy_help)

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
        "--context-len", type=int_value, default=None, metavar="N", help="context length in tokens, e.g. 8000 or 8k"
    )
    p.add_argument("--concurrency", type=positive_int, default=1, metavar="C", help="concurrent requests (default 1)")
    p.add_argument(
        "--value-type",
        choices=VALUE_TYPES,
        default="tensor",
        help="type of the key's first value, for selection plugins (default tensor)",
    )
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(func=cmd_explain)

    p = subparsers.add_parser(
        "show",
        help="print the resolved, normalised policy",
        description="Load POLICY and print it normalised: every field present, strategy names resolved, "
        "every strategy's params filled with their defaults. The output is itself a valid policy.",
        epilog="examples:\n  omni-accum show qwen3-omni\n  omni-accum show my-policy.yaml --json",
        formatter_class=fmt,
    )
    p.add_argument("policy", metavar="POLICY", help=policy_help)
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(func=cmd_show)
