#!/usr/bin/env bash
# Every device form on one lent GPU, in one call (docs/gpu.md): each part runs under its own time cap
# inside one overall deadline, writes JSON into OUT/<part>/, and a failed or skipped part is recorded,
# never fatal. At the end OUT/summary.md and OUT/summary.json hold one table of every part's figures.
#
# Usage: scripts/gpu_check.sh [--dry-run] OUT
#        scripts/gpu_check.sh [--dry-run] --part NAME OUT
#   --dry-run   list the parts, their caps and commands, and check that the Python side imports
#               without the server's dependencies; runs nothing on a device.
#   --part NAME one part sized for its verdict (>= 100 online requests for a P99, >= 60 s windows),
#               in one device call of its own; OUT/NAME/part.json records the commit and outcome.
#               `--dry-run --part list` lists the parts, their estimates and which cannot fit one call
#               (backfill/bench/gpu_parts.py plans them).
# Environment: PYTHON (default .venv/bin/python where it exists, else python3), BACKFILL_TOKENIZER (a tokenizer.json for random-weight
#   shapes; default .gpu/tokenizer when present), GPU_CHECK_TOTAL_S (overall deadline, default 585),
#   GPU_CHECK_PARTS (space-separated subset of the part names, default all).
set -uo pipefail
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
PART=""
if [ "${1:-}" = "--part" ]; then PART=${2:?--part needs a name (or list)}; shift 2; fi
OUT=${1:-}
[ -n "$OUT" ] || [ "$PART" = list ] || { echo "usage: scripts/gpu_check.sh [--dry-run] [--part NAME] OUT"; exit 2; }
cd "$(dirname "$0")/.."
# the checkout's venv where there is one (a development machine), else the image's python3 (the device)
if [ -x .venv/bin/python ]; then PY=${PYTHON:-$PWD/.venv/bin/python}; else PY=${PYTHON:-python3}; fi
export PYTHON=$PY  # the parts' own scripts run the same interpreter
TOTAL_S=${GPU_CHECK_TOTAL_S:-585}
if [ -z "${BACKFILL_TOKENIZER:-}" ] && [ -f .gpu/tokenizer/tokenizer.json ]; then
  export BACKFILL_TOKENIZER=$PWD/.gpu/tokenizer
fi
export PYTHONUNBUFFERED=1
MODEL_8B=(--random-weights --shape llama3-8b)

if [ -n "$PART" ]; then
  if [ "$PART" = list ]; then "$PY" -m backfill.bench.gpu_parts --list; exit $?; fi
  cmd=$("$PY" -m backfill.bench.gpu_parts --command "$PART") || exit $?   # exit 3: cannot fit one call
  cmd=${cmd//\$PY/$PY}
  P="$OUT/$PART"
  if [ $DRY_RUN = 1 ]; then echo "gpu_check --part $PART: ${cmd//\$P/$P}"; exit 0; fi
  mkdir -p "$P"
  CAP=${GPU_CHECK_PART_S:-560}
  echo "== $PART (cap ${CAP} s) at $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')"
  t0=$(date +%s)
  BACKFILL_TEST_DEVICE=cuda timeout -k 10 "$CAP" bash -c "${cmd//\$P/$P}" > "$P/log.txt" 2>&1
  rc=$?
  took=$(( $(date +%s) - t0 ))
  if [ $rc -eq 0 ]; then outcome=ok; elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then outcome=timeout; else outcome=failed; fi
  "$PY" -m backfill.bench.gpu_parts --record "$P" "$PART" "$outcome" "$took" "$rc"
  tail -n 6 "$P/log.txt"
  [ $rc -eq 0 ]; exit $?
fi

# name | cap in seconds | what it measures | command (OUT/<name> is $P)
PARTS=(
  "engine|130|engine decode at batch 1/8/32/64 against the weight-read floor, torch vs triton kernels, graphs vs eager, mixed-step graphs (Llama-3-8B shape, bf16)|$PY -m backfill.cli bench engine ${MODEL_8B[*]} --device cuda --dtypes bfloat16 --no-hf --mixed-graphs --batches 1 8 32 64 --cuda-kernels torch triton --json \$P/engine-bench.json"
  "coserve|140|co-serving at SLOs 200/15 ms and online load 0.3: online-only, priority, coserve (Llama-3-8B shape, bf16, 24 GiB KV)|$PY -m backfill.cli bench coserve ${MODEL_8B[*]} --dtype bfloat16 --device cuda --kv-cache-gb 24 --duration 20 --rounds 1 --warmup-s 5 --online-load 0.3 --slos 200/15 --modes online-only priority coserve --out \$P"
  "harli-reef|150|HARLI: decode + LoRA finetuning on green-context SM partitions vs pause-only at the decode QoS; REEF: DISB A RT P99 against RT-only on prioritized streams|HARLI_TIMEOUT_S=75 REEF_TIMEOUT_S=70 bash scripts/gpu_check_harli_reef.sh \$P"
  "node-burst|140|Valve: online and offline engine processes on one GPU (alone / valve / fifo); AQUA: 2x burst, CFS vs FCFS paging, transfer GB/s against the PCIe peak|bash scripts/gpu_check_node_burst.sh \$P"
  "cuda-tests|40|the engine's CUDA tests: Triton kernels, device sampler, CUDA graphs|$PY -m pytest -q -p no:cacheprovider --junitxml=\$P/cuda-tests.xml tests/engine/test_triton_kernels.py tests/engine/test_device_sampler.py tests/engine/test_cuda_graphs.py"
)

selected() { [ -z "${GPU_CHECK_PARTS:-}" ] || [[ " $GPU_CHECK_PARTS " == *" $1 "* ]]; }

if [ $DRY_RUN = 1 ]; then
  echo "gpu_check: parts in order, each under its cap, all within ${TOTAL_S} s (OUT=$OUT):"
  for part in "${PARTS[@]}"; do
    IFS='|' read -r name cap what cmd <<<"$part"
    selected "$name" || { echo "- $name: not selected (GPU_CHECK_PARTS)"; continue; }
    echo "- $name (cap ${cap} s): $what"
    echo "    ${cmd//\$P/$OUT/$name}"
  done
  # The Python side of every part must import without the server's dependencies.
  "$PY" -m backfill.bench.gpu_summary --check-imports || exit 1
  # Parts with scripts of their own list their sub-parts and check their imports the same way.
  for script in scripts/gpu_check_harli_reef.sh scripts/gpu_check_node_burst.sh; do
    if [ ! -f "$script" ]; then echo "missing: $script"; exit 1; fi
    if grep -q -- "--dry-run" "$script"; then bash "$script" --dry-run "$OUT/$(basename "$script" .sh)" || exit 1; fi
  done
  exit 0
fi

mkdir -p "$OUT"
start=$(date +%s)
{ git rev-parse --short HEAD 2>/dev/null || echo "no git"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" 2>&1
} > "$OUT/env.txt"
: > "$OUT/parts.tsv"
status=0
for part in "${PARTS[@]}"; do
  IFS='|' read -r name cap what cmd <<<"$part"
  selected "$name" || continue
  left=$(( TOTAL_S - ($(date +%s) - start) ))
  if [ "$left" -lt 20 ]; then
    printf '%s\tskipped\t0\tno time left in the %s s deadline\n' "$name" "$TOTAL_S" >> "$OUT/parts.tsv"
    echo "== $name: skipped, no time left"; continue
  fi
  limit=$(( cap < left ? cap : left ))
  P="$OUT/$name"; mkdir -p "$P"
  echo "== $name (cap ${limit} s): $what"
  t0=$(date +%s)
  BACKFILL_TEST_DEVICE=cuda timeout -k 10 "$limit" bash -c "${cmd//\$P/$P}" > "$P/log.txt" 2>&1
  rc=$?
  took=$(( $(date +%s) - t0 ))
  if [ $rc -eq 0 ]; then outcome=ok; elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then outcome=timeout; status=1; else outcome="failed"; status=1; fi
  printf '%s\t%s\t%s\trc %s\n' "$name" "$outcome" "$took" "$rc" >> "$OUT/parts.tsv"
  echo "   $outcome in ${took} s (rc $rc); last lines:"; tail -n 4 "$P/log.txt" | sed 's/^/   | /'
done
"$PY" -m backfill.bench.gpu_summary "$OUT" || status=1
echo "gpu_check: $(( $(date +%s) - start )) s in all"
exit $status
