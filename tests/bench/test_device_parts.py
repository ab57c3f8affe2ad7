"""The HARLI and REEF device-check parts: --dry-run through the script, and each part run for real
on the CPU (tiny sizes), where its JSON and summary.json must come out whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backfill.bench import harli_device, reef_device

ROOT = Path(__file__).resolve().parents[2]


def test_the_script_lists_both_parts_on_a_dry_run(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "scripts/gpu_check_harli_reef.sh"), "--dry-run", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHON=sys.executable))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("HARLI on cuda") for line in lines) and any(line.startswith("REEF DISB A") for line in lines)
    assert not (tmp_path / "summary.json").exists()  # a dry run runs nothing


def test_the_parts_need_none_of_the_servers_dependencies():
    code = ("import sys, backfill.bench.harli_device, backfill.bench.reef_device, backfill.realtime.cuda_scheduler, "
            "backfill.engine.green_context, backfill.finetune.profile, backfill.bench.realtime_bench;"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'pydantic', 'gguf', 'llguidance', 'ray'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_harli_part_runs_on_the_cpu(tmp_path):
    assert harli_device.main(["--out", str(tmp_path), "--device", "cpu", "--shape", "llama3.1-tiny", "--batch", "2",
                              "--context", "32", "--seconds", "1.5", "--kv-gb", "0.02"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    result = json.loads((tmp_path / "harli_device.json").read_text())
    assert "error" not in result, result.get("error")
    measures = [r["measure"] for r in summary["rows"]]
    assert "HARLI partition path" in measures and "HARLI decode solo P99 step" in measures
    assert result["partitions"]["form"] in ("cores", "time-sliced")
    for mode in ("pause-only", "partitioned"):
        assert mode in result or any(mode in s for s in summary["skipped"])


@pytest.mark.slow
def test_reef_part_runs_on_the_cpu(tmp_path):
    assert reef_device.main(["--out", str(tmp_path), "--device", "cpu", "--size", "tiny", "--workloads", "A,Z",
                             "--duration", "1", "--rounds", "1"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert any(r["measure"].startswith("REEF DISB A reef") for r in summary["rows"])
    assert any("DISB Z" in s for s in summary["skipped"])  # a bad workload is reported, not fatal


@pytest.mark.skipif(os.environ.get("BACKFILL_TEST_DEVICE", "cpu") != "cuda",
                    reason="green contexts need a CUDA device (BACKFILL_TEST_DEVICE=cuda)")
def test_harli_part_runs_on_green_contexts(tmp_path):
    assert harli_device.main(["--out", str(tmp_path), "--device", "cuda", "--shape", "llama3.1-tiny", "--batch", "4",
                              "--context", "64", "--seconds", "2", "--kv-gb", "0.5"]) == 0
    result = json.loads((tmp_path / "harli_device.json").read_text())
    assert "error" not in result, result.get("error")
    assert result["partitions"]["form"] == "green-context" and result["partitions"]["path"] in ("driver", "torch")
    assert result["partitioned"]["decode_steps"] > 0 and result["partitioned"]["finetune_steps"] > 0
