#!/usr/bin/env bash
# Create or reuse a virtual environment with everything the main job and the tests need: CPU torch
# 2.13.0, vllm + vllm-omni of one release, the test tools, omni-accum itself (editable) and the example
# strategy plugin, Mooncake (the [mooncake] extra: its non-CUDA build, and the Debian libibverbs1 it links,
# installed with apt-get when running as root). Sourced by main.sh and test.sh.
#
#   OMNI_ACCUM_VENV           the environment's path (default: .venv)
#   OMNI_ACCUM_VLLM_VERSION   the vllm and vllm-omni release (default: 0.30.0, pyproject's [vllm] extra).
#                             Each vllm-omni release goes with the vllm of the same version; the
#                             supported ones are in docs/vllm-omni.md ("Supported vllm-omni releases").
#                             test.sh also builds .venv-028 with 0.28.0 and .venv-016 with 0.16.0 for the
#                             integration tests.
#   OMNI_ACCUM_SEED_VENV      an environment already set up (another release) whose packages a new
#                             environment starts from (default: .venv, when it is set up and this is
#                             another one): pip then fetches only what differs between the releases
#                             (vllm, vllm-omni and a few kernels packages) instead of ~6.5 GB, and its
#                             files are hard links to the seed's (a copy on another file system). "none": no seed.
#
# Downloads go through pip's cache (~/.cache/pip, or PIP_CACHE_DIR) as well, where pip keeps one.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OMNI_ACCUM_VENV:-$ROOT/.venv}"
VLLM_VERSION="${OMNI_ACCUM_VLLM_VERSION:-0.30.0}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.omni-accum-setup"
# What a new environment leaves on disk (measured on 2026-12-04): ~7 GB from scratch, ~1.5 GB started from a
# seed (hard links); the check stops a build that would not fit before pip starts (scripts/disk.sh).
source "$ROOT/scripts/disk.sh"
_omni_accum_sources() {
  cat "$ROOT/pyproject.toml"
  find "$ROOT/examples/plugins" -type f \( -name '*.py' -o -name pyproject.toml \) \
    -not -path '*/build/*' -not -path '*.egg-info/*' 2>/dev/null | sort | xargs cat 2>/dev/null
}
# Re-install when the project's metadata, the example plugins (installed non-editable), the release or this
# script change.
want="$( { echo "vllm $VLLM_VERSION"; _omni_accum_sources; cat "$ROOT/scripts/env.sh"; } | sha256sum | cut -c1-16)"

have="$(cat "$STAMP" 2>/dev/null || true)"
# A download the network cut short fails pip's whole command: run it again, up to 3 times (what it
# installed stays installed, so a second try fetches only the rest).
_omni_accum_retry() {
  local i
  for i in 1 2 3; do
    "$@" && return 0
    [ "$i" -lt 3 ] && echo "[setup] attempt $i failed; again in $((i * 15)) s: ${*: -1}" >&2 && sleep $((i * 15))
  done
  return 1
}

# Mooncake (the omni-accum[mooncake] extra) links libibverbs even for TCP: install the Debian package when
# root and missing; otherwise the Mooncake tests say exactly what is missing (and fail when CI=true).
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing libibverbs1 (Debian package; Mooncake's transfer engine links it)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1; } >/dev/null 2>&1 \
      || echo "[setup] warning: apt-get could not install libibverbs1; the Mooncake tests will fail (CI) or skip" >&2
  else
    echo "[setup] note: libibverbs1 is missing (apt-get install libibverbs1 as root); Mooncake cannot load" >&2
  fi
fi
if [ "$have" != "$want" ]; then
  started=$(date +%s)
  if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV (vllm + vllm-omni $VLLM_VERSION)" >&2
    SEED="${OMNI_ACCUM_SEED_VENV:-$ROOT/.venv}"
    pyver='import sys; print(sys.version_info[:2])'
    if [ "$SEED" != "none" ] && [ "$(cd "$SEED" 2>/dev/null && pwd)" != "$(mkdir -p "$VENV" && cd "$VENV" && pwd)" ] \
      && [ -s "$SEED/.omni-accum-setup" ] && [ -x "$SEED/bin/python" ] \
      && [ "$("$SEED/bin/python" -c "$pyver")" = "$("$PY" -c "$pyver")" ]; then
      omni_accum_need_disk "$VENV" 1.5 "a new environment started from $SEED" \
        || { rmdir "$VENV" 2>/dev/null; return 1 2>/dev/null || exit 1; }
      echo "[setup] starting $VENV from the packages of $SEED (pip fetches only what differs)" >&2
      "$PY" -m venv --without-pip "$VENV"
      purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
      src="$("$SEED/bin/python" -c "$purelib")" dst="$("$VENV/bin/python" -c "$purelib")"
      # Hard links where both are on one file system (~6.5 GB less on disk): pip never writes into an
      # installed file (it moves the old one away, or unlinks it, before writing), so the seed is untouched.
      cp -al "$src/." "$dst/" 2>/dev/null || { rm -rf "$dst" && mkdir -p "$dst" && cp -a "$src/." "$dst/"; }
    else
      omni_accum_need_disk "$VENV" 7 "a new environment from scratch" || { return 1 2>/dev/null || exit 1; }
      "$PY" -m venv "$VENV"
    fi
  fi
  echo "[setup] installing dependencies into $VENV (vllm + vllm-omni $VLLM_VERSION; from scratch: ~6.5 GB download, a few minutes)" >&2
  _omni_accum_retry "$VENV/bin/python" -m pip install -q --upgrade pip
  _omni_accum_retry "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  if [ "$VLLM_VERSION" = "0.30.0" ]; then
    _omni_accum_retry "$VENV/bin/python" -m pip install -q -e "$ROOT[vllm,test,plot,mooncake]"
  elif [ "$VLLM_VERSION" = "0.16.0" ]; then
    # vllm 0.16.0 pins torch 2.9.1 and transformers < 5: on top of 0.30.0's stack (the seed's, or installed
    # here), both releases go in without their dependencies, beside the CPU torch, with the few packages
    # their import needs that differ: transformers 4.57 (Qwen3-Omni's config) and the huggingface-hub it
    # takes, diskcache (vllm's structured output). transformers 4.57's Qwen2-VL processors, which vllm
    # imports, need torchvision importable; the registry has no CPU build for torch 2.13, and 0.16.2's
    # Python part imports beside it (its C ops do not load; nothing here uses them). 0.30.0's kernels
    # package breaks transformers 4.57's import: removed.
    _omni_accum_retry "$VENV/bin/python" -m pip install -q -e "$ROOT[vllm,test,plot,mooncake]"
    _omni_accum_retry "$VENV/bin/python" -m pip install -q --no-deps "vllm==$VLLM_VERSION" "vllm-omni==$VLLM_VERSION" \
      "transformers==4.57.6" "huggingface-hub==0.36.2" "diskcache==5.6.3" "torchvision==0.16.2"
    "$VENV/bin/python" -m pip uninstall -q -y kernels >/dev/null 2>&1 || true
  else
    # Another release than pyproject's [vllm] extra: pin both packages (torch stays the CPU build).
    _omni_accum_retry "$VENV/bin/python" -m pip install -q "torch==2.13.0" "vllm==$VLLM_VERSION" "vllm-omni==$VLLM_VERSION"
    _omni_accum_retry "$VENV/bin/python" -m pip install -q -e "$ROOT[test,plot,mooncake]"
  fi
  for plugin in "$ROOT"/examples/plugins/*/; do
    [ -f "$plugin/pyproject.toml" ] && _omni_accum_retry "$VENV/bin/python" -m pip install -q "$plugin"
  done
  # vllm pulls CUDA builds of these; beside the CPU torch they fail to load and break vllm_omni.
  for mod in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show -q "$mod" >/dev/null 2>&1 && ! "$VENV/bin/python" -c "import $mod" >/dev/null 2>&1; then
      echo "[setup] removing $mod (its CUDA build does not load beside the CPU torch)" >&2
      "$VENV/bin/python" -m pip uninstall -q -y "$mod"
    fi
  done
  echo "$want" > "$STAMP"
  echo "[setup] $VENV ready (vllm + vllm-omni $VLLM_VERSION) in $(( $(date +%s) - started )) s" >&2
fi
export PATH="$VENV/bin:$PATH"
