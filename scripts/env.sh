#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) with everything the main job and the
# tests need: CPU torch 2.13.0 (what vllm 0.30.0 pins), vllm + vllm-omni 0.30.0, Mooncake (non-CUDA build, and
# the Debian libibverbs1 it links), the test tools,
# omni-accum itself (editable) and the example strategy plugin. Sourced by main.sh and test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OMNI_ACCUM_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.omni-accum-setup"
# Re-install when the project's metadata or the example plugins (installed non-editable) change.
want="$( { cat "$ROOT/pyproject.toml"; find "$ROOT/examples/plugins" -type f \( -name '*.py' -o -name pyproject.toml \) \
  -not -path '*/build/*' -not -path '*.egg-info/*' 2>/dev/null | sort | xargs cat 2>/dev/null; } | sha256sum | cut -c1-16)"

# Mooncake (the omni-accum[mooncake] extra) links libibverbs even for TCP: install the Debian package when
# root and missing; otherwise the Mooncake tests say exactly what is missing.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing libibverbs1 (Debian package; Mooncake's transfer engine links it)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1; } >/dev/null 2>&1 \
      || echo "[setup] warning: apt-get could not install libibverbs1; the Mooncake tests will fail or skip" >&2
  else
    echo "[setup] note: libibverbs1 is missing (apt-get install libibverbs1 as root); Mooncake cannot load" >&2
  fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing dependencies into $VENV (first run: ~6.5 GB download, a few minutes)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[vllm,test,plot,mooncake]"
  for plugin in "$ROOT"/examples/plugins/*/; do
    [ -f "$plugin/pyproject.toml" ] && "$VENV/bin/python" -m pip install -q "$plugin"
  done
  # vllm pulls CUDA builds of these; beside the CPU torch they fail to load and break vllm_omni.
  for mod in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show -q "$mod" >/dev/null 2>&1 && ! "$VENV/bin/python" -c "import $mod" >/dev/null 2>&1; then
      echo "[setup] removing $mod (its CUDA build does not load beside the CPU torch)" >&2
      "$VENV/bin/python" -m pip uninstall -q -y "$mod"
    fi
  done
  echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
