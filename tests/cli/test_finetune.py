"""finetune run's estimate of the time left, from the pace of the run so far."""

from types import SimpleNamespace

from backfill.cli.finetune import time_left


def test_time_left_follows_the_pace_and_counts_a_step_in_flight():
    job = SimpleNamespace(progress_steps=0.0, total_steps=10)
    assert time_left(job, 0.0, 5.0) == "time left: measuring"
    job.progress_steps = 0.5                        # half a step in 30 s: 9.5 steps left at 60 s a step
    assert time_left(job, 0.0, 30.0) == "about 9.5 min left"
    job.progress_steps = 9.0                        # resumed at step 8: one step in 20 s, one left
    assert time_left(job, 8.0, 20.0) == "about 20 s left"


def test_samples_per_s_is_the_pace_of_recent_steps_not_the_whole_run():
    from backfill.cli.finetune import recent_samples_per_s

    start = 1000.0
    # 4 samples a step, 2 s a step for 10 steps, then 8 s a step (the machine slowed)
    times = [start + 2.0 * k for k in range(1, 11)] + [start + 20.0 + 8.0 * k for k in range(1, 6)]
    events = [{"step": i + 1, "time": t, "samples": 4} for i, t in enumerate(times)]
    assert recent_samples_per_s(events[:1], start) == 2.0          # the first step, timed from the start
    assert recent_samples_per_s(events[:10], start) == 2.0         # steady: not falling with elapsed time
    assert recent_samples_per_s(events, start, window_steps=5) == 0.5   # the last five steps' pace
    old = [{"step": 1, "time": start - 500.0, "samples": 4}]       # a resumed job's earlier run
    assert recent_samples_per_s(old, start) is None
    assert recent_samples_per_s(old + events[:2], start) == 2.0


def test_the_resume_command_is_the_command_line_quoted():
    from backfill.cli.finetune import resume_command

    assert resume_command(["finetune", "run", "--training-file", "my data.jsonl", "--out", "runs/ft1"]) == \
        "backfill finetune run --training-file 'my data.jsonl' --out runs/ft1"


def test_an_interrupted_run_prints_the_command_that_resumes_it(tmp_path):
    """A real `finetune run` on the tiny model, stopped by SIGTERM after its first step."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."},
                                                     {"role": "assistant", "content": w}]}) + "\n"
                            for w in ("one", "two", "three", "four")))
    argv = ["finetune", "run", "--random-weights", "--shape", "llama3.1-tiny", "--training-file", str(data), "--out", str(tmp_path / "ft"),
            "--steps", "100000", "--batch-size", "1", "--micro-batch-size", "1", "--checkpoint-every", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "backfill.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).resolve().parents[2],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step ") and "samples/s" in line or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    text = "".join(lines) + out
    assert proc.returncode == 130, text
    assert "Resume with:\n  backfill " + " ".join(argv) in text, text
