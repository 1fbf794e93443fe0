"""``omni-accum validate``: check policies (files, presets, inline text, stdin) and list every problem.

One record per policy, the same shape whether it is valid or not: ``policy``, ``valid``, ``rules``,
``note``, ``errors`` and ``warnings``, each problem as ``{"loc", "line", "msg"}``. Errors make the exit
status 1: the schema, strategy names and params, what a ``Sender``/``Receiver`` refuses, every repeated
rule ``match``, and a tuned table measured in another environment (stale: it would be ignored at run
time; ``--allow-stale`` makes that a warning); an empty argument makes it 2 (a usage mistake). Warnings leave the
exit status alone: a glob rule that
an earlier glob covers (it never decides a key), and a partial tuned table. An A/B split's arms are each checked
so, as the policies of their own they are in vllm-omni, every problem named with its arm (``ab.arms.NAME.policy``).
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
from omni_accum.policy.loader import _loc_of, arm_source, build_policy, format_problem, parse_text, read_policy_argument
from omni_accum.policy.loader import read_source, strategy_problems
from omni_accum.policy.model import Policy
from omni_accum.policy.parsing import LineIndex, TomlText
from omni_accum.policy.stages import later_stage_problems

DESCRIPTION = (
    "Load each POLICY, check its schema, strategy names and every strategy's params, every repeated rule "
    "match, and whether a tuned table was measured in this environment (a stale table would be ignored at "
    "run time: an error, or a warning with --allow-stale). A glob rule that an earlier glob covers is a "
    "warning. Exit 0 when all are valid, 1 when any is not (every error of every policy is listed, with "
    "file, line, field and allowed values), 2 on usage errors (an empty POLICY among them, after every record)."
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
    errors, warns = policy_problems(policy, manager, lines, allow_stale, label)
    rec["errors"] += errors
    rec["warnings"] += warns
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
    rec["warnings"] += _glob_problems(policy, lines, index)


def _glob_problems(policy: Policy, lines: LineIndex, index: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """A glob rule that an earlier glob covers (it never decides a key), at the file's own rule indexes."""
    at = (lambda j: j) if index is None else (lambda j: index.get(j, j))  # noqa: E731
    out = []
    for later, earlier in policy.shadowed_rules():
        msg = (
            f"{policy.rules[later].match!r} is covered by the earlier glob rules[{at(earlier)}].match "
            f"{policy.rules[earlier].match!r} (among globs the first listed wins): this rule never decides a key"
        )
        out.append(_problem(f"rules[{at(later)}].match", lines(("rules", at(later), "match")), msg))
    return out


def policy_problems(
    policy: Policy,
    manager: StrategyManager,
    lines: LineIndex,
    allow_stale: bool = False,
    source: str = "<mapping>",
    tables: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(errors, warnings)`` of a loaded policy beyond its schema, as ``{"loc", "line", "msg"}`` records: what a
    ``Sender``/``Receiver`` refuses, a stale tuned table (a warning with ``allow_stale``), a partial one (a warning;
    ``tables=False`` leaves both table checks out) and the glob rules an earlier glob covers (warnings). Of an A/B
    split: those of every arm (each runs as a policy of its own in vllm-omni), each at its ``ab.arms.NAME.policy``,
    naming the arm's file and line; ``source`` is where the split was read (its arms' relative paths start there)."""
    if policy.ab is not None:
        return _arm_problems(policy, manager, lines, allow_stale, source)
    errors: list[dict[str, Any]] = []
    warns: list[dict[str, Any]] = []
    try:
        _Endpoint(policy, manager=manager)  # what a Sender or Receiver refuses (meta.override_keys' strategy)
    except OmniAccumError as e:
        for d in (getattr(e, "details", None) if isinstance(e, PolicyError) else None) or [{"msg": str(e)}]:
            loc = d.get("loc")
            base = _loc_of(loc.removesuffix(".strategy")) if loc else ()
            errors.append(_problem(loc, (lines((*base, "strategy")) or lines(base)) if loc else None, d["msg"]))
    if policy.tuned is not None and tables:
        diffs = table_mismatches(policy.tuned)
        if diffs:
            msg = (
                "stale tuned table: measured in another environment, so it would be ignored here ("
                + "; ".join(diffs)
                + "); re-run `omni-accum tune` here"
            )
            where = warns if allow_stale else errors
            where.append(_problem("tuned.fingerprint", lines(("tuned", "fingerprint")), msg))
        partial = policy.tuned.partial_note()
        if partial:
            warns.append(_problem("tuned.complete", lines(("tuned", "complete")), partial))
    return errors, warns + _glob_problems(policy, lines)


def _arm_problems(
    policy: Policy, manager: StrategyManager, lines: LineIndex, allow_stale: bool, source: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """:func:`policy_problems` of every arm of a split, each record at the arm's ``ab.arms.NAME.policy``, its
    message naming the arm's policy and the line there: ``ab.arms.b.policy: b.yaml, line 3: rules[0]...: ...``."""
    assert policy.ab is not None
    errors: list[dict[str, Any]] = []
    warns: list[dict[str, Any]] = []
    for name, arm in policy.arm_policies().items():
        ref, loc = policy.ab.arms[name].policy, ("ab", "arms", name, "policy")
        arm_errors, arm_warns = policy_problems(arm, manager, source_lines(ref, source), allow_stale)
        for into, found in ((errors, arm_errors), (warns, arm_warns)):
            into += [_problem(f"ab.arms.{name}.policy", lines(loc), format_problem(ref, p)) for p in found]
    return errors, warns


def source_lines(ref: str, source: str = "<mapping>") -> LineIndex:
    """The lines of the policy file or preset ``ref`` (an arm's ``policy`` of the split read from ``source``); none
    for text that cannot be read again (inline text, a file gone): a problem then has no line."""
    try:
        _, text, fmt = read_source(arm_source(source, ref))
    except OmniAccumError:
        return LineIndex(None)
    return LineIndex(TomlText(text) if fmt == "toml" else text)


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
        return _status(args, bad)
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
    return _status(args, bad)


def _status(args: argparse.Namespace, bad: list[dict[str, Any]]) -> int:
    """1 when a policy is invalid, 0 when none is; 2 when an argument was empty (a usage mistake, as every other
    command's empty argument is), after every argument's record."""
    if any(not str(a).strip() for a in args.policies):
        return 2
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
        "policies", nargs="+", metavar="POLICY", help=policy_help
    )
    p.add_argument(
        "--allow-stale",
        action="store_true",
        help="a tuned table measured in another environment is a warning, not an error (exit 0)",
    )
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(func=cmd_validate)
