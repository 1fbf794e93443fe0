"""``omni-accum doctor``'s policy checks: the policy ``OMNI_ACCUM_POLICY`` or a deploy YAML's connectors name,
whether it loads, whether its tuned table fits this environment, and whether it matches any key the installed
vllm-omni release sends. Every finding is a :class:`Check`; nothing here raises for a bad deploy YAML.
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass
from typing import Any

from omni_accum.errors import OmniAccumError, setting_given
from omni_accum.policy.loader import POLICY_OFF



@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    #: A warning does not make the exit status non-zero.
    warning: bool = False


def _read_deploy(path: str) -> Any:
    """A deploy YAML, parsed (:class:`OmniAccumError` naming the file when it cannot be read or parsed)."""
    import yaml

    from omni_accum.policy.parsing import load_yaml, yaml_error_parts

    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block, /dev/zero never end
        kind = "a directory" if os.path.isdir(path) else "not a regular file"
        raise OmniAccumError(f"--deploy {path}: {kind}; give the deploy YAML the server starts with")
    try:
        text = ""
        with open(path, encoding="utf-8") as f:
            text = f.read()
        data = load_yaml(text)
        if _cyclic(data):  # ``x: &a [*a]``: every walk of the tree (ours, vllm-omni's loader) would recurse for good
            raise OmniAccumError(f"--deploy {path}: invalid YAML: an alias (*name) refers to a node that holds it")
        return data
    except yaml.YAMLError as e:
        line, problem = yaml_error_parts(e)
        raise OmniAccumError(f"--deploy {path}: {line}invalid YAML: {problem}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise OmniAccumError(f"--deploy {path}: cannot read it: {e}") from e
    except RecursionError as e:
        raise OmniAccumError(f"--deploy {path}: invalid YAML: nested too deeply") from e
    except (ValueError, TypeError, IndexError, OverflowError) as e:  # PyYAML's bad tagged scalars (``!!int x``)
        from omni_accum.policy.parsing import bad_scalar_line

        where = bad_scalar_line(text)
        line = f"line {where}: " if where else ""
        raise OmniAccumError(f"--deploy {path}: {line}invalid YAML value: {type(e).__name__}: {e}") from e


def _cyclic(node: Any) -> bool:
    """Whether a parsed YAML tree holds itself somewhere (an alias to an enclosing node); shared, acyclic aliases
    are fine."""
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(node, False)]
    while stack:
        n, leaving = stack.pop()
        if leaving:
            on_path.discard(id(n))
            continue
        if not isinstance(n, (dict, list)):
            continue
        if id(n) in on_path:
            return True
        on_path.add(id(n))
        stack.append((n, True))
        stack.extend((v, False) for v in (n.values() if isinstance(n, dict) else n))
    return False


def _deploy_or_none(deploy: str | None) -> Any:
    """The parsed deploy YAML, or None when none is given or it cannot be read (``check_policy`` reports that)."""
    if not deploy:
        return None
    try:
        return _read_deploy(deploy)
    except OmniAccumError:
        return None


def _connector_nodes(node: Any, where: str = "", keep: Any = None) -> list[tuple[str, dict[str, Any]]]:
    """``(where, node)`` for every mapping of a parsed deploy YAML that ``keep(node)`` accepts (default: one with an
    ``extra`` mapping, a connector: its ``name`` and ``extra``), where: the node's path."""
    if keep is None:
        keep = _has_extra
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        if keep(node):
            found.append((where, node))
        for k, v in node.items():
            found += _connector_nodes(v, f"{where}.{k}" if where else str(k), keep)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _connector_nodes(v, f"{where}[{i}]", keep)
    return found


def _has_extra(node: dict[str, Any]) -> bool:
    return isinstance(node.get("extra"), dict)


def _connector_extras(node: Any) -> list[tuple[str, dict[str, Any]]]:
    """``(where, extra)`` for every ``extra`` mapping of a parsed deploy YAML (where: its parent's path)."""
    return [(where, n["extra"]) for where, n in _connector_nodes(node)]


def extra_keys() -> tuple[str, ...]:
    """Every ``omni_accum_*`` key omni-accum reads from a connector ``extra``."""
    from omni_accum.integrations.vllm_omni.binding_settings import extra_keys as keys

    return keys()


def _misplaced(node: Any, where: str = "") -> list[str]:
    """Where an ``omni_accum_*`` key sits in a mapping that is not a connector's ``extra`` (beside ``extra``, say)."""
    found: list[str] = []
    if isinstance(node, dict):
        for k, v in node.items():
            path = f"{where}.{k}" if where else str(k)
            if str(k).startswith("omni_accum_"):
                found.append(path)
            elif k != "extra":
                found += _misplaced(v, path)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _misplaced(v, f"{where}[{i}]")
    return found


def check_connectors(deploy: str | None) -> list[Check]:
    """Every connector ``extra`` of the deploy YAML read as the stage processes read it: omni-accum's own
    ``omni_accum_*`` keys (a misspelt one is ignored there, so it is named here; ``omni_accum_adapter_keys`` a list
    of key paths), and the settings of omni-accum's connectors (``OmniAccumArenaConnector``,
    ``OmniAccumMooncakeConnector``), which a stage refuses when it builds the connector: the server does not start."""
    data = _deploy_or_none(deploy)
    if data is None:
        return []
    from omni_accum.integrations.vllm_omni import arena_settings, mooncake_settings
    from omni_accum.integrations.vllm_omni.binding_settings import EXTRA_ADAPTER_KEYS, _adapter_keys, unknown_extra_keys

    parsers = {name: mod.parse_settings for mod in (arena_settings, mooncake_settings) for name in [mod.NAME]}
    out: list[Check] = []
    notes: list[Check] = []
    read = 0
    for where, node in _connector_nodes(data):
        extra, place = node["extra"], f"{deploy}: {where}.extra" if where else f"{deploy}: extra"
        unknown = unknown_extra_keys(extra)
        if unknown:
            detail = f"{place}: {unknown.removeprefix('connector extra: ')}"
            out.append(Check("connector", False, detail, "correct the key (a stage with it binds no omni-accum: it "
                                                         "runs vllm-omni's own code)"))  # fmt: skip
        try:
            _adapter_keys(extra.get(EXTRA_ADAPTER_KEYS))
        except OmniAccumError as e:
            out.append(Check("connector", False, f"{place}: {e}", f"give {EXTRA_ADAPTER_KEYS} as a list"))
        parse = parsers.get(node.get("name"))  # type: ignore[arg-type]
        if parse is not None:
            try:
                settings = parse(extra)
                read += 1
            except ValueError as e:
                fix = f"correct it: the stage refuses to build {node['name']}, and the server does not start"
                out.append(Check("connector", False, f"{place}: {e}", fix))
                continue
            if node.get("name") == arena_settings.NAME:
                note = arena_settings.room_note(settings, _pairs_of(data, where))
                if note:
                    notes.append(Check("connector", True, f"{place}: {note}", "give the file system more room (docker "
                                       "run --shm-size), or smaller sizes", warning=True))  # fmt: skip
    for where in _misplaced(data):
        detail = f"{deploy}: {where}: outside any connector's extra mapping, where no stage reads it"
        out.append(Check("connector", False, detail, "move it into the connector's extra: mapping"))
    if read and not out:
        out.append(Check("connector", True, f"{deploy}: the settings of omni-accum's connector(s) read as the stages "
                                            "will read them"))  # fmt: skip
    return out + notes


def _pairs_of(data: Any, where: str) -> int:
    """How many stages of a deploy name the connector defined at ``connectors.<key>`` (``where``) as an input (1 at
    least: an inline connector, or one no stage names here)."""
    key = where.removeprefix("connectors.") if where.startswith("connectors.") else None
    stages = data.get("stages") if isinstance(data, dict) else None
    if key is None or not isinstance(stages, list):
        return 1
    named = [s for s in stages if isinstance(s, dict) and isinstance(s.get("input_connectors"), dict)
             and key in s["input_connectors"].values()]  # fmt: skip
    return max(1, len(named))


def _deploy_policies(path: str) -> list[tuple[str, Any]]:
    """``(where, omni_accum_policy)`` of every connector extra of a deploy YAML that names one.

    Raises:
        OmniAccumError: the file cannot be read or parsed, or it is not a deploy YAML (no connector in it).
    """
    data = _read_deploy(path)
    found = [  # an empty value (None, '' or blanks) is the key left out, as the stages read it: OMNI_ACCUM_POLICY
        (w, v) for w, e in _connector_extras(data) if (v := setting_given(e, "omni_accum_policy")) is not None
    ]
    if not found and not _has_connectors(data):
        if isinstance(data, dict) and isinstance(data.get("stage_args"), list):
            return []  # a vllm-omni 0.16 stage config: its stages take the default connector, named nowhere
        raise OmniAccumError(
            f"--deploy {path}: not a vllm-omni deploy YAML (no connector in it: a key naming connectors, or an "
            "'extra' mapping); give the deploy YAML the server starts with (a policy file goes in "
            "OMNI_ACCUM_POLICY)"
        )
    return found


def _deploy_policy(path: str) -> tuple[Any, str]:
    """The ``omni_accum_policy`` of a deploy YAML's connectors, and where it is (raises when they differ)."""
    found = _deploy_policies(path)
    if not found:
        return None, f"{path}: no connector extra names omni_accum_policy"
    if len({_spec_key(v) for _, v in found}) > 1:
        raise OmniAccumError(_different(path, found))
    return found[0][1], f"{path}: {found[0][0]}.extra.omni_accum_policy"


def _spec_key(spec: Any) -> str:
    return json.dumps(spec, sort_keys=True, default=str)


def _different(path: str, found: list[tuple[str, Any]]) -> str:
    return (
        f"{path}: connectors name different policies ({', '.join(w for w, _ in found)}): every stage must run "
        "the same policy"
    )


def _has_connectors(node: Any) -> bool:
    """Whether a parsed YAML has anything of a deploy YAML's connectors (a key naming connectors, or an ``extra``)."""
    if isinstance(node, dict):
        return any(
            (isinstance(k, str) and ("connector" in k.lower() or k == "extra")) or _has_connectors(v)
            for k, v in node.items()
        )
    if isinstance(node, list):
        return any(_has_connectors(v) for v in node)
    return False


def _deploy_extras(path: str) -> list[tuple[str, dict[str, Any]]]:
    """Every connector ``extra`` mapping of a deploy YAML, with where it is ([] when unreadable)."""
    try:
        data = _read_deploy(path)
    except OmniAccumError:  # check_policy reports it
        return []
    return [(f"{w}.extra" if w else "extra", e) for w, e in _connector_extras(data)]


def check_policy(deploy: str | None) -> tuple[list[Check], dict[str, Any]]:
    """Checks of the policy (or, when the deploy YAML's connectors name different ones, of each of them)."""
    from omni_accum.policy import ENV_POLICY, load_policy

    info: dict[str, Any] = {}
    out: list[Check] = []
    env = os.environ.get(ENV_POLICY, "").strip()
    if deploy and env and env.lower() not in POLICY_OFF:
        # Each process loads OMNI_ACCUM_POLICY when omni-accum activates, before any connector's own policy.
        try:
            load_policy(env)
            out.append(Check("policy", True, f"{ENV_POLICY}={env!r} loads (connectors without a policy run it)"))
        except OmniAccumError as e:
            out.append(
                Check("policy", False, f"{ENV_POLICY}={env!r}: {e}", f"fix or unset {ENV_POLICY} (omni-accum validate)")
            )
    if not deploy:
        source = f"{ENV_POLICY}={env!r}" if env else f"{ENV_POLICY} is not set"
        return out + _policy_checks(env or None, source, info, env_checked=False), info
    try:
        found = _deploy_policies(deploy)
    except OmniAccumError as e:
        return out + [Check("policy", False, str(e), "give the deploy YAML the server starts with (--deploy FILE)")], info
    if not found:
        source = f"{deploy}: no connector extra names omni_accum_policy"
        return out + _policy_checks(None, source, info, env_checked=bool(out)), info
    distinct: dict[str, tuple[str, Any]] = {}
    for where, spec in found:
        distinct.setdefault(_spec_key(spec), (where, spec))
    if len(distinct) > 1:
        fix = "name the same omni_accum_policy in every connector extra (or none, and set OMNI_ACCUM_POLICY)"
        out.append(Check("policy", False, _different(deploy, found), fix))
    for where, spec in distinct.values():  # every policy named is checked, each finding reported
        out += _policy_checks(spec, f"{deploy}: {where}.extra.omni_accum_policy", info, env_checked=bool(out))
    return out, info


def _policy_checks(spec: Any, source: str, info: dict[str, Any], env_checked: bool) -> list[Check]:
    """The checks of one policy spec (None: none named; ``info["policy"]`` describes the first that loads)."""
    from omni_accum.policy import ENV_POLICY, load_policy
    from omni_accum.policy.environment import table_mismatches

    if spec is None and env_checked:
        return []
    if spec is not None and spec is not False and not isinstance(spec, (str, dict)):
        detail = (
            f"{source}: {spec!r} is not a policy: give a preset name, a policy file, inline YAML or a mapping "
            "(false or 'off': vllm-omni's own accumulation)"
        )
        return [Check("policy", False, detail, "fix omni_accum_policy in the deploy YAML")]
    if spec is None or spec is False or (isinstance(spec, str) and spec.strip().lower() in POLICY_OFF):
        fix = f"set {ENV_POLICY} (a preset, a file or inline YAML) or omni_accum_policy in the connector extra"
        detail = f"{source}: omni-accum will change nothing (vllm-omni's own accumulation)"
        return [Check("policy", True, detail, fix, warning=True)]
    try:
        policy = load_policy(spec)
    except OmniAccumError as e:
        return [Check("policy", False, f"{source}: {e}", "fix the policy (omni-accum validate POLICY)")]
    rules = [f"{r.match} -> {r.strategy}" for r in policy.rules]
    if policy.ab is not None:  # its own default and rules are the first arm's: name the split
        from omni_accum.integrations.vllm_omni.deployment import ab_shares, policy_summary

        arms = {n: {"policy": p, "share": s} for n, (p, s) in ab_shares(policy).items()}
        info.setdefault("policy", {"source": source, "ab": arms})
        out = [Check("policy", True, f"{source}: {policy_summary(policy)}")]
        if _family_name() == "0.16":
            first = next(iter(arms))
            out.append(Check(
                "policy", False,
                f"{source}: an A/B split, and vllm-omni 0.16's family has no send hook to split by: every request "
                f"would run the first arm ({first!r}) and omni-accum ab would find no series",
                "one policy (the arm you want), or the split on vllm-omni 0.28 / 0.30",
            ))  # fmt: skip
    else:
        info.setdefault("policy", {"source": source, "default": policy.default.strategy, "rules": rules})
        said = "; ".join(rules) or "no rules"
        out = [Check("policy", True, f"{source}: default {policy.default.strategy}; {said}")]
    out += _sent_keys_check(policy, source) + _run_checks(policy, spec, source)
    if policy.tuned is not None:
        diffs = table_mismatches(policy.tuned)
        if diffs:
            out.append(
                Check(
                    "tuned table",
                    False,
                    "measured in another environment, it will be ignored: " + "; ".join(diffs),
                    "re-run omni-accum tune in this environment (or --resume it)",
                )
            )
        else:
            out.append(Check("tuned table", True, "its fingerprint matches this environment"))
        partial = policy.tuned.partial_note()
        if partial:
            out.append(Check("tuned table", True, partial, "omni-accum tune --resume --out FILE", warning=True))
    return out


def _run_checks(policy: Any, spec: Any, source: str) -> list[Check]:
    """What ``validate`` checks beyond loading: what a ``Sender``/``Receiver`` refuses (the server binds no omni-accum
    then) and the glob rules an earlier glob covers; of an A/B split, those and the tuned tables of every arm (each
    runs as a policy of its own), each named with its arm. A plain policy's table is checked below."""
    from omni_accum.cli.validate import policy_problems, source_lines
    from omni_accum.manager import get_manager
    from omni_accum.policy.parsing import LineIndex

    where = spec if isinstance(spec, str) else "<mapping>"  # an arm's relative path is read beside the split first
    lines = source_lines(spec) if isinstance(spec, str) else LineIndex(None)
    errors, warns = policy_problems(policy, get_manager(), lines, source=where, tables=policy.ab is not None)
    fix = "fix the policy" + (" of that arm" if policy.ab is not None else "") + " (omni-accum validate POLICY)"
    out = []
    for p, warn in [(p, False) for p in errors] + [(p, True) for p in warns]:
        place = (f"line {p['line']}: " if p["line"] else "") + (f"{p['loc']}: " if p["loc"] else "")
        out.append(Check("policy", warn, f"{source}: {place}{p['msg']}", fix, warning=warn))
    return out


def _sent_keys_check(policy: Any, source: str) -> list[Check]:
    """A warning when none of the policy's rules and tuned cells matches a key the installed release sends."""
    from omni_accum.integrations.vllm_omni.families import family_for, installed_version
    from omni_accum.integrations.vllm_omni.families.keys import SENT_KEYS

    version = installed_version()
    fam = family_for(version)
    cells = policy.tuned.cells if policy.tuned is not None else []
    if fam is None or fam.name not in SENT_KEYS or not (policy.rules or cells):
        return []  # no supported release to compare with (check_versions says so), or nothing but a default
    sent = SENT_KEYS[fam.name]
    patterns = [r.match for r in policy.rules] + [c.key for c in cells]
    if any(fnmatch.fnmatchcase(k, p) for p in patterns for k in sent):
        from omni_accum.manager import get_manager

        accumulating = {s.name for s in get_manager().specs() if "append" in s.kinds} - {"cat"}  # cat: as vllm-omni
        growing = [r for r in policy.rules if r.strategy in accumulating]  # the rules that change an accumulation
        if growing and not any(fnmatch.fnmatchcase(k, r.match) for r in growing for k in sent):
            dead = ", ".join(f"{r.match} -> {r.strategy}" for r in growing)
            detail = (f"{source}: its accumulation rules ({dead}) match no key that vllm-omni {version} sends: on this "
                      "release they change nothing (the keys of another release's stream?)")
            fix = "a preset for this release's keys (qwen3-omni), or omni-accum explain POLICY --key embed.prefill"
            return [Check("policy keys", True, detail, fix, warning=True)]
        return []
    detail = (
        f"{source}: none of its {len(policy.rules)} rules and {len(cells)} tuned cells matches a key that vllm-omni "
        f"{version} sends, so every key takes the default ({policy.default.strategy}); it sends "
        + ", ".join(sorted(sent))
    )
    fix = (
        "write the rules for these keys (omni-accum explain POLICY --key embed.prefill), or tune on the stream this "
        "release sends (omni-accum tune's default workload)"
    )
    return [Check("policy keys", True, detail, fix, warning=True)]


def _family_name() -> str | None:
    """The release family of the installed vllm-omni (``"0.16"``), or None."""
    from omni_accum.integrations.vllm_omni.families import family_for, installed_version

    fam = family_for(installed_version())
    return fam.name if fam is not None else None
