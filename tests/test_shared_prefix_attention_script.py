"""scripts/shared_prefix_attention.py: the attention kernels' paths over a shared prefix, per dtype."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backfill.engine.paged_attention import load_paged_decode_attention, load_paged_prompt_attention

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(load_paged_decode_attention() is None or load_paged_prompt_attention() is None,
                    reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_path_gets_a_time_and_fp32_leaves_the_tiles_out(tmp_path, dtype):
    out = tmp_path / "paths.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "shared_prefix_attention.py"), "--dtype", dtype,
                           "--prefix-tokens", "64", "--sequences", "4", "--own-tokens", "8", "--chunks", "2",
                           "--chunk-tokens", "5", "--pool-blocks", "64", "--rounds", "1", "--calls", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["config"]["dtype"] == dtype
    times = report["median_ms_per_layer"]
    vector_paths = {"decode, each table alone", "decode, prefix once, vectors", "prompt, vectors"}
    tile_paths = {"decode, prefix once, tiles", "prompt, prefix on tiles"}
    assert set(times) == (vector_paths if dtype == "float32" else vector_paths | tile_paths)
    assert all(ms > 0 for ms in times.values())
    assert "ms per layer" in done.stdout
