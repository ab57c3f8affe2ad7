"""bench finetune on a fresh clone: the shipped predictor, and the error that names what to run."""

import subprocess
import sys

from backfill.bench.finetune_bench import shipped_latency


def test_the_default_model_has_a_shipped_predictor_and_others_none():
    latency = shipped_latency("SmolLM2-135M-Instruct.Q4_1")
    assert latency is not None and latency.unit_ms and latency.per_kind
    assert shipped_latency("no-such-model") is None


def test_sim_without_a_measured_profile_runs_on_the_shipped_one(tmp_path):
    out = subprocess.run([sys.executable, "-m", "backfill.cli", "bench", "finetune", "--sim", "--duration", "5",
                          "--rounds", "1", "--modes", "static,harli", "--out", str(tmp_path / "out")],
                         env={"BACKFILL_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin",
                              "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "simulating with the one shipped" in out.stdout and "| harli |" in out.stdout
