"""`profile_finetune` (HARLI §5's predictor) on a tiny real runner: every point measured where the
job's own unit sequence places its kinds, split as the policy computes it, errors per stage."""

from __future__ import annotations

import pytest

from backfill.engine.byte_tokenizer import ByteTokenizer
from backfill.engine.config import ModelConfig
from backfill.engine.weights import random_model
from backfill.finetune.config import FinetuneConfig
from backfill.finetune import profile
from backfill.finetune.profile import KIND_SEQUENCES, profile_finetune, step_time_by_kind
from backfill.policy.harli import HarliLatencyModel
from backfill.serving.build import build_runner
from backfill.serving.config import ServingConfig

SHARES, BATCHES, SEQLENS = (1.0, 0.5), (1, 2), (16, 128)
F, H, B, U = "forward", "head", "backward", "update"
HELD_OUT = ((3, 64, (F, F)), (1, 64, (F, H)), (2, 32, (H, B)), (3, 96, (B, U)), (1, 96, (U, F)), (2, 64, (H, H)))


@pytest.fixture(scope="module")
def profiled():
    # A smaller grid (the same code walks it); wider layers so a decode step is more than Python's overhead.
    patch = pytest.MonkeyPatch()
    patch.setattr(profile, "SHARES", SHARES)
    patch.setattr(profile, "BATCHES", BATCHES)
    patch.setattr(profile, "SEQLENS", SEQLENS)
    patch.setattr(profile, "HELD_OUT", HELD_OUT)
    patch.setattr(profile, "REMEASURE_ROUNDS", 1)  # a tiny model's steps are noisy: one round bounds the time
    config = ModelConfig.tiny(hidden_size=256, intermediate_size=1024, num_heads=4, num_kv_heads=2,
                              max_position_embeddings=1024)
    runner = build_runner(config, random_model(config, 0),
                          ServingConfig(policy="fcfs", kv_cache_gb=0.05, block_size=16, max_model_len=1024, device="cpu"))
    job = FinetuneConfig(batch_size=1, micro_batch_size=1, max_seq_len=512, max_steps=10_000,
                         checkpoint_every_steps=10_000)  # byte tokens: longer conversations
    try:
        yield profile_finetune(runner, ByteTokenizer(config.vocab_size), repeats=3, model_name="tiny", config=job,
                               log=lambda m: None)
    finally:
        patch.undo()


def test_every_point_is_measured_with_the_kinds_it_names(profiled):
    assert [(s, bs, seq) for s, bs, seq, _ in profiled.solo_points] == \
        [(s, bs, seq) for s in SHARES for bs in BATCHES for seq in SEQLENS]
    grid = [(bs, seq, kinds) for bs in BATCHES for seq in SEQLENS for kinds in KIND_SEQUENCES]
    assert len(profiled.colo_points) == len(grid) and len(profiled.held_out) == len(HELD_OUT)
    latency = profiled.latency
    for (bs, seq, kinds), point in zip(grid + list(HELD_OUT), profiled.colo_points + profiled.held_out):
        p_bs, p_seq, s_inf, s_ft, ms, mix = point
        assert (p_bs, p_seq) == (bs, seq) and set(mix) == set(kinds) and all(v > 0 for v in mix.values())
        # the split the policy would compute for these units: their time against the stage-1 step
        ft_ms = s_ft * latency.solo_ms(bs, seq, 1.0) / (1 - s_ft)
        assert s_inf == pytest.approx(1 - s_ft) and 0 < sum(mix.values()) <= ft_ms * (1 + 1e-9)
        assert ms > ft_ms
    # every grid point has its repeats, and those measured again for their spread have them twice
    again = set(profiled.remeasured)
    for (bs, seq, kinds), samples in zip(grid, profiled.colo_samples.values()):
        assert len(samples) == (6 if f"1.0,{bs},{seq},{'+'.join(kinds)}" in again else 3)
    assert len(profiled.solo_samples) == len(profiled.solo_points) and profiled.rejected >= 0


def test_stage_two_is_fitted_per_kind_and_errors_reported_per_stage(profiled, tmp_path):
    latency = profiled.latency
    assert set(latency.k1_kind) == {"forward", "head", "backward", "update"}
    assert min(latency.k1_kind.values()) <= latency.k1 <= max(latency.k1_kind.values())
    for name in ("grid", "solo", "colo", "held_out", "colo_kind_average", "held_out_kind_average",
                 "colo_share_only", "held_out_share_only"):
        assert latency.errors[name]["points"] > 0 and 0 <= latency.errors[name]["mean"] <= latency.errors[name]["max"]
    assert latency.errors["colo"] == latency.relative_errors(profiled.colo_points)
    assert latency.errors["grid"]["points"] == len(profiled.solo_points) + len(profiled.colo_points)
    assert set(profiled.unit_ms) == {"forward", "head", "backward", "update"}
    loaded = HarliLatencyModel.load(latency.save(tmp_path / "p.json"))
    assert loaded.k1_kind == latency.k1_kind and loaded.errors == latency.errors


def test_kind_weights_are_a_steps_time_by_kind(profiled):
    class Job:  # what step_time_by_kind reads of a job
        steps_done = 0

        @staticmethod
        def kinds_of_step(step):
            return ("forward",) * 4 + ("head",) * 2 + ("backward",) * 4 + ("update",)

    weights = step_time_by_kind(Job(), {"forward": 1.0, "head": 10.0, "backward": 3.0, "update": 5.0})
    assert weights == {"forward": 4.0, "head": 20.0, "backward": 12.0, "update": 5.0}


# --- robust points (pure: constructed repeats, no runner) ------------------------------------------

def _repeats(ms: float, n: int = 11, jitter: float = 0.01) -> list[tuple]:
    """n repeats of an interval of `ms`, spread evenly within +-jitter (as the walk returns them)."""
    return [(ms * (1 + jitter * (2 * i / (n - 1) - 1)), 0.0, {}) for i in range(n)]


def _solo_ms(bs: int, seq: int) -> float:
    return 1.2 * bs + 18.0 + 0.003 * bs * seq


def test_an_outlying_repeat_does_not_move_the_fit():
    shapes = [(bs, seq) for bs in (1, 2, 4) for seq in (32, 256, 512)]
    clean = {k: _repeats(_solo_ms(*k)) for k in shapes}
    disturbed = dict(clean)
    # a delayed wake-up: one repeat of one point 30% long, as in a disturbed solo point
    disturbed[(4, 512)] = clean[(4, 512)][:-1] + [(_solo_ms(4, 512) * 1.3, 0.0, {})]
    fit = {name: HarliLatencyModel(HarliLatencyModel.fit_solo(
        [(1.0, bs, seq, profile.point_of(reps)[0]) for (bs, seq), reps in data.items()]))
        for name, data in (("clean", clean), ("disturbed", disturbed))}
    assert len(profile.robust_repeats(disturbed[(4, 512)])) == 10  # the outlier is rejected
    for bs, seq in shapes + [(3, 128), (2, 384)]:
        assert fit["disturbed"].solo_ms(bs, seq, 1.0) == pytest.approx(fit["clean"].solo_ms(bs, seq, 1.0), rel=2e-3)
    # a mean of the repeats would have moved that point by about 3%
    mean = sum(r[0] for r in disturbed[(4, 512)]) / 11
    assert mean / _solo_ms(4, 512) - 1 > 0.025


def test_close_repeats_are_all_kept_and_spread_is_relative():
    reps = _repeats(20.0, jitter=0.015)
    assert profile.robust_repeats(reps) == reps  # within the 2% floor: nothing rejected
    assert profile.relative_spread(reps) == pytest.approx(1.4826 * 0.009, rel=0.01)  # MAD of the even spread: 0.9%
    assert profile.relative_spread(reps[:1]) == float("inf")


class _ScriptedWalk:
    """Answers each measure() with the next scripted repeats for each spec asked."""

    def __init__(self, rounds):
        self.rounds, self.asked = list(rounds), []

    def measure(self, specs, repeats):
        self.asked.append(list(specs))
        answer = self.rounds.pop(0)
        return [list(answer[spec]) for spec in specs]


def test_a_point_whose_repeats_disagree_is_measured_again_and_pooled():
    tight, wide = (1, 32, 1.0, ()), (2, 32, 0.6, ())
    colo = (1, 32, 1.0, ("forward",))
    wide_reps = [(30.0 * f, 0.0, {}) for f in (0.9, 0.95, 1.0, 1.05, 1.1)]  # 7% robust spread, over SOLO_SPREAD
    colo_reps = [(40.0 * f, 4.0, {"forward": 4.0}) for f in (0.95, 1.0, 1.05, 0.97, 1.03)]  # under COLO_SPREAD
    walk = _ScriptedWalk([{tight: _repeats(20.0), wide: wide_reps, colo: colo_reps},
                          {wide: _repeats(30.0, n=5)}, {wide: _repeats(30.0, n=5)}])
    measured, again = profile.measure_robustly(walk, [tight, wide, colo], [11, 5, 5])
    assert again == [1] and walk.asked[1] == [wide]
    assert len(measured[0]) == 11 and len(measured[2]) == 5 and len(measured[1]) > 5
    assert profile.relative_spread(profile.robust_repeats(measured[1])) <= profile.SOLO_SPREAD
