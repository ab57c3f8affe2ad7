#!/usr/bin/env bash
# The co-serving part of the device check (issue #25): on a model of Llama-3-8B's shape with random
# bf16 weights, bench coserve in strict mode (SLOs = online-only's own P99s) and with SLOs of
# 200 ms TTFT / 15 ms TPOT, one model load, online load 0.3, 40 s per mode and setting, one round.
# About 5-6 minutes on an H100/H200, model build and profile included. Writes into DIR:
#   coserve/frontier.md, coserve/frontier.json  the two settings side by side
#   coserve/load0.3-sloalone-alone/, coserve/load0.3-slo200-15/  each setting's report (report.md, JSON)
#   profile.json  the latency profile the policy planned with (measured on first use, cached)
#   env.txt  the device, torch and commit
# Usage: scripts/gpu_coserve_check.sh DIR   (gpu_check.sh calls it after the engine bench)
set -euo pipefail
DIR=${1:?usage: $0 DIR}
cd "$(dirname "$0")/.."
mkdir -p "$DIR"
PY=${PYTHON:-python}
MODEL=(--random-weights --shape llama3-8b --dtype bfloat16 --device cuda --kv-cache-gb 24)
{ git rev-parse --short HEAD 2>/dev/null || true; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  "$PY" -c "import torch; print('torch', torch.__version__)"; } > "$DIR/env.txt"
start=$(date +%s)
timeout 480 "$PY" -m backfill.cli bench coserve "${MODEL[@]}" --duration 40 --rounds 1 --warmup-s 10 \
  --online-load 0.3 --slos alone 200/15 --modes online-only priority coserve --out "$DIR/coserve" \
  2>&1 | tee "$DIR/coserve.log"
# The profile measured (or reused) for this device: the newest CUDA profile in the cache.
CACHE=${BACKFILL_CACHE_DIR:-$HOME/.cache/backfill}
newest=$(ls -t "$CACHE"/profiles/*-cuda-*.json 2>/dev/null | head -n 1 || true)
[ -n "$newest" ] && cp "$newest" "$DIR/profile.json"
echo "co-serving check: $(( $(date +%s) - start )) s" | tee -a "$DIR/env.txt"
