# Free-disk check before a build, sourced by env.sh, test.sh and benchmarks/e2e/setup_env.sh.
#
#   omni_accum_need_disk PATH GB WHAT [PATH GB WHAT ...]
#
# Succeeds when the file system that holds PATH (or its nearest existing parent) has at least GB
# gigabytes (10^9 bytes) free. Otherwise it prints one line naming WHAT, the path, the mount point,
# what is needed and what is free, and fails: a build that would run out of disk halfway stops before
# it starts, instead of failing inside pip with "No space left on device" after minutes of downloads.
# The sizes the callers ask for are what their builds leave on disk (measured), not a margin, so the
# check never refuses a build that would have fitted. OMNI_ACCUM_SKIP_DISK_CHECK=1 (or true, yes) turns it off.
# Several builds at once (test.sh builds up to four side by side): their needs are added up per file
# system, and the line names every build that shares the file system that is short.
omni_accum_need_disk() {
  case "$(printf '%s' "${OMNI_ACCUM_SKIP_DISK_CHECK:-}" | tr '[:upper:]' '[:lower:]' | tr -d '[:space:]')" in
    1|true|yes) return 0 ;;  # (the other switches' words)
  esac
  local -A need=() free=() whats=()
  local path gb what probe free_kb mount rc=0
  while [ $# -ge 3 ]; do
    path="$1" gb="$2" what="$3"
    shift 3
    probe="$path"
    while [ ! -e "$probe" ] && [ "$probe" != "/" ] && [ "$probe" != "." ]; do probe="$(dirname "$probe")"; done
    # POSIX output, 1024-byte blocks: "Filesystem 1024-blocks Used Available Capacity Mounted-on".
    free_kb="" mount=""
    read -r free_kb mount < <(df -Pk "$probe" 2>/dev/null | awk 'NR == 2 {print $4, $6}') || true
    [ -n "$free_kb" ] && [ -n "$mount" ] || continue  # df cannot tell (an odd file system): no refusal on a guess
    need[$mount]="$(awk -v a="${need[$mount]:-0}" -v b="$gb" 'BEGIN {print a + b}')"
    free[$mount]="$free_kb"
    whats[$mount]="${whats[$mount]:+${whats[$mount]}, }$what ($path, $gb GB)"
  done
  for mount in "${!need[@]}"; do
    if awk -v kb="${free[$mount]}" -v gb="${need[$mount]}" 'BEGIN {exit !(kb * 1024 < gb * 1e9)}'; then
      echo "[setup] not enough disk on $mount: about ${need[$mount]} GB needed for ${whats[$mount]};" \
        "$(awk -v kb="${free[$mount]}" 'BEGIN {printf "%.1f", kb * 1024 / 1e9}') GB free. Free some space there," \
        "or put the environments on a larger disk (OMNI_ACCUM_VENV, OMNI_ACCUM_VENV_028, OMNI_ACCUM_VENV_016," \
        "OMNI_ACCUM_E2E_VENV); OMNI_ACCUM_SKIP_DISK_CHECK=1 skips this check" >&2
      rc=1
    fi
  done
  return "$rc"
}
