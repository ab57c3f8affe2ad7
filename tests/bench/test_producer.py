"""The producer engine process (a tiny model, no coordinator): its report rows carry what the
burst benchmark measures it by, and the counters only grow."""

import json
import subprocess
import sys


def test_producer_reports_tokens_steps_and_core_times():
    proc = subprocess.Popen([sys.executable, "-m", "backfill.bench.producer", "--tiny", "--report-every-s", "0.2",
                             "--prompt-tokens", "8", "--output-tokens", "8"], stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] is True and ready["offer_id"] is None
        rows = [json.loads(proc.stdout.readline()) for _ in range(4)]
    finally:
        proc.terminate()
        proc.wait(60)
    assert all({"t", "tokens", "steps", "run_s", "wait_s"} <= set(r) for r in rows)
    for a, b in zip(rows, rows[1:]):
        assert b["t"] > a["t"] and b["tokens"] >= a["tokens"] and b["steps"] > a["steps"]
        assert b["run_s"] >= a["run_s"] and b["wait_s"] >= a["wait_s"]
    assert rows[-1]["tokens"] > rows[0]["tokens"]     # 4 requests of 8 tokens, resubmitted as they finish
    assert rows[-1]["run_s"] > 0.0                    # Linux schedstat: the engine thread's time on a core
