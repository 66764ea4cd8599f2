#!/usr/bin/env bash
# The cost of the training-data policies: rollout-buffer with every policy off and with every
# policy on, side by side in ONE bench.py run (peers alternate, 3 trials, medians).
#
#   tests/bench/policies.sh [OUTDIR] [bench.py options...]     (OUTDIR default /tmp/bench-policies)
#
# "on" sets a staleness bound no group reaches, the zero-variance filter (gen_rows' groups have
# distinct rewards), over-sampling by 1 (the database holds K sessions per group: none to drop),
# a minimum group size and the oldest_version serve order: every check runs on every group, and
# the drains stay comparable (the same groups are served). Scenarios: small, large, idle, idle64k.
# Example: tests/bench/policies.sh /tmp/bp --scenarios small,idle --repeat 3
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BENCH="${BENCH_DIR:-$(cd "$ROOT/../shared/bench" && pwd)}"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,11p' "$0"; exit 0; fi
OUT="${1:-/tmp/bench-policies}"; shift || true
PY="${PYTHON:-python3}"
ON="ROLLOUT_BUFFER_MAX_OFF_POLICY=1000000000 ROLLOUT_BUFFER_DROP_ZERO_VARIANCE=1 ROLLOUT_BUFFER_OVERSAMPLE=1"
ON="$ON ROLLOUT_BUFFER_MIN_GROUP_SIZE=2 ROLLOUT_BUFFER_SERVE_ORDER=oldest_version"
mkdir -p "$OUT"
cd "$ROOT"
"$PY" "$BENCH/bench.py" --peer "off=$PY $HERE/peer.py" --peer "on=env RB_PEER_ENV='$ON' $PY $HERE/peer.py" \
    --scenarios small,large,idle,idle64k --workdir "$OUT/work" --json-out "$OUT/policies.json" \
    --md-out "$OUT/policies.md" "$@"
