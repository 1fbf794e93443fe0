"""``omni-accum validate``: check policies (files, presets, inline text, stdin) and list every problem.

One record per policy, the same shape whether it is valid or not: ``policy``, ``valid``, ``rules``,
``note``, ``errors`` and ``warnings``, each problem as ``{"loc", "line", "msg"}``. Errors make the exit
status 1: the schema, strategy names and params, what a ``Sender``/``Receiver`` refuses, every repeated
rule ``match``, and a tuned table measured in another environment (stale: it would be ignored at run
time; ``--allow-stale`` makes that a warning). Warnings leave the exit status alone: a glob rule that
an earlier glob covers (it never decides a key).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

from omni_accum.engine.endpoint import _Endpoint
from omni_accum.errors import OmniAccumError, PolicyError
from omni_accum.manager import StrategyManager, get_manager
from omni_accum.policy.environment import table_mismatches
from omni_accum.policy.loader import build_policy, format_problem, parse_text, read_policy_argument, strategy_problems
from omni_accum.policy.model import Policy
from omni_accum.policy.parsing import LineIndex, TomlText
from omni_accum.policy.stages import later_stage_problems

DESCRIPTION = (
    "Load each POLICY, check its schema, strategy names and every strategy's params, every repeated rule "
    "match, and whether a tuned table was measured in this environment (a stale table would be ignored at "
    "run time: an error, or a warning with --allow-stale). A glob rule that an earlier glob covers is a "
    "warning. Exit 0 when all are valid, 1 when any is not (every error of every policy is listed, with "
    "file, line, field and allowed values), 2 on usage errors."
)
EXAMPLES = (
    "examples:\n  omni-accum validate my-policy.yaml\n  omni-accum validate qwen3-omni a.yaml b.json\n"
    "  omni-accum validate --allow-stale tuned.yaml\n  cat p.yaml | omni-accum validate -\n"
    "  omni-accum validate 'default: prealloc'"
)


def _problem(loc: str | None, line: int | None, msg: str) -> dict[str, Any]:
    return {"loc": loc, "line": line, "msg": msg}


def _load_errors(e: OmniAccumError) -> list[dict[str, Any]]:
    details = getattr(e, "details", None) if isinstance(e, PolicyError) else None
    if details:
        return [_problem(d.get("loc"), d.get("line"), d["msg"]) for d in details]
    return [_problem(None, None, m) for m in (getattr(e, "errors", None) or [str(e)])]


def check_one(arg: str, manager: StrategyManager, allow_stale: bool = False) -> dict[str, Any]:
    """The validation record of one POLICY argument."""
    label = arg if arg.strip() else repr(arg)  # '' shows as ''
    rec: dict[str, Any] = {"policy": label, "valid": False, "rules": None, "note": None, "errors": [], "warnings": []}
    parsed: list[Any] = []  # (data, text) once the text parsed: the later checks run on what parsed
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            label, text, fmt = read_policy_argument(arg)
            data = parse_text(text, fmt, label)
            text = TomlText(text) if fmt == "toml" else text  # a TOML file's lines are found by TOML rules
            parsed[:] = [data, text]
            policy = build_policy(data, label, text, manager)
    except OmniAccumError as e:
        src = getattr(e, "source", None)  # "<inline>" for inline text: the same header as when it is valid
        rec["policy"] = "<stdin>" if arg == "-" else src if isinstance(src, str) and src.startswith("<") else label
        rec["errors"] = _load_errors(e)
        rec["text"] = [str(m) for m in (getattr(e, "errors", None) or [str(e)])]
        if parsed and getattr(e, "details", None):
            _later_stages(rec, *parsed, manager)
        return rec
    rec["policy"] = label if label.startswith("<") else arg
    rec["rules"] = len(policy.rules)
    lines = LineIndex(text)  # one parse for every warning's line, and none when there is none
    try:
        _Endpoint(policy, manager=manager)  # what a Sender or Receiver refuses (meta.override_keys' rule)
    except OmniAccumError as e:
        rec["errors"].append(_problem(None, None, str(e)))
    if policy.tuned is not None:
        diffs = table_mismatches(policy.tuned)
        if diffs:
            msg = (
                "stale tuned table: measured in another environment, so it would be ignored here ("
                + "; ".join(diffs)
                + "); re-run `omni-accum tune` here"
            )
            where = rec["warnings"] if allow_stale else rec["errors"]
            where.append(_problem("tuned.fingerprint", lines(("tuned", "fingerprint")), msg))
        partial = policy.tuned.partial_note()
        if partial:
            rec["warnings"].append(_problem("tuned.complete", lines(("tuned", "complete")), partial))
    _glob_warnings(rec, policy, lines)
    rec["valid"] = not rec["errors"]
    if policy == Policy() and arg != "default":
        rec["note"] = "the default policy: vllm-omni 0.30.0's behaviour"
    if policy.ab is not None:
        total = sum(a.weight for a in policy.ab.arms.values())
        rec["ab"] = {n: {"policy": a.policy, "share": a.weight / total} for n, a in policy.ab.arms.items()}
    rec["text"] = [format_problem(rec["policy"], p) for p in rec["errors"]]
    return rec


def _later_stages(rec: dict[str, Any], data: Any, text: str, manager: StrategyManager) -> None:
    """A policy whose schema failed: add the strategy-name and param problems of what parsed (the default, every
    rule valid on its own), and the warnings of those rules, so that every problem is listed in one pass."""
    lines = LineIndex(text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        later, partial, index = later_stage_problems(data, lines, manager, strategy_problems)
    seen = {(p["loc"], p["msg"]) for p in rec["errors"]}
    rec["errors"] += [p for p in later if (p["loc"], p["msg"]) not in seen]
    rec["errors"].sort(key=lambda p: p.get("line") or 0)
    if partial is not None:
        _glob_warnings(rec, partial, lines, index)
    rec["text"] = [format_problem(rec["policy"], p) for p in rec["errors"]]


def _glob_warnings(rec: dict[str, Any], policy: Policy, lines: LineIndex, index: dict[int, int] | None = None) -> None:
    """A glob rule that an earlier glob covers (it never decides a key), at the file's own rule indexes."""
    at = (lambda j: j) if index is None else (lambda j: index.get(j, j))  # noqa: E731
    for later, earlier in policy.shadowed_rules():
        msg = (
            f"{policy.rules[later].match!r} is covered by the earlier glob rules[{at(earlier)}].match "
            f"{policy.rules[earlier].match!r} (among globs the first listed wins): this rule never decides a key"
        )
        rec["warnings"].append(_problem(f"rules[{at(later)}].match", lines(("rules", at(later), "match")), msg))


def cmd_validate(args: argparse.Namespace) -> int:
    if args.policies.count("-") > 1:  # the second read finds stdin empty: say what was given
        print("omni-accum validate: error: '-' (stdin) given more than once: stdin is read once", file=sys.stderr)
        return 2
    manager = get_manager()
    results = [check_one(arg, manager, args.allow_stale) for arg in args.policies]
    texts = [r.pop("text") for r in results]
    bad = [r for r in results if not r["valid"]]
    if args.json:
        sys.stdout.write(json.dumps({"valid": not bad, "policies": results}, indent=2) + "\n")
        return 1 if bad else 0
    for r, lines in zip(results, texts):
        if r["valid"]:
            note = f"; same as {r['note']}" if r["note"] else ""
            if r.get("ab"):
                arms = ", ".join(f"{n} {a['share']:.0%} {a['policy']}" for n, a in r["ab"].items())
                print(f"{r['policy']}: ok (A/B split by request id: {arms})")
            else:
                print(f"{r['policy']}: ok ({r['rules']} rule{'' if r['rules'] == 1 else 's'}{note})")
        else:
            print(f"{r['policy']}: {len(r['errors'])} error(s)")
            for line in lines:
                print(f"  {line}")
        for w in r["warnings"]:
            print(f"  warning: {format_problem(r['policy'], w)}")
    if bad:
        print(f"omni-accum validate: {len(bad)} of {len(results)} policies invalid", file=sys.stderr)
    return 1 if bad else 0


def register(subparsers: Any, formatter_class: type[argparse.HelpFormatter], policy_help: str) -> None:
    p = subparsers.add_parser(
        "validate",
        help="check policy files or presets; list every error",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=formatter_class,
    )
    p.add_argument(
        "policies", nargs="+", metavar="POLICY", help=policy_help + "; '-' reads stdin; inline YAML/JSON text"
    )
    p.add_argument(
        "--allow-stale",
        action="store_true",
        help="a tuned table measured in another environment is a warning, not an error (exit 0)",
    )
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(func=cmd_validate)
