#!/usr/bin/env bash
# Issue 36's before/after benchmarks, in one run: this checkout against another (default
# /work/base, with its own venv), and the original.
#
#   tests/bench/side_by_side.sh [OUTDIR] [BASE_CHECKOUT]      (defaults /tmp/bench-36, /work/base)
#
# 1. ../shared/bench/bench.py with three peers (original, base, new), scenarios small, large, idle
#    and idle64k, 3 trials each, peers alternating, plus the floors: the drain figures (ratios to
#    the original and to the splice floor), the empty-poll p99 with 5,000 pending groups (idle) and
#    the RSS per pending row (idle, idle64k). Writes OUTDIR/cmp.json and OUTDIR/cmp.md.
# 2. tests/bench/ingest_poll.py with base and new: a poll's p99 while a 20,000-row batch is
#    ingested, 3 runs each, alternating. Writes OUTDIR/ingest_poll.md.
# 3. tests/bench/pending_rss.py and tests/bench/poll_modules.py on both checkouts: the
#    accumulator's memory per pending row, and the modules one poll passes through. Writes
#    OUTDIR/pending_rss.json and OUTDIR/poll_modules.txt.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,17p' "$0"; exit 0; fi
OUT="${1:-/tmp/bench-36}"
BASE="${2:-/work/base}"
export BENCH_DIR="${BENCH_DIR:-/work/shared/bench}"
export BENCH_ORIGINAL_PYTHON="${BENCH_ORIGINAL_PYTHON:-/tmp/benchvenv/bin/python}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
mkdir -p "$OUT"
cd "$ROOT"
# a free port: another bench on the machine may hold bench.py's default
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$PY" "$BENCH_DIR/bench.py" --peer "original=$BENCH_DIR/peer_original.py" \
    --peer "base=$BASE/.venv/bin/python $BASE/tests/bench/peer.py" --peer "new=$PY $HERE/peer.py" \
    --port "$PORT" --workdir "$OUT/work" --json-out "$OUT/cmp.json" --md-out "$OUT/cmp.md"
"$PY" "$HERE/ingest_poll.py" --peers "base=$BASE/.venv/bin/python $BASE/tests/bench/peer.py,new" \
    --repeat 3 --workdir "$OUT/ingest" | tee "$OUT/ingest_poll.md"
for py in "$BASE/.venv/bin/python" "$PY"; do
    "$py" "$HERE/pending_rss.py"
done | tee "$OUT/pending_rss.json"
for py in "$BASE/.venv/bin/python" "$PY"; do
    (cd /tmp && "$py" "$HERE/poll_modules.py" 2>/dev/null | grep -v '^{')
done | tee "$OUT/poll_modules.txt"
