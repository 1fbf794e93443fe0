#!/bin/bash
# What an aborted request leaves in /dev/shm, in a real vllm-omni server on this host (benchmarks/e2e/README.md,
# "Aborted requests' chunks in /dev/shm").
#
#   bash benchmarks/e2e/abort_orphans.sh [DEPLOY]  (default: benchmarks/e2e/configs/qwen3_omni_cpu_arena_replicas.yaml)
#
# DEPLOY: a deploy YAML (a path, relative to the current folder or absolute), or NAME of
# benchmarks/e2e/configs/qwen3_omni_cpu_NAME.yaml (as run.py takes it, e.g. arena_replicas).
# Starts `vllm-omni serve` on the lean model (benchmarks/e2e/.work/model-lean: build_model.py --variant lean) with the
# deploy, omni-accum on (qwen3-omni) and VLLM_OMNI_INPUT_WAIT_TIMEOUT_S=30 (so the arena connector's orphan time is
# 60 s), sends 4 long requests whose client gives up after 6 s (vllm-omni aborts them), counts the new entries in
# /dev/shm every 20 s for 100 s, sends one full request, prints each stage process's connector row from omni-accum's
# status files, and stops the server's process group. Needs the harness's environment (setup_env.sh).
# Exit status: 0 when it ran; 1 when the server died or was not ready in 900 s (the server log's tail is printed);
# 2 for a bad argument, a deploy or the model or the environment missing (nothing is started).
set -u
usage() { sed -n '2,/^set -u$/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  -*) echo "abort_orphans.sh: unknown option '$1' (usage: bash benchmarks/e2e/abort_orphans.sh [DEPLOY]; -h: help)" >&2
      exit 2 ;;
esac
if [ $# -gt 1 ]; then
  echo "abort_orphans.sh: one DEPLOY at most, got $# arguments: $* (-h: help)" >&2
  exit 2
fi
CALLER=$PWD
cd "$(dirname "$0")/../.."
CONFIGS=$PWD/benchmarks/e2e/configs
DEPLOY=${1:-$CONFIGS/qwen3_omni_cpu_arena_replicas.yaml}
case "$DEPLOY" in
  /*) ;;
  *) if [ -e "$CALLER/$DEPLOY" ] || [ -L "$CALLER/$DEPLOY" ]; then DEPLOY=$CALLER/$DEPLOY
     elif [ -f "$CONFIGS/qwen3_omni_cpu_$DEPLOY.yaml" ]; then DEPLOY=$CONFIGS/qwen3_omni_cpu_$DEPLOY.yaml
     fi ;;
esac
if [ -d "$DEPLOY" ] || [ ! -f "$DEPLOY" ]; then
  names=$(cd "$CONFIGS" && ls qwen3_omni_cpu_*.yaml 2>/dev/null | sed 's/^qwen3_omni_cpu_//; s/\.yaml$//' | paste -sd, - \
          | sed 's/,/, /g')
  what=$([ -d "$DEPLOY" ] && echo "is a folder, not a deploy file" || echo "no such file")
  shown="'${1:-}'"; [ "$DEPLOY" = "${1:-}" ] || shown="$shown ($DEPLOY)"
  echo "abort_orphans.sh: DEPLOY $shown: $what (give a deploy YAML, or NAME of" \
       "benchmarks/e2e/configs/qwen3_omni_cpu_NAME.yaml: $names)" >&2
  exit 2
fi
V=benchmarks/e2e/.work/venv/bin
MODEL=$PWD/benchmarks/e2e/.work/model-lean
if [ ! -f "$MODEL/config.json" ]; then
  echo "abort_orphans.sh: no model at $MODEL (no config.json): build it first with" \
       "$V/python benchmarks/e2e/build_model.py --variant lean" >&2
  exit 2
fi
if [ ! -x "$V/python" ] || [ ! -x "$V/vllm-omni" ]; then
  echo "abort_orphans.sh: no harness environment at $PWD/${V%/bin} (bash benchmarks/e2e/setup_env.sh builds it)" >&2
  exit 2
fi
W=$(mktemp -d /tmp/omni-accum-abort.XXXXXX)
P=$($V/python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
mkdir -p "$W/status" "$W/prom"
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind OMNI_ACCUM_STATUS_DIR=$W/status \
  PROMETHEUS_MULTIPROC_DIR=$W/prom PATH=$PWD/$V:$PATH PYTHONUNBUFFERED=1 NO_PROXY=127.0.0.1,localhost \
  no_proxy=127.0.0.1,localhost OMNI_ACCUM_VLLM_OMNI=1 OMNI_ACCUM_POLICY=qwen3-omni OMNI_ACCUM_E2E_IDLE_SPIN_S=0.0 \
  OMP_WAIT_POLICY=PASSIVE VLLM_OMNI_INPUT_WAIT_TIMEOUT_S=30
# the entries the server makes at its start (vLLM's message queues, semaphores, the arena's private folder) are not
# counted: the baseline is taken once it is ready
new() { ls /dev/shm | grep -v -F -x -f "$W/shm0"; }
setsid "$V/vllm-omni" serve "$MODEL" --omni --host 127.0.0.1 --port "$P" --deploy-config "$DEPLOY" \
  --stage-init-timeout 900 > "$W/server.log" 2>&1 &
SP=$!
# the server's process group: SIGTERM, up to 20 s for it to end, then SIGKILL (at once when it is gone already)
stop_server() {
  kill -TERM -- "-$SP" 2>/dev/null || return 0
  for _ in $(seq 1 20); do kill -0 -- "-$SP" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- "-$SP" 2>/dev/null
}
trap stop_server EXIT
echo "deploy $DEPLOY; server pid $SP, port $P, log $W/server.log"
ready=""
for i in $(seq 1 450); do
  curl -s -m 2 "http://127.0.0.1:$P/health" >/dev/null && { ready=1; break; }
  if ! kill -0 "$SP" 2>/dev/null; then
    echo "the server (pid $SP) ended before it was ready, after about $((i * 2)) s; the end of $W/server.log:" >&2
    tail -n 30 "$W/server.log" >&2
    exit 1
  fi
  sleep 2
done
if [ -z "$ready" ]; then
  echo "the server did not answer /health in 900 s; the end of $W/server.log:" >&2
  tail -n 30 "$W/server.log" >&2
  exit 1
fi
echo "ready after about $((i * 2)) s"
ls /dev/shm > "$W/shm0"
body() { $V/python -c "import json,sys; print(json.dumps({'model': sys.argv[3], 'messages': [{'role': 'user', 'content': sys.argv[1]}], 'temperature': 0.0, 'max_tokens': int(sys.argv[2]), 'modalities': ['text', 'audio'], 'stream': False}))" "$1" "$2" "$MODEL" > "$W/body.json"; }
LONG=$($V/python -c "print(' '.join(['tell me a long story about the sea and the ships'] * 60))")
for n in 1 2 3 4; do
  body "$LONG $n" 200
  curl -s -m 6 -o /dev/null -w "request $n: client gave up (http %{http_code}) after %{time_total} s\n" \
    -H 'Content-Type: application/json' -d @"$W/body.json" "http://127.0.0.1:$P/v1/chat/completions"
  sleep 1
done
sleep 3
echo "new entries in /dev/shm after the aborts: $(new | wc -l) ($(new | grep -c _lockfile.lock) of them lock files)"
for t in 20 40 60 80 100; do sleep 20; echo "t+$t s: $(new | wc -l) new entries"; done
body "hello there" 16
curl -s -m 300 -o /dev/null -w "a full request: http %{http_code} in %{time_total} s\n" \
  -H 'Content-Type: application/json' -d @"$W/body.json" "http://127.0.0.1:$P/v1/chat/completions"
$V/python - "$W/status" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    d = json.load(open(f))
    for r in d.get("connectors") or []:
        keys = ("stage", "arena_puts", "inner_puts", "arena_gets", "inner_gets", "orphans_dropped", "aborted_unlinked",
                "fallbacks")
        print("pid", f.rsplit("/", 1)[1][:-5], {k: r.get(k) for k in keys})
PY
grep -a "no get took" "$W/server.log" | sed 's/^.*omni-accum arena: /omni-accum said: /'
stop_server; trap - EXIT
echo "after the stop: $(new | wc -l) entries in /dev/shm that were not there when the server was ready"
