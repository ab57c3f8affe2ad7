"""The sampler moved into engine/runner.py (the step's last stage, beside the runner that makes its
logits). These names stay importable from here for serving/scheduler.py, which another change is
editing; once it imports them from engine/runner.py this module goes."""

from backfill.engine.runner import History, TokenLogprob, sample_picks

__all__ = ["History", "TokenLogprob", "sample_picks"]
