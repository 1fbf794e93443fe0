#!/usr/bin/env bash
# Run the test suite (creates or reuses .venv first). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
paths=(tests)
for d in examples/plugins/*/tests; do [ -d "$d" ] && paths+=("$d"); done
exec python -m pytest "${paths[@]}" "$@"
