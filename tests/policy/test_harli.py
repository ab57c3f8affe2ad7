"""HARLI's predictor and QoS policy on constructed states."""

from __future__ import annotations

import math

import pytest

from backfill.errors import PolicyInputError
from backfill.policy.harli import (ColoState, HarliLatencyModel, HarliPolicy, PauseOnlyPolicy, SoloFit,
                                   StaticSplitPolicy, make_colo_policy)

# Decode: 2 ms per sequence + 10 ms + 0.01 ms per sequence per 1k... (bs*b0 + c0 + bs*k0*seqlen)
FIT = SoloFit(1.0, 2.0, 10.0, 0.001)
MODEL = HarliLatencyModel((FIT, SoloFit(0.5, 4.0, 20.0, 0.002)), b1=1.0, k1=1.2)


def _state(batch=2, waiting=0, seqlen=100.0, target=40.0, ready=True, unit=8.0, now=0.0) -> ColoState:
    return ColoState(now, batch, waiting, seqlen, target, ready, unit)


def test_fits_recover_the_coefficients_and_report_zero_error():
    solo = [(s, bs, seq, f.ms(bs, seq)) for f in MODEL.solo for s in [f.share] for bs in (1, 2, 4) for seq in (32, 256, 512)]
    fits = HarliLatencyModel.fit_solo(solo)
    for got, want in zip(fits, MODEL.solo):
        assert got.share == want.share
        assert got.b0 == pytest.approx(want.b0) and got.c0 == pytest.approx(want.c0) and got.k0 == pytest.approx(want.k0)
    colo = [(bs, seq, 1 - f, f, MODEL.colo_ms(bs, seq, 1 - f, f)) for bs in (1, 4) for seq in (64, 512) for f in (0.2, 0.5)]
    model = HarliLatencyModel(fits)
    model.fit_colo(colo)
    assert model.b1 == pytest.approx(1.0) and model.k1 == pytest.approx(1.2)
    assert model.relative_errors(colo)["max"] < 1e-9


def test_stage1_interpolates_between_shares_in_inverse_share():
    assert MODEL.solo_ms(1, 0, 1.0) == pytest.approx(12.0)
    assert MODEL.solo_ms(1, 0, 0.5) == pytest.approx(24.0)
    assert 12.0 < MODEL.solo_ms(1, 0, 0.7) < 24.0
    assert MODEL.solo_ms(1, 0, 0.25) == pytest.approx(48.0)  # below the lowest share: scaled as time slices
    with pytest.raises(PolicyInputError):
        MODEL.solo_ms(1, 0, 0.0)


def test_harli_picks_the_split_closest_below_the_target():
    plan = HarliPolicy(MODEL).plan(_state(target=40.0, unit=8.0))
    assert plan.units >= 1 and plan.predicted_ms <= 40.0
    # one unit more would be predicted over the target
    unit, solo = 8.0, MODEL.solo_ms(2, 100.0, 1.0)
    share = (plan.units + 1) * unit / ((plan.units + 1) * unit + solo)
    assert MODEL.colo_ms(2, 100.0, 1 - share, share) > 40.0
    # a looser target allows more units
    assert HarliPolicy(MODEL).plan(_state(target=80.0)).units > plan.units


def test_harli_pauses_before_a_predicted_violation_and_yields_when_stalled():
    policy = HarliPolicy(MODEL)
    tight = policy.plan(_state(batch=8, target=30.0))  # decode alone is predicted at 26+ ms; no unit fits
    assert tight.units == 0 and "pause" in tight.reason
    over = policy.plan(_state(batch=16, target=30.0))
    assert over.units == 0 and "over the target" in over.reason
    stalled = policy.plan(_state(ready=False))
    assert stalled.units == 0 and "stalled" in stalled.reason


def test_arrivals_pause_finetuning_until_their_prefill_ran():
    policy = HarliPolicy(MODEL)
    assert policy.plan(_state(batch=2, target=40.0)).units > 0
    plan = policy.plan(_state(batch=2, waiting=1, target=40.0))
    assert plan.units == 0 and "prefill" in plan.reason


def test_no_decode_gives_finetuning_everything():
    for policy in (HarliPolicy(MODEL), PauseOnlyPolicy()):
        plan = policy.plan(_state(batch=0))
        assert plan.units >= 1 and math.isinf(plan.predicted_ms)
    assert PauseOnlyPolicy().plan(_state(batch=1)).units == 0


def test_static_split_spends_its_share_of_wall_time_whatever_the_load():
    policy = StaticSplitPolicy(0.6)
    units = 0
    for i in range(1000):  # 10 s in 10 ms ticks, 5 ms units: 40% of 10 s = 4 s = 800 units
        units += policy.plan(_state(batch=i % 3, unit=5.0, now=i * 0.01, target=1.0)).units
    assert 780 <= units <= 800
    with pytest.raises(PolicyInputError):
        StaticSplitPolicy(1.0)


def test_make_colo_policy_errors():
    with pytest.raises(PolicyInputError, match="needs a fitted latency model"):
        make_colo_policy("harli", None)
    with pytest.raises(PolicyInputError, match="unknown co-location policy"):
        make_colo_policy("greedy")


def test_model_round_trips_through_a_file(tmp_path):
    MODEL.errors = {"grid": {"mean": 0.01, "max": 0.05, "points": 3}}
    loaded = HarliLatencyModel.load(MODEL.save(tmp_path / "m.json"))
    assert loaded.solo == MODEL.solo and loaded.k1 == MODEL.k1 and loaded.errors == MODEL.errors
