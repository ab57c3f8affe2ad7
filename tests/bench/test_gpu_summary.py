"""The device check's orchestration and summary, on the CPU: --dry-run, and the table built from the
outputs a run leaves (a real H200 run's engine JSON, a frontier, a part's summary.json, a timed-out part)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from backfill.bench.gpu_summary import check_imports, markdown, summarize

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "docs" / "results" / "h200-llama3-8b"


def test_dry_run_lists_every_part_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(out)],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for part in ("engine", "coserve", "harli-reef", "node-burst", "cuda-tests"):
        assert f"- {part} (cap " in done.stdout
    assert "import without" in done.stdout
    assert not out.exists()


def test_the_device_check_imports_none_of_what_the_device_lacks():
    assert check_imports() == []


def test_summary_folds_every_part_and_names_what_is_missing(tmp_path):
    (tmp_path / "engine").mkdir()
    shutil.copy(H200 / "engine-bench.json", tmp_path / "engine" / "engine-bench.json")
    (tmp_path / "coserve").mkdir()
    shutil.copy(H200 / "sim-frontier-corrected.json", tmp_path / "coserve" / "frontier.json")
    (tmp_path / "harli-reef").mkdir()
    (tmp_path / "harli-reef" / "summary.json").write_text(json.dumps(
        {"part": "harli-reef", "rows": [{"measure": "finetune tok/s", "value": "812", "reference": "pause-only 400"}],
         "skipped": ["DISB E: no time"]}))
    (tmp_path / "node-burst").mkdir()
    (tmp_path / "parts.tsv").write_text("engine\tok\t95\trc 0\ncoserve\tok\t120\trc 0\n"
                                        "harli-reef\tok\t60\trc 0\nnode-burst\ttimeout\t140\trc 124\n")
    summary = summarize(tmp_path)
    text = markdown(summary)
    assert "decode TPOT, batch 1, bfloat16, whole-step graphs | 6.59 ms (1.88x floor)" in text
    assert "coserve, load 0.3, SLOs 200.0/15.0 ms | 100.0% attainment" in text
    assert "| harli-reef | finetune tok/s | 812 | pause-only 400 |" in text
    assert "harli-reef: DISB E: no time" in summary.skipped
    assert any(s.startswith("node-burst: no figures (timeout") for s in summary.skipped)
