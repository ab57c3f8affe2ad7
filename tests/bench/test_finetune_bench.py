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


def test_the_simulation_runs_long_enough_for_its_p99_verdicts():
    import pytest

    from backfill.bench.finetune_bench import SIM_MIN_REQUESTS, sim_duration_s

    per_s = {0: 0.25, 1: 0.2}                       # round 1's trace is the sparser
    length = sim_duration_s(10.0, 2, lambda d, k: int(d * per_s[k]))
    assert int(length * 0.2) >= SIM_MIN_REQUESTS and int(length / 1.5 * 0.2) < SIM_MIN_REQUESTS
    assert sim_duration_s(400.0, 2, lambda d, k: int(d * per_s[k])) == 400.0
    with pytest.raises(ValueError):
        sim_duration_s(0.0, 1, lambda d, k: 100)


def test_the_closing_sentence_names_the_fastest_mode_within_the_target():
    from backfill.bench.finetune_bench import _table, closing

    rounds = {"solo": [{"samples_per_s": 0.0, "p99_tpot_ms": 30.0, "p99_itl_ms": 20.0, "completed": 40}],
              "static": [{"samples_per_s": 0.9, "p99_tpot_ms": 80.0, "p99_itl_ms": None, "completed": 40}],
              "pause-only": [{"samples_per_s": 0.5, "p99_tpot_ms": 31.0, "p99_itl_ms": 21.0, "completed": 40}]}
    table = _table(rounds, 45.0)
    assert table["static"]["p99_itl_ms"] is None
    text = closing(table, 1)
    assert text.startswith("Fastest finetuning within the decode target (45.0 ms P99 TPOT): pause-only, 0.500")
    assert "missed 1 (static: decode P99 TPOT, ms 80" in text
    thin = _table({k: [{**r[0], "completed": 5}] for k, r in rounds.items()}, 45.0)
    assert closing(thin, 1).startswith("No mode can be called fastest")
