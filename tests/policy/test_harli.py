"""HARLI's predictor and QoS policy on constructed states."""

from __future__ import annotations

import json
import math

import pytest

from backfill.errors import LatencyProfileError, PolicyInputError
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


# --- stage 2 per unit kind (HARLI §5.2 with one k1 per kind) -------------------------------------

KINDS = {"forward": 0.9, "head": 1.4, "backward": 1.05, "update": 1.2}
PER_KIND = HarliLatencyModel(MODEL.solo, b1=1.02, k1=1.1, k1_kind=dict(KINDS))


def _kind_points(model: HarliLatencyModel) -> list[tuple]:
    """Points (bs, seqlen, share_infer, share_ft, ms, mix) the model predicts exactly: pure kinds and
    mixed intervals, as the profiler's grid and held-out set hold them."""
    mixes = [{"forward": 4.0}, {"forward": 8.0}, {"backward": 14.0}, {"backward": 28.0}, {"head": 24.0},
             {"update": 16.0}, {"forward": 4.0, "head": 24.0}, {"head": 24.0, "backward": 14.0}]
    points = []
    for bs in (1, 4):
        for seq in (32, 512):
            for mix in mixes:
                ft = sum(mix.values())
                s_ft = ft / (ft + model.solo_ms(bs, seq, 1.0))
                points.append((bs, seq, 1 - s_ft, s_ft, model.colo_ms(bs, seq, 1 - s_ft, s_ft, ft_mix=mix), mix))
    return points


def test_fit_recovers_known_per_kind_coefficients():
    points = _kind_points(PER_KIND)
    model = HarliLatencyModel(MODEL.solo)
    weights = {"forward": 120.0, "head": 48.0, "backward": 420.0, "update": 16.0}
    model.fit_colo(points, kind_weights=weights)
    assert model.b1 == pytest.approx(1.02)
    assert model.k1_kind == pytest.approx(KINDS)
    assert model.k1 == pytest.approx(sum(weights[k] * KINDS[k] for k in KINDS) / sum(weights.values()))
    assert model.per_kind and model.relative_errors(points)["max"] < 1e-9
    # Without the kinds HARLI's single k1 cannot fit these points: the per-kind form is what recovers them.
    share_only = HarliLatencyModel(MODEL.solo)
    share_only.fit_colo([p[:5] for p in points])
    assert not share_only.per_kind and share_only.relative_errors([p[:5] for p in points])["max"] > 0.01


def test_colo_ms_uses_the_mix_and_falls_back_to_the_kind_average():
    bs, seq, s_ft = 2, 100.0, 0.4
    solo = PER_KIND.solo_ms(bs, seq, 0.6)
    assert PER_KIND.colo_ms(bs, seq, 0.6, s_ft) == pytest.approx((0.6 * 1.02 + s_ft * 1.1) * solo)
    assert PER_KIND.colo_ms(bs, seq, 0.6, s_ft, ft_mix={"head": 5.0}) == pytest.approx((0.6 * 1.02 + s_ft * 1.4) * solo)
    half = PER_KIND.colo_ms(bs, seq, 0.6, s_ft, ft_mix={"head": 1.0, "forward": 1.0})
    assert half == pytest.approx((0.6 * 1.02 + s_ft * (1.4 + 0.9) / 2) * solo)
    # a kind the profile never saw: the kind-average
    assert PER_KIND.colo_ms(bs, seq, 0.6, s_ft, ft_mix={"merge": 3.0}) == pytest.approx(PER_KIND.colo_ms(bs, seq, 0.6, s_ft))
    for bad in ({"head": -1.0, "forward": 2.0}, {"head": 0.0}):
        with pytest.raises(PolicyInputError, match="ft_mix"):
            PER_KIND.colo_ms(bs, seq, 0.6, s_ft, ft_mix=bad)


def test_fit_needs_enough_points():
    with pytest.raises(PolicyInputError, match="co-located points"):
        HarliLatencyModel(MODEL.solo).fit_colo([])
    with pytest.raises(PolicyInputError, match="co-located points"):
        HarliLatencyModel(MODEL.solo).fit_colo(_kind_points(PER_KIND)[:1])


def _units(*kinds_ms: tuple[str, float]) -> tuple:
    return tuple(((kind, ms),) for kind, ms in kinds_ms)


def test_policy_runs_fewer_units_when_the_next_one_is_a_head_slice():
    policy = HarliPolicy(PER_KIND)
    forwards = ColoState(0.0, 2, 0, 100.0, 40.0, True, 4.0, _units(*[("forward", 4.0)] * 8))
    head_next = ColoState(0.0, 2, 0, 100.0, 40.0, True, 4.0, _units(("forward", 4.0), ("head", 24.0),
                                                                    *[("head", 24.0)] + [("backward", 14.0)] * 5))
    many, few = policy.plan(forwards), policy.plan(head_next)
    assert many.units > few.units == 1 and few.predicted_ms <= 40.0 * 0.95
    # Same durations, another kind: the head's larger k1 alone costs units.
    same_ms = [ColoState(0.0, 2, 0, 100.0, 40.0, True, 3.0, _units(*[(kind, 3.0)] * 8)) for kind in ("forward", "head")]
    assert policy.plan(same_ms[0]).units > policy.plan(same_ms[1]).units >= 1
    # Fewer units known than the policy could run (the job is ending): never more than it has.
    assert policy.plan(ColoState(0.0, 2, 0, 100.0, 80.0, True, 4.0, _units(("forward", 4.0)))).units == 1


def test_a_format_1_profile_loads_with_its_single_k1(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"solo": [{"share": 1.0, "b0": 2.0, "c0": 10.0, "k0": 0.001}], "b1": 1.0, "k1": 1.2,
                                "model_name": "m", "device": "cpu", "errors": {}, "unit_ms": {"head": 20.0}}))
    old = HarliLatencyModel.load(path)
    assert not old.per_kind and old.k1 == 1.2
    assert old.colo_ms(1, 0, 0.5, 0.5, ft_mix={"head": 1.0}) == pytest.approx(old.colo_ms(1, 0, 0.5, 0.5))
    loaded = HarliLatencyModel.load(PER_KIND.save(tmp_path / "new.json"))
    assert loaded.k1_kind == KINDS and json.loads((tmp_path / "new.json").read_text())["format"] == 3


def test_a_format_2_profile_loads_fitted_at_the_batch_itself(tmp_path):
    """The profiles saved before stage 1 knew the engine's run batches (docs' older JSON) still load."""
    path = tmp_path / "v2.json"
    path.write_text(json.dumps({"format": 2, "solo": [{"share": 1.0, "b0": 2.0, "c0": 10.0, "k0": 0.001}],
                                "b1": 1.0, "k1": 1.2, "k1_kind": {"head": 1.3}}))
    old = HarliLatencyModel.load(path)
    assert old.run_batches == () and old.solo_ms(1, 0, 1.0) == pytest.approx(12.0)
    padded = HarliLatencyModel(old.solo, run_batches=(3,))
    loaded = HarliLatencyModel.load(padded.save(tmp_path / "v3.json"))
    assert loaded.run_batches == (3,) and loaded.solo_ms(1, 0, 1.0) == pytest.approx(16.0)  # 3 rows run


@pytest.mark.parametrize("content, match", [
    ("{not json", "unreadable"),
    (json.dumps({"format": 4, "solo": [], "b1": 1, "k1": 1}), "format 4"),
    (json.dumps({"format": 3, "solo": [{"share": 1.0, "b0": 1, "c0": 1, "k0": 0}], "b1": 1, "k1": 1,
                 "run_batches": [4, 2]}), "malformed"),
    (json.dumps({"solo": [{"share": 1.0}], "b1": 1.0, "k1": 1.0}), "malformed"),
    (json.dumps({"solo": [], "b1": 1.0, "k1": 1.0}), "malformed"),
    (json.dumps([1, 2]), "format None"),
])
def test_bad_profiles_raise_a_typed_error_that_says_to_reprofile(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(LatencyProfileError, match=match) as err:
        HarliLatencyModel.load(path)
    assert "backfill finetune profile" in str(err.value)


# --- stage 1 at the batch the engine runs (padded rows, CUDA-graph buckets) -----------------------

def _two_regime_ms(bs: int, seq: float, rows: int = 3) -> float:
    """A step whose weight matmuls run at least `rows` rows (the CPU engine pads one or two to
    three) at 1.5 ms a row over 12 ms, while attention reads each real sequence's context."""
    return max(bs, rows) * 1.5 + 12.0 + bs * 0.004 * seq


def test_a_two_regime_step_is_fitted_within_one_percent_at_the_engines_run_batch():
    solo = [(1.0, bs, seq, _two_regime_ms(bs, seq)) for bs in (1, 2, 4) for seq in (32, 256, 512)]
    padded = HarliLatencyModel(HarliLatencyModel.fit_solo(solo, (3,)), run_batches=(3,))
    plain = HarliLatencyModel(HarliLatencyModel.fit_solo(solo))
    for bs in range(1, 9):
        for seq in (16, 100, 384, 600):
            want = _two_regime_ms(bs, seq)
            assert padded.solo_ms(bs, seq, 1.0) == pytest.approx(want, rel=0.01)
    # HARLI's form at the batch itself cannot draw the bend: bs 1 and 2 cost the same weight reads.
    assert max(abs(plain.solo_ms(bs, 32, 1.0) / _two_regime_ms(bs, 32) - 1) for bs in (1, 2, 3, 4)) > 0.02


def test_cuda_graph_buckets_price_a_batch_at_its_bucket():
    buckets = (1, 2, 4, 8, 16, 32, 64)

    def step(bs, seq):  # flat inside a bucket, as a replayed graph is
        return 6.5 + 0.03 * next(b for b in buckets if b >= bs) + 0.00027 * bs * seq

    solo = [(1.0, bs, seq, step(bs, seq)) for bs in (4, 16, 64) for seq in (64, 512)]
    model = HarliLatencyModel(HarliLatencyModel.fit_solo(solo, buckets), run_batches=buckets)
    assert model.solo_ms(33, 64, 1.0) == pytest.approx(step(33, 64), rel=0.01)
    assert model.solo_ms(17, 500, 1.0) == pytest.approx(step(17, 500), rel=0.01)
    assert model.solo_ms(80, 64, 1.0) == pytest.approx(6.5 + 0.03 * 80 + 0.00027 * 80 * 64, rel=0.01)  # above: as is


def test_run_batches_must_be_ascending_and_positive():
    for bad in ((4, 2), (0, 3), (2, 2)):
        with pytest.raises(PolicyInputError, match="run_batches"):
            HarliLatencyModel(MODEL.solo, run_batches=bad)
        with pytest.raises(PolicyInputError, match="run_batches"):
            HarliLatencyModel.fit_solo([(1.0, 1, 32, 10.0)], bad)
