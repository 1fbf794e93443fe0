#!/usr/bin/env bash
# The main job (creates or reuses .venv first), on the stream vllm-omni 0.30.0 sends thinker -> talker
# (workload qwen3-omni-0.30):
#   1. tune it (context 1k/4k/8k/32k x concurrency 1/4/10): the decision table per key, each kept baseline with
#      its reason, the gain over what 0.30.0 does, and the tuned policy in out/tuned-policy.yaml;
#   2. where the time is on that stream: the prefill hand-off against a decode step over the wires, vllm-omni's
#      SharedMemoryConnector (shm) against omni-accum's arena (and its connector), sender and receiver in two
#      processes (8000 x concurrency 1);
#   3. what to deploy.
# Extra arguments go to `omni-accum tune` (e.g. --quick, --workload FILE, --out PATH); -h / --help prints this
# and exits (`omni-accum tune --help` lists tune's options).
#   OMNI_ACCUM_OUT   the folder of the tuned policy (default: out, made when missing)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# What step 1 tunes: the last --workload given (tune takes the last) or a --trace (tune refuses both together),
# else qwen3-omni-0.30, which is then passed to tune.
workload=""
trace=""
prev=""
usage() {  # the comment above, before anything is set up or run
  echo "usage: bash scripts/main.sh [TUNE_OPTION ...]"
  echo
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}
for a in "$@"; do
  case "$a" in
    --trace=*) trace="${a#--trace=}" ;;
    -h|--help) usage; exit 0 ;;
    --workload=*) workload="${a#--workload=}" ;;
  esac
  [ "$prev" = "--workload" ] && workload="$a"
  [ "$prev" = "--trace" ] && trace="$a"
  prev="$a"
done
source "$ROOT/scripts/env.sh"
cd "$ROOT"
OUT="${OMNI_ACCUM_OUT:-out}"
mkdir -p "$OUT"  # (tune refuses an --out whose folder is missing; this one is the job's own)
default=()
[ -z "$workload" ] && [ -z "$trace" ] && default=(--workload qwen3-omni-0.30)
what="${default[*]:-}"
[ -n "$workload" ] && what="--workload $workload"
[ -n "$trace" ] && what="${what:+$what }--trace $trace"
echo "== 1. omni-accum tune $what (accumulation per key)"
rc=0
omni-accum tune "${default[@]}" --out "$OUT/tuned-policy.yaml" "$@" || rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 3 ]; then exit "$rc"; fi
echo
echo "== 2. where the time is: the prefill hand-off and a decode step, per wire (8000 x c1, two processes)"
omni-accum bench --wire arena --workload qwen3-omni-0.30 --context-lens 8000 --concurrency 1 --repeats 1
cat <<'EOF'

== 3. what to deploy (vllm-omni 0.30.0, Qwen3-Omni, async_chunk)
* The time is on the wire, not in the accumulation: the prefill hand-off (chunk 0, the two [P+1, 2048] tensors
  embed.prefill and hidden_states.output) costs far more than a decode step over every wire (table 2), and no
  strategy beats 0.30.0's own handling of embed.decode beyond the noise (table 1: one row per step, taken
  and dropped by the talker).
* Connector: OmniAccumArenaConnector where the stages share a host (docs/arena.md; table 2 gives its ratio to
  SharedMemoryConnector here). Policy: the `qwen3-omni` preset (OMNI_ACCUM_POLICY=qwen3-omni), or none.
* The tuned policy of step 1 is for THIS machine: its fingerprint names this machine's torch, vllm-omni and device,
  and a serving machine whose fingerprint differs ignores its table as stale (with a warning). To deploy a
  tuned table, run `omni-accum tune` on the serving machine; otherwise deploy the preset above.
* The accumulation policies matter on other streams: older releases (qwen3-omni-seed, the 0.16-era flat
  keys; qwen3-omni-override-ids), chunked prefill (qwen3-omni-chunked-prefill) and the full-payload path
  (qwen3-omni-full-payload): `omni-accum tune --workload NAME`.
EOF
exit "$rc"
