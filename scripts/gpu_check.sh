#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one call: results land in DIR (docs/gpu.md).
# Usage: scripts/gpu_check.sh DIR
set -uo pipefail
DIR=${1:?usage: scripts/gpu_check.sh DIR}
here="$(dirname "$0")"
status=0
bash "$here/gpu_check_engine.sh" "$DIR/engine" || status=1
bash "$here/gpu_coserve_check.sh" "$DIR" || status=1
exit $status
