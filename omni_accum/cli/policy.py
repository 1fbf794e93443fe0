"""``omni-accum strategies | validate | explain | show``: list strategies, check and explain policies.

POLICY arguments are a policy file (``.yaml``, ``.yml``, ``.json``, ``.toml``) or a preset name
(``default``, ``qwen3-omni``, ...). Mistakes in a policy are reported as messages naming the file,
line, field and allowed values, never as tracebacks: ``validate`` exits 1 on them (its verdict), ``explain`` and
``show`` 2 (a usage error, as argparse's own).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import logging
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import annotated_types as at
import yaml
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from omni_accum.cli import explain, validate
from omni_accum.cli.args import ExamplesHelpFormatter
from omni_accum.cli.explain import _json, _out, _policy_argument
from omni_accum.errors import OmniAccumError
from omni_accum.policy.loader import load_policy, preset_names
from omni_accum.manager import StrategyManager, get_manager
from omni_accum.policy.model import Policy
from omni_accum.strategy import StrategySpec

POLICY_HELP = (
    "a policy file (.yaml, .yml, .json, .toml) or a preset name ({presets}); '-' reads stdin; inline YAML/JSON text"
)


def _presets() -> str:
    try:
        return ", ".join(preset_names())
    except Exception:  # noqa: BLE001 - help text must never fail
        return "default, ..."


# ---------------------------------------------------------------------------------------------- #
# strategies
# ---------------------------------------------------------------------------------------------- #

_CONSTRAINTS = ((at.Gt, "gt", ">"), (at.Ge, "ge", ">="), (at.Lt, "lt", "<"), (at.Le, "le", "<="))


def _json_defaults(model: type[BaseModel]) -> dict[str, Any]:
    """Every default of ``model`` in its JSON form (an Enum's value, a Path or a timedelta as a string, a frozenset
    as a list), as the params are written in a policy: ``strategies --json`` could not print them as they are, and the
    text showed ``<Mode.FAST: 'fast'>``. The model's own serializers apply; a default pydantic cannot put in JSON is
    shown as its repr."""
    try:
        return model().model_dump(mode="json")
    except Exception:  # noqa: BLE001 - a required param (no default to show), or a serializer that raises
        out = {}
        for name, field in model.model_fields.items():
            if not field.is_required():
                try:
                    out[name] = to_jsonable_python(field.get_default(call_default_factory=True))
                except Exception:  # noqa: BLE001 - a plugin's default of a type JSON has no form for
                    out[name] = repr(field.get_default(call_default_factory=True))
        return out


def field_docstrings(model: type[BaseModel]) -> dict[str, str]:
    """The docstring under each field of ``model`` and its bases, read from their source when asked (a field that a
    subclass declares again has the subclass's docstring, or none), as pydantic's ``use_attribute_docstrings`` gives.

    That flag reads them when the class is built: about a second of every process that imports a strategy where vLLM
    is loaded (its frame search scans every loaded module), for text that only ``strategies`` prints. A model
    without source (built at run time) has none."""
    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
            continue
        for name in cls.__dict__.get("__annotations__", {}):
            docs.pop(name, None)
        try:
            source = textwrap.dedent(inspect.getsource(cls))
            if source.startswith((" ", "\t")):  # a docstring less indented than a nested class: pydantic's way round
                source = "def dedent_workaround():\n" + source
            tree = ast.parse(source)
        except (OSError, TypeError, SyntaxError):
            continue
        node = tree.body[0] if tree.body else None
        node = node.body[0] if isinstance(node, ast.FunctionDef) and node.body else node
        body = node.body if isinstance(node, ast.ClassDef) else []
        for stmt, after in zip(body, body[1:]):
            target = stmt.target if isinstance(stmt, ast.AnnAssign) else None
            doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
            if isinstance(target, ast.Name) and isinstance(doc, str):
                docs[target.id] = inspect.cleandoc(doc)
    return docs


def param_rows(model: type[BaseModel]) -> list[dict[str, Any]]:
    """Describe the fields of a strategy's ``Params`` model: name, type, default (in its JSON form), constraints."""
    rows = []
    defaults = _json_defaults(model)
    docs = field_docstrings(model)
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
                "default": None if field.is_required() else defaults.get(name),
                "constraints": constraints,
                "description": field.description or docs.get(name, ""),
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
    policy = _policy_argument("show", args.policy, manager, args.json)
    if policy is None:
        return 2
    data = resolved_policy_data(policy, manager)
    if policy.ab is not None:  # an arm's policy file as an absolute path: the output loads from any folder
        from omni_accum.policy.loader import arm_source
        from omni_accum.policy.sources import _FORMATS, probe

        for arm in data["ab"]["arms"].values():
            where = arm_source(args.policy, arm["policy"])
            # as the loader reads it: a name without a policy file's suffix is a preset first; ".." left to the
            # kernel (it follows a linked folder before it goes up, where abspath would drop a folder by its name)
            if Path(where).suffix.lower() in _FORMATS and probe(where, "is_file"):
                arm["policy"] = str(Path(where).absolute())
    if args.json:
        _json(data)
    else:
        name = args.policy if "\n" not in args.policy and "\r" not in args.policy else "<inline>"
        name = "<stdin>" if name == "-" else name
        _out(f"# {name}, resolved: every field and strategy param filled with its default")
        _out(yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120))
    return 0


# ---------------------------------------------------------------------------------------------- #
# registration
# ---------------------------------------------------------------------------------------------- #


def register(subparsers: Any) -> None:
    """Add ``strategies``, ``validate``, ``explain`` and ``show`` to the ``omni-accum`` parser."""
    fmt = ExamplesHelpFormatter
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

    explain.register(subparsers, fmt, policy_help)

    p = subparsers.add_parser(
        "show",
        help="print the resolved, normalised policy",
        description="Load POLICY and print it normalised: every field present, strategy names resolved, "
        "every strategy's params filled with their defaults. The output is itself a valid policy (an A/B split's "
        "arm files as absolute paths, so that it loads from any folder; the arms' own policies are not expanded: "
        "show each arm's file for that).",
        epilog="examples:\n  omni-accum show qwen3-omni\n  omni-accum show my-policy.yaml --json",
        formatter_class=fmt,
    )
    p.add_argument("policy", metavar="POLICY", help=policy_help)
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(func=cmd_show)
