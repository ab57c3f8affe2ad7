#!/usr/bin/env bash
# The node / burst part of the device check (called by scripts/gpu_check.sh as part node-burst).
# Parts, in order, each under its own `timeout` inside one deadline (NODE_BURST_TOTAL_S, default 135 s):
#   imports     (15 s)  the node runtime and bench modules import without fastapi, pydantic, starlette,
#                       uvicorn, gguf, llguidance, ray (the device image lacks them)
#   cuda-tests  (20 s)  tests/memory on the GPU: a KV arena shared by
#                       CUDA IPC with another process, CUDA virtual memory map / unmap across spaces,
#                       elastic tensors in a neighbour's lent device memory and in pinned host memory
#   node        (60 s)  Valve on one GPU: online + offline engine processes (random weights, smollm2-135m
#                       shape, bf16, KV pool one CUDA IPC allocation); phases alone / valve / fifo:
#                       online P99 TTFT/TPOT vs alone, preemptions per online request, offline tok/s,
#                       reclamation latency                                   -> OUT/node.json
#   burst       (45 s)  AQUA on one GPU: 2x burst, FCFS vs CFS paging to pinned host / to a neighbour's
#                       device memory (CUDA IPC); gather/scatter GB/s vs the PCIe peak -> OUT/burst.json
# Then OUT/summary.json (rows for bench/gpu_summary.py) and OUT/summary.md; OUT/parts.json says what ran,
# what was skipped or failed and why. A failed part never stops the others; every process a part starts
# is stopped by the part itself (engine processes, the neighbour), and `timeout -k` ends a stuck one.
#
# Usage: scripts/gpu_check_node_burst.sh [--dry-run] OUT      (PYTHON: interpreter, default python3)
# NODE_BURST_DEVICE (default cuda), NODE_BURST_NODE_MODEL (random:smollm2-135m), NODE_BURST_SHAPE
# (smollm2-135m) exist so the script itself can be tried on a CPU with a tiny model.
# `timeout` signals the whole process group of a part, so a part cut short takes its engine
# processes and its neighbour with it.
set -uo pipefail
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
OUT=${1:?usage: scripts/gpu_check_node_burst.sh [--dry-run] OUT}
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TOTAL_S=${NODE_BURST_TOTAL_S:-135}
DEVICE=${NODE_BURST_DEVICE:-cuda}
NODE_MODEL=${NODE_BURST_NODE_MODEL:-random:smollm2-135m}
SHAPE=${NODE_BURST_SHAPE:-smollm2-135m}
NODE_S=${NODE_BURST_NODE_S:-6}     # seconds per node phase (60 for a verdict: gpu_check.sh --part node-burst)
BURST_S=${NODE_BURST_BURST_S:-4}   # seconds of the 2x burst
NODE_CAP=$(( NODE_S * 3 + 45 )); BURST_CAP=$(( BURST_S * 6 + 20 ))
export PYTHONUNBUFFERED=1

PARTS=(
  "imports|15|$PY -c 'import sys, backfill.bench.node_bench, backfill.bench.node_engines.engine_proc, backfill.bench.node_engines.online_engine, backfill.bench.node_engines.offline_engine, backfill.bench.device_burst, backfill.bench.node_burst_summary, backfill.bench.cuda_vmm, backfill.serving.scheduler; bad = [m for m in (\"fastapi\", \"pydantic\", \"starlette\", \"uvicorn\", \"gguf\", \"llguidance\", \"ray\") if m in sys.modules]; print(\"absent-on-device modules imported:\", bad or \"none\"); sys.exit(1 if bad else 0)'"
  "cuda-tests|20|BACKFILL_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider --junitxml=$OUT/cuda-tests.xml tests/memory"
  "node|$NODE_CAP|$PY -m backfill.bench.node_bench --device $DEVICE --model $NODE_MODEL --phases alone,valve,fifo --duration-s $NODE_S --warmup-s 2 --arrivals gamma:4:2 --json $OUT/node.json"
  "burst|$BURST_CAP|$PY -m backfill.bench.device_burst --device $DEVICE --shape $SHAPE --steady-s 1.5 --burst-s $BURST_S --json $OUT/burst.json"
)

if [ $DRY_RUN = 1 ]; then
  echo "gpu_check_node_burst: parts in order, each under its cap, all within ${TOTAL_S} s (OUT=$OUT):"
  for part in "${PARTS[@]}"; do
    IFS='|' read -r name cap cmd <<<"$part"
    echo "- $name (cap ${cap} s): $cmd"
  done
  # The imports part needs no device: run it, so a dry run shows the modules load without what
  # the device image lacks.
  IFS='|' read -r _ _ cmd <<<"${PARTS[0]}"
  bash -c "$cmd"
  exit $?
fi

mkdir -p "$OUT"
start=$(date +%s)
echo "{}" > "$OUT/parts.json"
record() {  # name outcome seconds detail
  "$PY" - "$OUT/parts.json" "$@" <<'EOF' || true
import json, sys
path, name, outcome, seconds, detail = sys.argv[1:6]
try:
    parts = json.load(open(path))
except (OSError, ValueError):
    parts = {}
parts[name] = {"outcome": outcome, "seconds": int(seconds), "detail": detail}
json.dump(parts, open(path, "w"), indent=2)
EOF
}
status=0
for part in "${PARTS[@]}"; do
  IFS='|' read -r name cap cmd <<<"$part"
  left=$(( TOTAL_S - ($(date +%s) - start) - 5 ))
  if [ "$left" -lt 15 ]; then
    record "$name" skipped 0 "no time left in the ${TOTAL_S} s deadline"
    echo "== $name: skipped, no time left"; status=1; continue
  fi
  limit=$(( cap < left ? cap : left ))
  echo "== $name (cap ${limit} s)"
  t0=$(date +%s)
  timeout -k 5 "$limit" bash -c "$cmd" > "$OUT/$name.log" 2>&1
  rc=$?
  took=$(( $(date +%s) - t0 ))
  if [ $rc -eq 0 ]; then outcome=ok; detail="";
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then outcome=timeout; detail="cut at ${limit} s; what it wrote so far is kept"; status=1
  else outcome=failed; detail="rc $rc: $(tail -n 1 "$OUT/$name.log" | tr -d '\t\n' | cut -c1-200)"; status=1; fi
  record "$name" "$outcome" "$took" "$detail"
  echo "   $outcome in ${took} s"; tail -n 3 "$OUT/$name.log" | sed 's/^/   | /'
done
timeout 20 "$PY" -m backfill.bench.node_burst_summary "$OUT" || status=1
echo "gpu_check_node_burst: $(( $(date +%s) - start )) s in all"
exit $status
