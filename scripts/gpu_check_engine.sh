#!/usr/bin/env bash
# The engine's GPU checks (docs/gpu.md): `bench engine` on the Llama-3-8B shape with the torch and
# the Triton kernels, then the CUDA runs of the kernel, sampler and graph tests. Writes to DIR:
#   engine-bench.json / .log   TPOT and tok/s per batch, greedy agreement graphs vs eager, triton vs torch
#                              and mixed_steps: decodes beside a prompt chunk, mixed-step graphs on and off
#   cuda-tests.json / .log     the tests' pass / fail / skip counts
# Usage: scripts/gpu_check_engine.sh DIR   (PYTHON=... picks the interpreter; default python)
set -uo pipefail
DIR=${1:?usage: scripts/gpu_check_engine.sh DIR}
PYTHON=${PYTHON:-python}
cd "$(dirname "$0")/.."
mkdir -p "$DIR"
status=0

nvidia-smi > "$DIR/nvidia-smi.txt" 2>&1 || true

"$PYTHON" -m backfill.cli bench engine --random-weights --shape llama3-8b --device cuda --dtypes bfloat16 --no-hf \
    --mixed-graphs --batches 1 8 32 64 --cuda-kernels torch triton --json "$DIR/engine-bench.json" 2>&1 | tee "$DIR/engine-bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

BACKFILL_TEST_DEVICE=cuda "$PYTHON" -m pytest -q -p no:cacheprovider --junitxml="$DIR/cuda-tests.xml" \
    tests/engine/test_triton_kernels.py tests/engine/test_device_sampler.py tests/engine/test_cuda_graphs.py \
    2>&1 | tee "$DIR/cuda-tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

"$PYTHON" - "$DIR" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
try:
    suite = ET.parse(out / "cuda-tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
except (OSError, ET.ParseError) as exc:
    counts = {"error": str(exc)}
(out / "cuda-tests.json").write_text(json.dumps(counts, indent=1))
print("cuda tests:", counts)
PY
exit $status
