"""omni-accum's on/off environment switches (``OMNI_ACCUM_*``), read one way and strictly, and the stderr handler
that makes omni-accum's own log lines visible where nobody configured logging."""

from __future__ import annotations

import logging
import os

from omni_accum.errors import SettingError  # noqa: F401 - defined in errors.py; importable from here as before

ENV_LOG_LEVEL = "OMNI_ACCUM_LOG_LEVEL"
LOG_FORMAT = "%(levelname)s %(asctime)s [omni-accum pid=%(process)d] %(message)s"


def ensure_visible_logging(level: int | None = None, fmt: str = LOG_FORMAT) -> logging.Logger:
    """Give the ``omni_accum`` logger a stderr handler unless it (or an ancestor) already has one.

    Called when ``OMNI_ACCUM_TRACE_PLUGINS=1`` asks for hook traces (so a library process shows them)
    and by the CLI for ``-v``; an application's own handler is kept. ``level``: at most this level when
    given; otherwise the level is set only when unset, from ``OMNI_ACCUM_LOG_LEVEL`` (default INFO).
    """
    lg = logging.getLogger("omni_accum")
    if level is not None:
        if lg.level == logging.NOTSET or lg.level > level:
            lg.setLevel(level)
    bad = None
    if level is None and lg.level == logging.NOTSET:
        raw = os.environ.get(ENV_LOG_LEVEL, "INFO").strip() or "INFO"
        named = logging.getLevelName(raw.upper())
        lg.setLevel(named if isinstance(named, int) else logging.INFO)
        bad = None if isinstance(named, int) else raw
    if not lg.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(fmt))
        lg.addHandler(handler)
    if bad is not None:
        levels = "DEBUG, INFO, WARNING, ERROR, CRITICAL"
        lg.warning("omni_accum: %s=%r is not a log level (%s): INFO", ENV_LOG_LEVEL, bad, levels)
    return lg


# ---- On/off environment switches (OMNI_ACCUM_*): one reader, strict about values. A switch set to a value
# that is neither on (1, true, yes, on) nor off (0, false, no, off), case-insensitive, is an error naming the
# variable, its value and the accepted values: OMNI_ACCUM_VLLM_OMNI=disable must not leave omni-accum on, nor
# OMNI_ACCUM_REQUIRED=y off. Unset or empty: the switch's default.
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")

#: Every on/off switch omni-accum reads, with its default.
SWITCHES: dict[str, bool] = {
    "OMNI_ACCUM_VLLM_OMNI": True,
    "OMNI_ACCUM_REQUIRED": False,
    "OMNI_ACCUM_METRICS": True,
    "OMNI_ACCUM_ARENA_CONNECTOR": True,
    "OMNI_ACCUM_MOONCAKE_COMPAT": True,
    "OMNI_ACCUM_STRICT_PLUGINS": False,
    "OMNI_ACCUM_TRACE_PLUGINS": False,
}


def log_level_problem() -> str | None:
    """``OMNI_ACCUM_LOG_LEVEL`` set to what is not a log level (each process then logs at INFO, with a warning), or
    None."""
    raw = os.environ.get(ENV_LOG_LEVEL, "").strip()
    if not raw or isinstance(logging.getLevelName(raw.upper()), int):
        return None
    levels = "DEBUG, INFO, WARNING, ERROR, CRITICAL"
    return f"{ENV_LOG_LEVEL}={raw!r} is not a log level ({levels}): each process logs at INFO"


def env_flag(name: str, default: bool | None = None) -> bool:
    """The on/off value of environment variable ``name`` (unset or empty: ``default``, else the value in
    :data:`SWITCHES`). Raises SettingError for any other value."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return SWITCHES.get(name, False) if default is None else default
    value = raw.strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    raise SettingError(
        f"environment variable {name}={raw!r} is neither on ({', '.join(ON)}) nor off ({', '.join(OFF)})"
    )


def switch_problems() -> list[str]:
    """The message of every switch in :data:`SWITCHES` set to a value that is neither on nor off."""
    out = []
    for name in SWITCHES:
        try:
            env_flag(name)
        except SettingError as e:
            out.append(str(e))
    return out


def check_switches() -> None:
    """Raise SettingError naming every switch set to a value that is neither on nor off."""
    problems = switch_problems()
    if problems:
        raise SettingError("; ".join(problems))


def _env_flag(name: str) -> bool:
    return env_flag(name, False)  # SettingError (an OmniAccumError) for a value neither on nor off
