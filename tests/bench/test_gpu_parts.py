"""The device check split into one-call parts (bench/gpu_parts.py), planned and recorded on the CPU."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from backfill.bench import gpu_parts

ROOT = Path(__file__).resolve().parents[2]


def test_coserve_parts_are_sized_for_a_p99_and_the_one_that_cannot_fit_says_so(capsys):
    parts = {p.name: p for p in gpu_parts.parts()}
    for load in (0.3, 0.6, 0.1):
        part = parts[f"coserve-{load}"]
        duration = float(re.search(r"--duration (\d+)", part.command).group(1))
        assert duration >= gpu_parts.MIN_WINDOW_S
        assert gpu_parts.online_requests(load, duration) >= gpu_parts.MIN_ONLINE_REQUESTS
        assert gpu_parts.online_requests(load, duration - 10) < gpu_parts.MIN_ONLINE_REQUESTS or duration == 60
    # A tenth of the load needs three times the window: three modes of it do not fit one call.
    assert parts["coserve-0.3"].fits and parts["coserve-0.6"].fits and not parts["coserve-0.1"].fits
    assert gpu_parts.main(["--command", "coserve-0.1"]) == 3
    assert "cannot fit one call" in capsys.readouterr().err
    assert all(p.fits for name, p in parts.items() if name != "coserve-0.1")
    assert "CANNOT FIT" in gpu_parts.listing()


def test_a_part_records_the_commit_it_ran(tmp_path):
    entry = gpu_parts.record(tmp_path / "coserve-0.3", "coserve-0.3", "ok", 312, 0, root=ROOT)
    written = json.loads((tmp_path / "coserve-0.3" / "part.json").read_text())
    assert written == entry
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert written["commit"] == head and len(head) == 40
    assert written["outcome"] == "ok" and written["plan"]["name"] == "coserve-0.3"
    assert gpu_parts.record(tmp_path / "x", "x", "failed", 1, 2, root=tmp_path)["commit"] == "unknown"  # no git


def test_the_script_prints_a_parts_command_on_a_dry_run_and_runs_nothing(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--part", "coserve-0.6",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"--out {tmp_path}/coserve-0.6 " in done.stdout and f"{sys.executable} -m backfill.cli" in done.stdout
    assert "$P" not in done.stdout and not (tmp_path / "coserve-0.6").exists()
    cannot = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--part", "coserve-0.1",
                             str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert cannot.returncode == 3 and "cannot fit" in cannot.stderr
