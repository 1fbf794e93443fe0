"""``omni-accum doctor``'s checks of the host a deploy runs on and of the deploy's shape: this user's private
directory for the same-host channels (``OMNI_ACCUM_ARENA_DIR``), the status folder (``OMNI_ACCUM_STATUS_DIR``),
and a deploy with no stage 0 (a fragment of ``config/deploy``, merged into a full deploy with ``base_config:``).
Every finding is a :class:`~omni_accum.cli.doctor_policy.Check`; nothing here creates a file or raises.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omni_accum.cli.doctor_policy import Check, _deploy_or_none

#: The connectors whose peer hellos go through the private directory (and, for the arena's, its regions).
SAME_HOST_CONNECTORS = ("SharedMemoryConnector", "OmniAccumArenaConnector")
#: vllm-omni 0.30.0's full Qwen3-Omni deploy, which the fragments of ``config/deploy`` are merged into.
BASE_DEPLOY = "deploy/qwen3_omni_moe.yaml"


def check_samehost(deploy: str | None, names: list[str]) -> list[Check]:
    """The private directory (:func:`omni_accum.samehost.private_dir`) when ``OMNI_ACCUM_ARENA_DIR`` is set or the
    deploy selects a same-host connector (``names``: the connectors it selects). Without it the arena connector
    makes no region and no peer hello is written or read over shared memory: every payload goes vllm-omni's way,
    nothing is left off the wire, no hand-off is timed; the stages only log it."""
    from omni_accum import samehost

    env = os.environ.get(samehost.ENV_DIR)
    uses = [n for n in SAME_HOST_CONNECTORS if n in names]
    if not env and not uses:
        return []
    problem = samehost.private_dir_problem()
    said = f"{deploy} selects {', '.join(uses)}: " if uses else ""
    if problem is None:
        where = samehost.base_dir() / f"omni-accum-{os.geteuid()}"
        what = "the arena's regions and the peer hellos" if "OmniAccumArenaConnector" in uses else "the peer hellos"
        return [Check("same-host directory", True, f"{said}{what} go in {where} ({samehost.describe_base()})")]
    lost = "OmniAccumArenaConnector makes no region (every payload goes through its inner SharedMemoryConnector) " \
        "and " if "OmniAccumArenaConnector" in uses else ""
    detail = (f"{said}{problem}: {lost}no peer hello is written or read over shared memory, so no stage leaves a value "
              "off the wire or times a hand-off")
    fix = (f"point {samehost.ENV_DIR} at an existing directory of this user (mode 0700) or of root with the sticky "
           f"bit (as /dev/shm), or unset it")
    relevant = bool(uses) or deploy is None  # a deploy over Mooncake only: its hellos go through the store
    return [Check("same-host directory", not relevant, detail, fix, warning=not relevant)]


def check_status_dir() -> list[Check]:
    """``OMNI_ACCUM_STATUS_DIR``: a folder each process can write its status file to (or make, mode 0700)."""
    from omni_accum.capture.writer import folder_problem
    from omni_accum.integrations.vllm_omni.reporting import ENV_STATUS_DIR

    raw = os.environ.get(ENV_STATUS_DIR, "").strip()
    if not raw:
        return []
    problem = folder_problem(raw, "status folder")
    if problem:
        return [Check("status files", False, f"{ENV_STATUS_DIR}={raw!r}: {problem}: no process writes its status file",
                      f"fix {ENV_STATUS_DIR} (a folder of this user that no other user may write to) or unset it")]
    return [Check("status files", True, f"{ENV_STATUS_DIR}={raw!r}: each process writes <pid>.json there")]


def base_deploy() -> Path | None:
    """vllm-omni's own full Qwen3-Omni deploy in this environment (None: not installed here)."""
    from importlib.util import find_spec

    try:
        spec = find_spec("vllm_omni")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / BASE_DEPLOY
    return path if path.is_file() else None


def _stage_ids(data: Any) -> list[Any] | None:
    stages = data.get("stages") if isinstance(data, dict) else None
    if not isinstance(stages, list):
        return None
    return [s.get("stage_id") for s in stages if isinstance(s, dict)]


def _release() -> str | None:
    """The installed vllm-omni's version (None: not installed)."""
    from omni_accum.policy.fingerprint import dist_version

    return dist_version("vllm-omni")


def _transfer_problem(deploy: str) -> str | None:
    """Why vllm-omni's own loader of a deploy's connectors (what every stage process runs at start) refuses the full
    deploy ``deploy``, or None (it reads it, or no vllm-omni of that format is installed here). The stage catches
    the error, logs a warning and goes on with no connector from the file: a misspelt reference, an ``extra:`` that
    is not a mapping or a ``name:`` that is not text was a "ready" deploy that ran without its connectors."""
    try:
        from vllm_omni.config.stage_config import resolve_deploy_yaml
        from vllm_omni.distributed.omni_connectors import load_omni_transfer_config
    except ImportError:
        return None  # no vllm-omni, or one that reads another format: check_versions and check_stages say so
    try:
        config = load_omni_transfer_config(config_dict=resolve_deploy_yaml(deploy))
    except Exception as e:  # noqa: BLE001 - whatever it raises, the stage process meets it
        return f"{type(e).__name__}: {e}"
    for (src, dst), spec in (getattr(config, "connectors", None) or {}).items():
        if not isinstance(getattr(spec, "name", None), str):
            return f"the connector of stage {src} -> {dst} has name {getattr(spec, 'name', None)!r}, not a name"
    return None


#: The keys of a 0.28 / 0.30 deploy YAML that vllm-omni 0.16.0's stage-config loader does not read.
NEW_FORMAT_KEYS = ("stages", "connectors", "base_config")


def check_stages(deploy: str | None) -> list[Check]:
    """A deploy whose ``stages:`` has no stage 0 (a fragment, such as those of ``config/deploy``): a note saying how
    to merge it (``base_config:``, which the loader of vllm-omni 0.28.0 and 0.30.0 follows); with ``base_config:``,
    the merged deploy as vllm-omni's own loader reads it (a base that cannot be read is a problem: the server does not
    start). Under vllm-omni 0.16, a deploy in that format is a problem: 0.16.0 reads ``stage_args:`` only."""
    data = _deploy_or_none(deploy)
    if not isinstance(data, dict):
        return []
    release = _release() or ""
    if release.startswith("0.16.") and "stage_args" not in data and (keys := [k for k in NEW_FORMAT_KEYS if k in data]):
        return [Check("deploy stages", False, f"{deploy}: a deploy in the format of vllm-omni 0.28 / 0.30 "
                      f"({', '.join(k + ':' for k in keys)}), and vllm-omni {release} is installed: its loader reads "
                      "stage_args: and refuses this file (Missing key stage_args)",
                      "write it as 0.16.0's own stage configs are written (stage_args:, e.g. <vllm_omni>/"
                      "model_executor/stage_configs/qwen3_omni_moe_async_chunk.yaml), or install vllm-omni 0.28.0 "
                      "or 0.30.0 to use this file")]  # fmt: skip
    base = data.get("base_config")
    if base is not None:
        try:
            from vllm_omni.config.stage_config import resolve_deploy_yaml

            data = resolve_deploy_yaml(deploy)
        except ImportError:
            return []  # no vllm-omni here: check_versions says so
        except Exception as e:  # noqa: BLE001 - whatever vllm-omni's loader raises, the server would too
            return [Check("deploy stages", False, f"{deploy}: base_config {base!r}: vllm-omni's loader cannot read "
                          f"it ({type(e).__name__}: {e})", "give base_config a deploy YAML that exists (a relative "
                          "path is read from the folder of this file)")]  # fmt: skip
    ids = _stage_ids(data)
    if ids is None or 0 in ids:
        refused = _transfer_problem(deploy) if ids else None
        if refused:
            return [Check("deploy connectors", False, f"{deploy}{' merged' if base is not None else ''}: vllm-omni's "
                          f"loader refuses its connectors ({refused}): vllm-omni {release or '0.30.0'} logs 'Failed to "
                          "load transfer config' and builds no stage connector from this file",
                          "each stage's input_connectors / output_connectors names a connector of connectors: (each "
                          "with a name: and an extra: mapping), or gives one inline: docs/vllm-omni.md")]  # fmt: skip
        merged = f"{deploy}: base_config {base!r} merged as vllm-omni reads it: stages {', '.join(map(str, ids or []))}"
        return [Check("deploy stages", True, merged)] if base is not None and ids else []
    full = base_deploy()
    line = f"base_config: {full or '<vllm_omni>/' + BASE_DEPLOY}"
    detail = (f"{deploy}: no stage 0 (its stages: {', '.join(map(str, ids)) or 'none'}): a fragment to merge into "
              "a full deploy, not one to start a server with")
    how = ("stages by stage_id, this file wins; its connectors: replace the base's whole" if release.startswith("0.28.")
           else "connectors by name, stages by stage_id; this file wins")
    fix = (f"add '{line}' at its top: vllm-omni {release or '0.30.0'} merges the two ({how}), docs/vllm-omni.md, "
           "'Merging a fragment'")
    return [Check("deploy stages", True, detail, fix, warning=True)]
