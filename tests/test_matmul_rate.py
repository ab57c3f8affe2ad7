"""scripts/matmul_rate.py: a rate per layer shape and row count, for F.linear and the small-batch kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from backfill.engine.small_batch_matmul import load_small_batch_matmul

ROOT = Path(__file__).resolve().parents[1]


def test_every_shape_gets_a_positive_rate_at_each_row_count(tmp_path):
    out = tmp_path / "rate.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "matmul_rate.py"), "--rows", "1", "3",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    table = json.loads(out.read_text())["gflop_s"]
    assert set(table) == {"qkv", "o", "gate_up", "down"}
    kinds = {"linear_gflop_s"} | ({"small_batch_gflop_s"} if load_small_batch_matmul() else set())
    for rows in table.values():
        assert set(rows) == {"1", "3"}
        assert all(set(e) == kinds and min(e.values()) > 0 for e in rows.values())
    assert "GFLOP/s" in done.stdout
