#!/usr/bin/env bash
# HARLI on green contexts and REEF on CUDA streams, each under its own `timeout` (docs/gpu.md).
# Writes to DIR: harli_device.json / .log, reef_device.json / .log and summary.json (rows and what
# was skipped, written after every row). Needs none of the server's dependencies.
#   harli: python -m backfill.bench.harli_device --out DIR   (llama3.2-3b random weights, decode at its
#          QoS beside finetuning: green-context partitioned vs pause-only; about 60 s on an H200)
#   reef:  python -m backfill.bench.reef_device --out DIR    (DISB A, then B-E while its 45 s budget
#          lasts: RT P99 against RT-only; about 60-75 s)
# Usage: scripts/gpu_check_harli_reef.sh [--dry-run] DIR   (PYTHON=... picks the interpreter; default python3)
set -uo pipefail
DRY=""
if [ "${1:-}" = "--dry-run" ]; then DRY="--dry-run"; shift; fi
DIR=${1:?usage: scripts/gpu_check_harli_reef.sh [--dry-run] DIR}
PYTHON=${PYTHON:-python3}
DEVICE=${BACKFILL_CHECK_DEVICE:-cuda}
cd "$(dirname "$0")/.."
status=0
if [ -n "$DRY" ]; then
    "$PYTHON" -m backfill.bench.harli_device --out "$DIR" --device "$DEVICE" --dry-run || status=1
    "$PYTHON" -m backfill.bench.reef_device --out "$DIR" --device "$DEVICE" --dry-run || status=1
    exit $status
fi
mkdir -p "$DIR"
timeout -k 10 ${HARLI_TIMEOUT_S:-150} "$PYTHON" -m backfill.bench.harli_device --out "$DIR" --device "$DEVICE" \
    2>&1 | tee "$DIR/harli_device.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; echo "harli_device ended with ${PIPESTATUS[0]} (124: timed out)"; }
timeout -k 10 ${REEF_TIMEOUT_S:-150} "$PYTHON" -m backfill.bench.reef_device --out "$DIR" --device "$DEVICE" \
    2>&1 | tee "$DIR/reef_device.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; echo "reef_device ended with ${PIPESTATUS[0]} (124: timed out)"; }
exit $status
