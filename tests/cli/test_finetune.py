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
