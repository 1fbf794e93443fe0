"""Loading policies: files (YAML, JSON, TOML), preset names, mappings, ``OMNI_ACCUM_POLICY``.

Policies are data: YAML goes through the safe loader only, strategy names resolve only to
registered plugins, and nothing in a policy is ever imported or executed. Errors list every
problem with its place (rule index, field path, file line where the YAML parser can tell) and
the allowed values.
"""

from __future__ import annotations

import contextvars
import json
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from omni_accum.errors import InvalidArgumentError, PolicyArgumentError, PolicyError, describe_plugin
from omni_accum.manager import StrategyManager, get_manager
from omni_accum.policy.environment import installed_plugins
from omni_accum.policy.fingerprint import plugin_versions
from omni_accum.policy import model
from omni_accum.policy.model import Policy
from omni_accum.policy.parsing import DuplicateKeyError, LineIndex, TomlText, bad_scalar_line, load_json, load_yaml
from omni_accum.policy.parsing import yaml_error_parts
from omni_accum.policy.tuned import cell_problems
from omni_accum.policy.sources import (  # noqa: F401 - re-exported: the loader's public names
    MAX_POLICY_BYTES,
    PRESET_SUFFIX,
    is_inline_policy,
    preset_names,
    preset_text,
    probe,
    read_policy_argument,
    read_source,
)

ENV_POLICY = "OMNI_ACCUM_POLICY"
#: ``OMNI_ACCUM_POLICY`` values that are no process-wide policy for the vllm-omni plugin (a connector extra naming
#: one still binds it); to the library they mean ``default``.
POLICY_OFF = ("off", "none", "false", "no", "0")  # the switches' off words, and none


# ---------------------------------------------------------------------------------------------- #
# Parsing
# ---------------------------------------------------------------------------------------------- #


def parse_text(text: str, fmt: str, source: str) -> Any:
    """Parse policy text of format ``yaml``, ``json`` or ``toml``; errors name the source and line.

    A key given twice in one mapping (at any level) is an error naming both lines (TOML refuses it itself).
    """
    try:
        if fmt == "json":
            return load_json(text)
        if fmt == "toml":
            return tomllib.loads(text)
        return load_yaml(text)
    except DuplicateKeyError as e:
        line = f"line {e.second_line}: " if e.second_line else ""
        raise _parse_error(source, e.second_line, f"invalid {fmt.upper()}: {e.problem}") from e
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line, problem = yaml_error_parts(e)
        if isinstance(e, yaml.constructor.ConstructorError) and "constructor for the tag" in problem:
            problem += " (policies are data: YAML tags that build Python objects are not allowed)"
        raise _parse_error(source, mark.line + 1 if mark else None, f"invalid YAML: {problem}", line) from e
    except yaml.YAMLError as e:
        raise PolicyError(f"{source}: invalid YAML: {e}", source=source) from e
    except json.JSONDecodeError as e:
        raise _parse_error(source, e.lineno, f"invalid JSON: {e.msg}", f"line {e.lineno}, column {e.colno}: ") from e
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(f"{source}: invalid TOML: {e}", source=source) from e
    except RecursionError as e:
        raise PolicyError(f"{source}: invalid {fmt.upper()}: nested too deeply", source=source) from e
    except (ValueError, TypeError, IndexError, OverflowError) as e:
        # PyYAML's safe constructors raise plain exceptions for bad tagged scalars (``!!int x``, ``!!binary ?``).
        where = bad_scalar_line(text) if fmt == "yaml" else None
        line = f"line {where}: " if where else ""
        raise _parse_error(source, where, f"invalid {fmt.upper()} value: {type(e).__name__}: {e}") from e


def _parse_error(source: str, line: int | None, msg: str, place: str | None = None) -> PolicyError:
    """A PolicyError for text that does not parse: ``source: line N: msg``, with its detail record."""
    if place is None:
        place = f"line {line}: " if line else ""
    detail = {"loc": None, "line": line, "msg": msg}
    return PolicyError(f"{source}: {place}{msg}", source=source, details=[detail])


_PLAIN_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


def _format_loc(loc: tuple[Any, ...]) -> str:
    """``("rules", 0, "params")`` -> ``rules[0].params``; odd keys are quoted (``':'``, ``'a.b'``)."""
    out = ""
    for part in loc:
        if isinstance(part, int) and out:
            out += f"[{part}]"
            continue
        name = part if isinstance(part, str) and _PLAIN_KEY_RE.fullmatch(part) else repr(part)
        out += f".{name}" if out else name
    return out or "(top level)"


_RULE_MATCH_RE = re.compile(r"^rules\[(\d+)\]\.match ")


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The policy model that holds the field at ``loc`` (``("rules", 0, "x")`` -> Rule), or None."""
    model: Any = Policy
    keyed = False  # the part before was a mapping of models by name (``ab.arms``): this part is a name
    for part in loc[:-1]:
        if isinstance(part, int) or keyed:
            keyed = False
            continue
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        ann = field.annotation
        keyed = typing.get_origin(ann) is dict
        model = next(
            (
                a
                for a in (ann, *typing.get_args(ann), *(b for a in typing.get_args(ann) for b in typing.get_args(a)))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ),
            None,
        )
        if model is None:
            return None
    return model


def got_suffix(e: Mapping[str, Any]) -> str:
    """`` (got X)`` for a scalar input pydantic's message does not show, else ''."""
    value = e.get("input")
    if "input" not in e or isinstance(value, (Mapping, list, tuple)) or repr(value) in e["msg"]:
        return ""
    return f" (got {value!r})"


def _place(source: str, line: int | None) -> str:
    return f"{source}" + (f", line {line}" if line else "")


def format_problem(source: str, d: Mapping[str, Any]) -> str:
    """A detail record as the one-line message ``source, line N: loc: msg``."""
    loc = f"{d['loc']}: " if d.get("loc") else ""
    return f"{_place(source, d.get('line'))}: {loc}{d['msg']}"


def _invalid(source: str, details: list[dict[str, Any]]) -> PolicyError:
    """The PolicyError listing ``details``: ``invalid policy:`` then one line per problem, each naming its source."""
    errors = [format_problem(source, d) for d in details]
    return PolicyError("invalid policy:\n  " + "\n  ".join(errors), errors, source, details)


def _is_repeat(detail: Mapping[str, Any]) -> bool:
    """Whether a problem of :func:`_validation_details` is a repeated rule match."""
    return bool(_RULE_MATCH_RE.match(f"{detail.get('loc')} {detail.get('msg')}")) and "repeats rules[" in str(
        detail.get("msg")
    )


def _validation_details(err: ValidationError, lines: LineIndex) -> list[dict[str, Any]]:
    out = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if p not in ("function-after[_index_rules(), Policy]",))
        msg = e["msg"].removeprefix("Value error, ")
        if not loc and all(_RULE_MATCH_RE.match(m) for m in msg.splitlines()):
            # whole-policy checks that name one rule's field each (every repeated match): point at each
            for m in msg.splitlines():
                rloc = ("rules", int(_RULE_MATCH_RE.match(m).group(1)), "match")  # type: ignore[union-attr]
                line = lines(rloc)
                out.append({"loc": _format_loc(rloc), "line": line, "msg": m.split(" ", 1)[1]})
            continue
        if loc == ("tuned",) and (cells := cell_problems(msg)):  # every bad cell, each at its own line
            out += [{"loc": _format_loc(cloc), "line": lines(cloc), "msg": m} for cloc, m in cells]
            continue
        line = lines(loc) if loc else None
        if loc and loc[-1] == "[key]" and e["type"] == "value_error":  # a key refused by its check (an arm name)
            loc = loc[:-1]
        elif loc and loc[-1] == "[key]":  # a mapping key of the wrong type
            loc = loc[:-1]
            msg = f"keys must be strings, got {type(loc[-1]).__name__ if loc else 'another type'} key"
        elif e["type"] == "extra_forbidden":
            model = _model_at(loc)
            allowed = f". Allowed fields: {', '.join(model.model_fields)}" if model is not None else ""
            msg = f"unknown field{allowed}"
        elif e["type"] == "model_type" and loc == ("default",):
            msg = (
                f"expected a strategy name or {{strategy: NAME, params: {{...}}}}, got {type(e.get('input')).__name__}"
            )
        elif e["type"] == "model_type":
            model = _model_at((*loc, "x"))
            fields = f" with fields {', '.join(model.model_fields)}" if model is not None else ""
            msg = f"expected a mapping{fields}, got {type(e.get('input')).__name__}"
        elif e["type"] != "missing":
            msg += got_suffix({**e, "msg": msg})
        out.append({"loc": _format_loc(loc), "line": line, "msg": msg})
    return out


def strategy_problems(
    policy: Policy, manager: StrategyManager, text: str | LineIndex | None = None
) -> list[dict[str, Any]]:
    """Every strategy the policy names exists and its params validate: the problems as ``{"loc", "line", "msg"}``
    records (lines are looked up for problems only)."""
    lines = text if isinstance(text, LineIndex) else LineIndex(text)
    errors: list[dict[str, Any]] = []
    available = manager.names()
    # A tuned cell whose strategy was measured with a plugin that is not loaded here, or loaded at another version
    # (the table's fingerprint records each winner's), is not checked here: that plugin makes the table stale, which
    # is ignored at run time (a warning, then the rules and default) and reported by validate, not an invalid policy.
    # Every other cell is checked as a rule is.
    recorded = (policy.tuned.fingerprint.get("plugins") if policy.tuned is not None else None) or {}
    here = plugin_versions(manager.specs()) if recorded else {}
    for where, name, params in policy.strategy_refs():
        if where.startswith("tuned.") and name in recorded and recorded[name] != here.get(name):
            continue
        spec = manager.get_spec(name)
        loc: tuple[Any, ...] = _loc_of(where)
        if spec is None:
            msg = f"unknown strategy {name!r}. Available: {', '.join(available)}{manager.not_loaded_note()}"
            line = lines(loc + ("strategy",)) or lines(loc)  # the strategy key's own line (a bare name: the rule's)
            errors.append({"loc": f"{where}.strategy", "line": line, "msg": msg})
            continue
        try:
            spec.params_model.model_validate(params)
        except ValidationError as e:
            allowed = spec.allowed_params()
            for pe in e.errors():
                field = ".".join(str(p) for p in pe["loc"])
                pline = lines(loc + ("params", *pe["loc"]))
                msg = "unknown param" if pe["type"] == "extra_forbidden" else pe["msg"] + got_suffix(pe)
                msg += f" (strategy {name!r}; allowed params: {allowed})"
                errors.append({"loc": f"{where}.params.{field}", "line": pline, "msg": msg})
        except Exception as e:  # noqa: BLE001 - a validator of the plugin's raising another error: the plugin's bug
            msg = (f"strategy {name!r} ({describe_plugin(spec.plugin, spec.distribution)}): its Params validator "
                   f"raised {type(e).__name__} on params {dict(params)!r}: {e} (a validator should raise ValueError; "
                   f"allowed params: {spec.allowed_params()})")  # fmt: skip
            errors.append({"loc": f"{where}.params", "line": lines(loc + ("params",)) or lines(loc), "msg": msg})
    return errors


def _loc_of(where: str) -> tuple[Any, ...]:
    if where == "default":
        return ("default",)
    head, _, idx = where.partition("[")
    parts: list[Any] = head.split(".")
    return (*parts, int(idx.rstrip("]")))


# ---------------------------------------------------------------------------------------------- #
# Public entry points
# ---------------------------------------------------------------------------------------------- #


def build_policy(
    data: Any, source: str = "<mapping>", text: str | None = None, manager: StrategyManager | None = None
) -> Policy:
    """Validate parsed policy data (a mapping) into a :class:`Policy`, checking strategies and params."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        toml = isinstance(data, str) and re.search(r"^\s*[\w\"-]+\s*=", data, re.M)  # read as YAML: one string
        raise PolicyError(f"{source}: a policy must be a mapping with keys like 'default' and 'rules', got "
                          f"{type(data).__name__}" + (" (TOML? name the file .toml)" if toml else ""), source=source)
    lines = LineIndex(text)  # parsed for the first problem's line, if any
    try:
        policy = Policy.model_validate(dict(data))
    except RecursionError as e:
        raise PolicyError(f"{source}: invalid policy: nested too deeply", source=source) from e
    except ValidationError as e:
        details = _validation_details(e, lines)
        if manager is None:
            manager = get_manager()
        if all(_is_repeat(d) or str(d.get("loc")).startswith("tuned.cells[") for d in details):
            # Only repeated matches and bad tuned cells: the rest can still be checked (strategy names and params),
            # so that every problem is listed at once; the first rule of each match stands in for its copies.
            try:
                again = Policy.model_validate(dict(data), context={"allow_repeats": True, "allow_cell_problems": True})
            except ValidationError:  # noqa: S110 - not expected; the repeats alone are reported
                pass
            else:
                details = sorted(
                    details + strategy_problems(again, manager, lines), key=lambda d: (d.get("line") or 0)
                )
        if arm_details := _raw_arm_problems(data, details, source, lines, manager):
            details = sorted(details + arm_details, key=lambda d: (d.get("line") or 0))
        raise _invalid(source, details) from e
    if manager is None:
        manager = get_manager()
    details = strategy_problems(policy, manager, lines)
    if details:
        raise _invalid(source, details)
    policy.bind_plugins(installed_plugins)
    if policy.ab is not None:
        policy._arms = resolve_arms(policy, source, lines, manager)
    return policy


#: True while an A/B arm's policy is being loaded: an arm that splits again is refused, not followed.
_IN_ARM: contextvars.ContextVar[bool] = contextvars.ContextVar("omni_accum_in_arm", default=False)


def resolve_arms(
    policy: Policy, source: str = "<mapping>", text: str | LineIndex | None = None, manager: StrategyManager | None = None
) -> dict[str, Policy]:
    """Load the policy of each arm of ``policy``'s ``ab`` section (a preset name or a file; a relative path is
    read from the folder of ``source`` first when ``source`` is a file). Every problem is reported at once, each
    at its ``ab.arms.NAME.policy`` line, naming the value and what would do."""
    lines = text if isinstance(text, LineIndex) else LineIndex(text)
    if policy.ab is None:
        return {}
    if _IN_ARM.get():
        msg = "an A/B arm's policy has an ab section of its own: an arm runs one policy (name a preset or a policy file)"
        raise _invalid(source, [{"loc": "ab", "line": lines(("ab",)), "msg": msg}])
    arms, details = _load_arms([(name, arm.policy) for name, arm in policy.ab.arms.items()], source, lines, manager)
    if details:
        raise _invalid(source, details)
    return arms


def _raw_arm_problems(data: Mapping[str, Any], details: list[dict[str, Any]], source: str, lines: LineIndex,
                      manager: StrategyManager | None) -> list[dict[str, Any]]:
    """The arms' policy problems of a split that failed validation elsewhere (a weight, a name), so that ``validate``
    lists them in the same pass: each arm whose ``policy`` is a string not already reported."""
    raw = data["ab"].get("arms") if isinstance(data.get("ab"), Mapping) else None
    if not isinstance(raw, Mapping) or _IN_ARM.get():
        return []
    said = {d.get("loc") for d in details}
    pairs = [(str(n), a.get("policy")) for n, a in raw.items() if isinstance(a, Mapping)]
    pairs = [(n, r) for n, r in pairs if isinstance(r, str) and _format_loc(("ab", "arms", n, "policy")) not in said]
    return _load_arms(pairs, source, lines, manager)[1]


def arm_source(source: str, ref: str) -> str:
    """Where the arm ``policy: ref`` of a split read from ``source`` loads from: the file of that name beside
    ``source`` (a relative path), else ``ref`` itself (a path from the working directory, a preset)."""
    folder = Path(source).parent if probe(source, "is_file") else None
    if folder is not None and not Path(ref).is_absolute() and probe(folder / ref, "is_file"):
        return str(folder / ref)
    return ref


def _load_arms(
    pairs: list[tuple[str, str]], source: str, lines: LineIndex, manager: StrategyManager | None
) -> tuple[dict[str, Policy], list[dict[str, Any]]]:
    """Each arm's policy by name, and a problem per arm that does not load (at its ``ab.arms.NAME.policy``)."""
    folder = Path(source).parent if probe(source, "is_file") else None
    arms: dict[str, Policy] = {}
    details: list[dict[str, Any]] = []
    for name, ref in pairs:
        loc, target = ("ab", "arms", name, "policy"), arm_source(source, ref)
        token = _IN_ARM.set(True)
        try:
            if is_inline_policy(ref) and not probe(target):
                raise PolicyError(f"{ref!r} is neither a policy file nor a preset. Available presets: {', '.join(preset_names())}")
            arms[name] = load_policy(target, manager=manager)
        except PolicyError as e:
            why = str(e).replace("\n", " ")  # a relative path not found: it was looked for in the split's folder first
            why = f"{ref}: no such policy file (a relative path, looked for in the split's folder {folder}, then in the working directory {os.getcwd()})" if folder is not None and why.startswith(f"{ref}: no such policy file (a relative") else why  # noqa: E501
            msg = f"{ref!r} does not load as an arm's policy: {why}"
            if "Available presets" not in msg:
                msg += f" (give a preset: {', '.join(preset_names())}; or a policy file)"
            details.append({"loc": _format_loc(loc), "line": lines(loc), "msg": msg})
        finally:
            _IN_ARM.reset(token)
    return arms, details


model.ARM_RESOLVER = resolve_arms  # Policy.arm_policies of a policy not built here (model cannot import this module)


def load_policy(
    source: str | os.PathLike[str] | Mapping[str, Any] | Policy | None = None,
    *,
    manager: StrategyManager | None = None,
) -> Policy:
    """Load a policy from a preset name, a file path, a mapping, or ``OMNI_ACCUM_POLICY``.

    Args:
        source: a :class:`Policy` (checked, then returned as is), a mapping of the policy shape, a path to a
            ``.yaml``/``.yml``/``.json``/``.toml`` file, a preset name (``"qwen3-omni"``) or policy text
            (YAML or JSON: ``"default: cat"``). ``None`` reads ``OMNI_ACCUM_POLICY`` (a path, a preset name,
            or inline YAML/JSON) and falls back to the ``default`` preset.
        manager: strategy manager to validate strategy names and params against (default: the
            process-wide one).

    Raises:
        PolicyError: with every problem found, each naming the place (a :class:`PolicyArgumentError`, also a
            ``TypeError``, for a ``source`` of a type no policy can be: a number, a list, bytes).
    """
    if manager is not None and not isinstance(manager, StrategyManager):
        raise InvalidArgumentError(f"manager must be a StrategyManager or None, got {type(manager).__name__}")
    if isinstance(source, Policy):
        details = strategy_problems(source, manager or get_manager())
        if details:  # a Policy made in code is checked as a file is (its fields are, by pydantic; not its names)
            raise _invalid("<Policy>", details)
        source.bind_plugins(installed_plugins)
        return source
    if isinstance(source, BaseModel):
        source = source.model_dump()
    if isinstance(source, Mapping):
        return build_policy(source, "<mapping>", None, manager)
    if source is not None and not isinstance(source, (str, os.PathLike)):
        hint = ": decode bytes to str first" if isinstance(source, bytes) else ""
        raise PolicyArgumentError(
            "a policy must be a Policy, a mapping, a preset name, a file path or policy text (str), got "
            f"{type(source).__name__} {source!r:.60}{hint}"
        )
    label = "<inline policy>"  # inline text given as source: a connector extra's block string, say
    if source is None:
        env = os.environ.get(ENV_POLICY, "").strip()
        source, label = (env, ENV_POLICY) if env and env.lower() not in POLICY_OFF else ("default", label)
    if isinstance(source, str) and not source.strip():
        raise PolicyError("an empty policy argument: give a preset name, a policy file, policy text or a mapping")
    if isinstance(source, str) and is_inline_policy(source) and not probe(source):
        return build_policy(parse_text(source, "yaml", label), label, source, manager)
    label, text, fmt = read_source(source, origin=ENV_POLICY if label == ENV_POLICY else None)
    data = parse_text(text, fmt, label)
    return build_policy(data, label, TomlText(text) if fmt == "toml" else text, manager)


DUMP_FORMATS = ("yaml", "json")


def dump_policy(policy: Policy, fmt: str = "yaml") -> str:
    """Serialise a policy (normalised: defaults filled in) as YAML or JSON (``fmt``: ``"yaml"`` or ``"json"``)."""
    if not isinstance(policy, Policy):  # a preset name or a mapping is not loaded here: load_policy(...) does that
        got = f"{type(policy).__name__} {policy!r:.60}"
        raise PolicyArgumentError(f"dump_policy: expected a Policy, got {got}; pass one from load_policy(...)")
    if fmt not in DUMP_FORMATS:
        raise PolicyArgumentError(f"dump_policy: unknown format {fmt!r}; valid formats: {', '.join(DUMP_FORMATS)}")
    data = policy.model_dump(mode="json", exclude_none=True)
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120)
