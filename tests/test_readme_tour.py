"""The README tour's fast commands on a fresh clone, with AVX2 forced and without
(scripts/readme_tour.py --fast; the whole tour is the script without --fast)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.tour
@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_the_fast_tour_commands_run_on_a_fresh_clone_and_show_progress(tmp_path):
    out = tmp_path / "tour.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "readme_tour.py"), "--fast", "--isa", "native",
                           "avx2", "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    import json

    outcomes = json.loads(out.read_text())
    assert {o["isa"] for o in outcomes} == {"native", "avx2"} and len(outcomes) >= 8
    assert all(o["first_output_s"] is not None and o["first_output_s"] <= 10 for o in outcomes)


def test_the_tour_reads_harvests_from_what_the_commands_print():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import readme_tour
    finally:
        sys.path.pop(0)
    assert readme_tour._harvest_demo("Harvested 1,234 offline tokens (61.7 tokens/s) in 20 s; ...") == 1234
    assert readme_tour._harvest_demo("Harvested no offline token in 20 s") == 0
    node = ("phase  ttft p99  tpot p99  preempt/req  ack p99  sigstop p99  layer p50  off tok/s  lost tok  "
            "reclaim/min  no loss\nvalve      38.7       6.1         0.71     3.77            -       0.83      "
            "977.7      3391         48.7      yes")
    assert readme_tour._harvest_node(node) == 977.7
    node12 = ("   phase  ttft p99  tpot p99  preempt/req  ack p99  sigstop p99  layer p50  off tok/s  lost tok  "
              "reclaim/min  reclaim p99  no loss\n   valve      38.7       6.1         0.71     3.77            -  "
              "     0.83       26.5         0          0.0            -      n/a")
    assert readme_tour._harvest_node(node12) == 26.5
    burst = "cfs-lent      120/900        800     30.0/50.0    4.0/9.0        12   55.1"
    assert readme_tour._harvest_burst(burst) == 12
    # every README tour line has its step, and every step is a README line
    readme = (REPO / "README.md").read_text()
    tour = readme.split("## A five-minute tour", 1)[1].split("## In Python", 1)[0]
    lines = {line.split("#")[0].strip() for line in tour.splitlines() if line.startswith("backfill ")}
    assert lines == {step.name for step in readme_tour.STEPS} == {step.name for step in readme_tour.README_STEPS}
