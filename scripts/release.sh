#!/usr/bin/env bash
# Build omni-accum's sdist and wheel, check them, install the wheel into a clean virtual environment and
# run a smoke there, outside the source tree: what a user gets from `pip install omni-accum`.
#
#   scripts/release.sh [OUT_DIR]    the checked sdist and wheel are copied there (default: dist/)
#
#   OMNI_ACCUM_RELEASE_REF   the git commit to build (default: HEAD), exported with `git archive`: what is
#                            not committed is not released ("worktree": the working tree as it is)
#   PYTHON                   interpreter of the throwaway environments (default: python3)
#   OMNI_ACCUM_TORCH_INDEX   extra index the clean environment takes torch from (default: PyTorch's CPU
#                            wheels, https://download.pytorch.org/whl/cpu; empty: pip's own indexes only).
#                            torch is pinned to the version .venv runs, when there is one.
#
# Steps: `build` and `twine` go into a throwaway environment under a temporary folder (never into the
# project's dependencies); `python -m build` makes the sdist and, from it, the wheel; `twine check --strict`
# checks their metadata; the wheel must hold every policy preset and deploy example (package data); a clean
# environment gets the wheel (no vllm, no vllm-omni) and runs the `omni-accum` entry point (--version,
# strategies, validate and explain on the presets, doctor, a tiny bench) and loads every entry point the
# wheel declares. Nothing is left behind but OUT_DIR. Exits non-zero at the first step that fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${1:-}" in
  -h|--help)  # the comment above, before anything is built
    echo "usage: bash scripts/release.sh [OUT_DIR]"
    echo
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0 ;;
  -*) echo "release.sh: unknown option '$1' (usage: scripts/release.sh [OUT_DIR]; --help)" >&2; exit 2 ;;
esac
if [ "$#" -gt 1 ]; then
  echo "release.sh: one OUT_DIR at most, got $# arguments: $* (usage: scripts/release.sh [OUT_DIR])" >&2
  exit 2
fi
PY="${PYTHON:-python3}"
OUT="${1:-$ROOT/dist}"
TORCH_INDEX="${OMNI_ACCUM_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
REF="${OMNI_ACCUM_RELEASE_REF:-HEAD}"
if [ "$#" -gt 0 ] && [ ! -d "$OUT" ]; then
  echo "release.sh: OUT_DIR $OUT is not a folder (create it, or leave it out for dist/)" >&2
  exit 2
fi
# the commit to build, before anything is built
sha=""
if [ "$REF" != "worktree" ]; then
  sha="$(git -C "$ROOT" rev-parse --verify --quiet "$REF^{commit}")" || {
    echo "release.sh: OMNI_ACCUM_RELEASE_REF=$REF is not a commit of $ROOT (a commit, branch or tag; worktree:" \
         "the working tree as it is)" >&2
    exit 2; }
fi
TMP="$(mktemp -d "${TMPDIR:-/tmp}/omni-accum-release.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
step() { echo "[release] $*" >&2; }
fail() { echo "[release] FAILED: $*" >&2; exit 1; }

step "build tools (build, twine) in a throwaway environment"
"$PY" -m venv "$TMP/tools"
"$TMP/tools/bin/python" -m pip install -q build twine

SRC="$ROOT"
if [ "$REF" != "worktree" ]; then
  SRC="$TMP/src"
  mkdir -p "$SRC"
  git -C "$ROOT" archive --format=tar "$sha" | tar -x -C "$SRC"
  step "building commit ${sha:0:12} ($REF)"
  [ -z "$(git -C "$ROOT" status --porcelain --untracked-files=no)" ] \
    || step "note: the working tree has uncommitted changes; they are not in this build"
fi

step "python -m build (sdist, then the wheel from it)"
"$TMP/tools/bin/python" -m build --outdir "$TMP/dist" "$SRC" >"$TMP/build.log" 2>&1 \
  || { tail -n 40 "$TMP/build.log" >&2; fail "python -m build"; }
# setuptools says when a metadata form it reads is deprecated (the license table was): none may be left
if grep -n "SetuptoolsDeprecationWarning\|is deprecated" "$TMP/build.log" >&2; then
  fail "the build printed deprecation warnings (above)"
fi
shopt -s nullglob
sdists=("$TMP"/dist/*.tar.gz) wheels=("$TMP"/dist/*.whl)
[ "${#sdists[@]}" = 1 ] && [ "${#wheels[@]}" = 1 ] || fail "expected one sdist and one wheel in $TMP/dist"
WHEEL="${wheels[0]}"

step "twine check --strict"
"$TMP/tools/bin/python" -m twine check --strict "$TMP"/dist/*

step "package data: every policy preset and deploy example is in the wheel and the sdist"
"$TMP/tools/bin/python" - "$SRC" "$WHEEL" "${sdists[0]}" <<'EOF'
import sys, tarfile, zipfile
from pathlib import Path

root, wheel, sdist = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
in_wheel = set(zipfile.ZipFile(wheel).namelist())
in_sdist = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
missing = []
for f in sorted((root / "config").rglob("*.yaml")):
    rel = f.relative_to(root / "config").as_posix()
    if f"omni_accum/config/{rel}" not in in_wheel:
        missing.append(f"wheel: omni_accum/config/{rel}")
    if f"config/{rel}" not in in_sdist:
        missing.append(f"sdist: config/{rel}")
licenses = [n for n in in_wheel if n.endswith(".dist-info/licenses/LICENSE")]
if not licenses:
    missing.append("wheel: .dist-info/licenses/LICENSE")
if missing:
    sys.exit("missing: " + ", ".join(missing))
print(f"  {len(list((root / 'config').rglob('*.yaml')))} YAML files and the LICENSE in both")
EOF

step "a clean environment with the wheel (CPU torch; no vllm, no vllm-omni)"
"$PY" -m venv "$TMP/smoke"
SPY="$TMP/smoke/bin/python"
"$SPY" -m pip install -q --upgrade pip
torch_spec="torch"
if [ -x "$ROOT/.venv/bin/python" ]; then
  v="$("$ROOT/.venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
  [ -n "$v" ] && torch_spec="torch==$v"
fi
index=()
if [ -n "$TORCH_INDEX" ]; then
  if "$SPY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)' "$TORCH_INDEX/torch/" \
    >/dev/null 2>&1; then
    index=(--extra-index-url "$TORCH_INDEX")
  else
    step "note: $TORCH_INDEX cannot be reached from here; torch comes from pip's own indexes"
  fi
fi
# torch alone from the extra index (its dependencies, and the wheel's, from pip's own indexes)
"$SPY" -m pip install -q --no-deps "${index[@]}" "$torch_spec"
"$SPY" -m pip install -q "$WHEEL"

step "smoke (from $TMP, outside the source tree)"
cd "$TMP"
unset PYTHONPATH OMNI_ACCUM_POLICY
OA="$TMP/smoke/bin/omni-accum"
run() {  # run "what" cmd...: the command must exit 0 and print no traceback
  local what="$1"; shift
  local rc=0
  "$@" >"$TMP/out.txt" 2>&1 || rc=$?
  [ "$rc" = 0 ] || { cat "$TMP/out.txt" >&2; fail "$what (exit $rc)"; }
  ! grep -q "Traceback" "$TMP/out.txt" || { cat "$TMP/out.txt" >&2; fail "$what printed a traceback"; }
  sed 's/^/    /' "$TMP/out.txt" | head -n 12 >&2
}
"$SPY" -c 'import omni_accum, sys; assert sys.prefix in omni_accum.__file__, omni_accum.__file__'
version="$("$SPY" -c 'from importlib.metadata import version; print(version("omni-accum"))')"
run "omni-accum --version" "$OA" --version
grep -qx "omni-accum $version" "$TMP/out.txt" || fail "omni-accum --version does not say $version"
run "omni-accum strategies" "$OA" strategies
for s in cat token_list prealloc replace send_once; do
  grep -qw "$s" "$TMP/out.txt" || fail "omni-accum strategies does not list $s"
done
for preset in default qwen3-omni qwen3-omni-flat; do
  run "omni-accum validate $preset" "$OA" validate "$preset"
done
run "omni-accum explain qwen3-omni" "$OA" explain qwen3-omni --key embed.prefill --context-len 8000
grep -q "prealloc" "$TMP/out.txt" || fail "explain qwen3-omni --key embed.prefill does not name prealloc"
# doctor without vllm-omni: it says so (exit 1: not ready), never a traceback
set +e
"$OA" doctor >"$TMP/out.txt" 2>&1
rc=$?
set -e
sed 's/^/    /' "$TMP/out.txt" | head -n 12 >&2
[ "$rc" -le 2 ] || fail "omni-accum doctor exited $rc"
! grep -q "Traceback" "$TMP/out.txt" || fail "omni-accum doctor printed a traceback"
grep -qiE "vllm-omni.*not (installed|importable)|not installed.*vllm-omni|no vllm-omni|cannot import.*vllm" \
  "$TMP/out.txt" || fail "omni-accum doctor does not say that vllm-omni is missing"
run "entry points" "$SPY" - <<'EOF'
from importlib.metadata import distribution

import omni_accum
from omni_accum.integrations import vllm_omni

eps = [e for e in distribution("omni-accum").entry_points if e.group != "pytest11"]  # pytest11 needs pytest
for ep in eps:
    ep.load()  # every module and function the wheel declares imports without vllm / vllm-omni
groups = sorted({e.group for e in eps})
m = omni_accum.StrategyManager()  # the built-ins through their entry points, as a user's process loads them
assert {"cat", "token_list", "prealloc", "replace", "send_once"} <= set(m.names()), m.names()
assert not m.problems, m.problems
vllm_omni.activate_from_vllm()  # what every vLLM process runs (vllm.general_plugins): a no-op without vllm-omni
rx = omni_accum.Receiver("qwen3-omni")
import torch
view = rx.merge("r", {"embed": {"prefill": torch.ones(2, 4)}})
assert torch.equal(view["embed"]["prefill"], torch.ones(2, 4))
print(f"{len(eps)} entry points load ({', '.join(groups)}); strategies: {', '.join(m.names())}")
EOF

# the default workload, as a user's first `omni-accum bench` runs it (views checked against the cat reference)
run "omni-accum bench (tiny, inproc, cat against the wire floor)" "$OA" bench --arms cat wire-floor \
  --context-lens 16 --concurrency 1 --steps 2 --repeats 1 --no-progress

mkdir -p "$OUT"
cp "$TMP"/dist/* "$OUT"/
step "ok: $(basename "${sdists[0]}") and $(basename "$WHEEL") in $OUT"
