"""`backfill finetune run` on the real default model (SmolLM2-135M), through the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_cli_finetunes_the_default_model_and_resumes(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is the code word {i}?"},
        {"role": "assistant", "content": f"The code word {i} is zebra-{i}."}]}) for i in range(4)) + "\n")
    cmd = [sys.executable, "-m", "backfill.cli", "finetune", "run", "--training-file", str(data), "--out", str(tmp_path / "job"),
           "--steps", "2", "--batch-size", "2", "--micro-batch-size", "1", "--max-seq-len", "64",
           "--checkpoint-every", "1", "--rank", "4", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    assert "step     2/2" in first.stdout
    events = [json.loads(line) for line in (tmp_path / "job/events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events] == [1, 2] and all(e["loss"] > 0 for e in events)
    tensors = load_file(str(tmp_path / "job/adapter/adapter_model.safetensors"))
    assert len(tensors) == 30 * 7 * 2  # every layer, every projection, A and B
    config = json.loads((tmp_path / "job/adapter/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] and config["r"] == 4
    # Run again: the job is finished already; nothing is redone.
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert again.returncode == 0 and "from step 2" in again.stdout
    # A bad file fails with a clear message and exit code 2.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    failed = subprocess.run(cmd[:6] + [str(bad)] + cmd[7:], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert failed.returncode == 2 and "line 1: no assistant message" in failed.stderr
