#!/usr/bin/env bash
# Side-by-side benchmark: the original buffer server and rollout-buffer on the same databases.
#
#   tests/bench/compare.sh [OUTDIR] [bench.py options...]     (OUTDIR default /tmp/bench-cmp)
#
# Runs ../shared/bench/bench.py with both peers (original = ../shared/bench/peer_original.py,
# new = tests/bench/peer.py on this interpreter), scenarios small, large, idle, idle64k by
# default, 3 trials each, alternating peers, plus the floors; writes OUTDIR/cmp.json and
# OUTDIR/cmp.md and prints the table. Creates the original's venv (/tmp/benchvenv) if missing.
# Examples:  tests/bench/compare.sh /tmp/b --scenarios small --repeat 1
#            tests/bench/compare.sh /tmp/b --scenarios idle --set idle.groups=131072 \
#                --set idle.prompt_bytes=1024 --repeat 1     # 1M-row catch-up (ingest)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BENCH="${BENCH_DIR:-$(cd "$ROOT/../shared/bench" && pwd)}"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,13p' "$0"; exit 0; fi
OUT="${1:-/tmp/bench-cmp}"; shift || true
PY="${PYTHON:-python3}"
ORIGINAL_PY="${BENCH_ORIGINAL_PYTHON:-/tmp/benchvenv/bin/python}"
if ! "$ORIGINAL_PY" -c "import fastapi, uvicorn, numpy" 2>/dev/null; then
    VENV="$(dirname "$(dirname "$ORIGINAL_PY")")"
    echo "creating $VENV for the original ($BENCH/requirements-original.txt)"
    python3.11 -m venv "$VENV"
    "$VENV/bin/pip" install -q -r "$BENCH/requirements-original.txt"
fi
mkdir -p "$OUT"
export BENCH_ORIGINAL_PYTHON="$ORIGINAL_PY"
cd "$ROOT"
"$PY" "$BENCH/bench.py" --peer "original=$BENCH/peer_original.py" --peer "new=$PY $HERE/peer.py" \
    --workdir "$OUT/work" --json-out "$OUT/cmp.json" --md-out "$OUT/cmp.md" "$@"
