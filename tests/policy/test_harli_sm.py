"""HARLI §6.2 over SM shares, on constructed states and a constructed predictor."""

from __future__ import annotations

import math

import pytest

from backfill.errors import PolicyInputError
from backfill.policy.harli import ColoState, HarliLatencyModel, SoloFit
from backfill.policy.harli_sm import (HarliSmPolicy, PauseOnlySmPolicy, SmSplit, StaticSmPolicy, make_sm_policy,
                                      share_grid, split_costs)

# A memory-bound decode: flat down to 40% of the SMs, then 0.4 / share; Eq. 3 with b1 = 1, k1 = 1.4.
BASE = SoloFit(1.0, 0.05, 6.5, 0.0003)


def fit_at(share: float) -> SoloFit:
    k = max(1.0, 0.4 / share)
    return SoloFit(share, BASE.b0 * k, BASE.c0 * k, BASE.k0 * k)


MODEL = HarliLatencyModel(tuple(fit_at(s) for s in (*share_grid(), 1.0)), b1=1.0, k1=1.4)


def state(batch=8, waiting=0, seqlen=200.0, target=10.0, ready=True) -> ColoState:
    return ColoState(0.0, batch, waiting, seqlen, target, ready, 0.0)


@pytest.mark.parametrize("target", [7.8, 8.5, 9.5, 11.0, 14.0, 40.0])
def test_harli_picks_the_largest_finetuning_share_predicted_below_the_target(target):
    plan = HarliSmPolicy(MODEL, headroom=0.0).plan(state(target=target))
    fits = [f for f in share_grid() if MODEL.colo_ms(8, 200.0, round(1 - f, 6), f) <= target]
    assert fits, "every target here leaves room for 10%"
    assert plan.share_ft == pytest.approx(max(fits))
    assert plan.share_infer == pytest.approx(1 - plan.share_ft)
    assert plan.predicted_ms == pytest.approx(MODEL.colo_ms(8, 200.0, plan.share_infer, plan.share_ft))
    assert plan.predicted_ms <= target
    bigger = round(plan.share_ft + 0.1, 6)
    if bigger < 1:  # the next 10% would be predicted over the target
        assert MODEL.colo_ms(8, 200.0, round(1 - bigger, 6), bigger) > target


def test_harli_plans_against_the_target_less_its_headroom():
    loose = HarliSmPolicy(MODEL, headroom=0.0).plan(state(target=9.5))
    careful = HarliSmPolicy(MODEL, headroom=0.1).plan(state(target=9.5))
    assert careful.share_ft < loose.share_ft and careful.predicted_ms <= 9.5 * 0.9


def test_harli_pauses_on_a_predicted_violation():
    solo = MODEL.colo_ms(8, 200.0, 1.0, 0.0)
    smallest = MODEL.colo_ms(8, 200.0, 0.9, 0.1)
    plan = HarliSmPolicy(MODEL, headroom=0.0).plan(state(target=(solo + smallest) / 2))
    assert (plan.share_infer, plan.share_ft) == (1.0, 0.0) and plan.reason.startswith("pause")
    over = HarliSmPolicy(MODEL, headroom=0.0).plan(state(target=solo * 0.9))
    assert over.share_ft == 0.0 and "decode alone" in over.reason


def test_harli_gives_inference_everything_while_finetuning_stalls_and_for_prefill():
    plan = HarliSmPolicy(MODEL).plan(state(ready=False, target=40.0))
    assert (plan.share_infer, plan.share_ft) == (1.0, 0.0) and "stalled" in plan.reason
    plan = HarliSmPolicy(MODEL).plan(state(waiting=2, target=40.0))
    assert (plan.share_infer, plan.share_ft) == (1.0, 0.0)


def test_harli_gives_finetuning_everything_with_no_decode():
    plan = HarliSmPolicy(MODEL).plan(state(batch=0))
    assert (plan.share_infer, plan.share_ft) == (0.0, 1.0) and math.isinf(plan.predicted_ms)


def test_the_baselines():
    assert PauseOnlySmPolicy().plan(state(batch=0)).share_ft == 1.0
    assert PauseOnlySmPolicy().plan(state(batch=1)).share_ft == 0.0
    assert PauseOnlySmPolicy().plan(state(batch=0, waiting=1)).share_ft == 0.0
    static = StaticSmPolicy(0.6)
    for s in (state(batch=0), state(batch=30, target=1.0)):
        plan = static.plan(s)
        assert (plan.share_infer, plan.share_ft) == (0.6, pytest.approx(0.4))
    assert make_sm_policy("static", static_share_infer=0.7).plan(state()).share_ft == pytest.approx(0.3)


def test_share_grid_is_harlis_ten_percent_steps():
    assert share_grid() == (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@pytest.mark.parametrize("bad", [
    lambda: SmSplit(1.2, 0.0, 1.0, ""), lambda: SmSplit(0.7, 0.4, 1.0, ""), lambda: SmSplit(-0.1, 0.5, 1.0, ""),
    lambda: StaticSmPolicy(1.0), lambda: StaticSmPolicy(0.0), lambda: HarliSmPolicy(MODEL, headroom=1.0),
    lambda: make_sm_policy("harli"), lambda: make_sm_policy("greedy"), lambda: share_grid(0.0),
    lambda: MODEL.solo_ms(1, 10, 0.0)])
def test_bad_input_is_a_typed_error(bad):
    with pytest.raises(PolicyInputError):
        bad()


# --- plans over the splits a partitioned device realises (engine/compute_partition.py) -----------

# Two cores: decode on one core is 1.6x its step on two; beside finetuning on the other, 1.1x more.
CORES_MODEL = HarliLatencyModel((SoloFit(0.5, 0.8, 16.0, 0.003), SoloFit(1.0, 0.5, 10.0, 0.002)), b1=1.0, k1=1.2)


def test_harli_plans_only_the_shares_the_partitions_realise():
    policy = HarliSmPolicy(CORES_MODEL, headroom=0.0, ft_shares=(0.5,))
    assert policy.ft_shares == (0.5,)
    roomy = policy.plan(state(batch=2, seqlen=100.0, target=40.0))
    assert (roomy.share_infer, roomy.share_ft) == (0.5, 0.5)
    assert roomy.predicted_ms == pytest.approx(CORES_MODEL.colo_ms(2, 100.0, 0.5, 0.5))
    # The co-located step (1.1 x 18.2 ms at batch 2) is over a 19 ms target: decode gets both cores.
    tight = policy.plan(state(batch=2, seqlen=100.0, target=19.0))
    assert (tight.share_infer, tight.share_ft) == (1.0, 0.0) and tight.reason.startswith("pause")
    assert policy.plan(state(batch=0, target=20.0)).share_ft == 1.0       # idle: finetuning on every core
    assert policy.plan(state(batch=2, waiting=1, target=40.0)).share_ft == 0.0  # arrivals' prefill first


def test_the_split_re_plans_per_token_as_the_batch_grows():
    policy = HarliSmPolicy(CORES_MODEL, headroom=0.05, ft_shares=(0.5,))
    shares = [policy.plan(state(batch=b, seqlen=200.0, target=30.0)).share_ft for b in (1, 2, 4, 8, 16)]
    # Predicted co-located steps 19.1 / 20.7 / 23.8 / 29.9 / 42.2 ms against 28.5: pause from batch 8.
    assert shares == [0.5, 0.5, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("shares", [(0.0, 0.5), (0.5, 1.0), (1.5,)])
def test_unrealisable_shares_are_refused(shares):
    with pytest.raises(PolicyInputError):
        HarliSmPolicy(CORES_MODEL, ft_shares=shares)


def test_plans_over_sm_group_shares_stay_on_the_device():
    """H200 shares (k / 132 SMs) are not round tenths: a split and its rest must still sum to 1."""
    from backfill.engine.green_context import planned_ft_sms

    shares = tuple(k / 132 for k in planned_ft_sms(132, 8, 0.1))
    policy = HarliSmPolicy(MODEL, headroom=0.0, ft_shares=shares)
    for target in (7.8, 9.5, 14.0, 40.0):
        plan = policy.plan(state(target=target))
        assert plan.share_ft in shares + (0.0,)
        assert plan.share_infer + plan.share_ft == pytest.approx(1.0)


def test_split_costs_price_every_split_against_the_whole_device():
    costs = split_costs(MODEL, (0.5, 0.1), 8, 200.0)
    whole = MODEL.solo_ms(8, 200.0, 1.0)
    assert [c.share_ft for c in costs] == [0.1, 0.5]
    for c in costs:
        assert c.share_infer == pytest.approx(1 - c.share_ft)
        assert c.decode_ms == pytest.approx(MODEL.colo_ms(8, 200.0, c.share_infer, c.share_ft))
        assert c.x_whole_device == pytest.approx(c.decode_ms / whole)
    assert costs[0].x_whole_device < costs[1].x_whole_device


def test_where_every_split_slows_decode_past_the_allowance_the_planner_only_pauses():
    # Two cores, decode on one 2.5x slower: no target within 1.5x of the whole-device step admits a split.
    cores = HarliLatencyModel((SoloFit(0.5, 0.125, 16.25, 0.00075), SoloFit(1.0, 0.05, 6.5, 0.0003)), b1=1.0, k1=1.0)
    (cost,) = split_costs(cores, (0.5,), 2, 256.0)
    assert cost.x_whole_device > 1.5
    target = 1.5 * cores.solo_ms(2, 256.0, 1.0)
    plan = HarliSmPolicy(cores, headroom=0.0, ft_shares=(0.5,)).plan(state(batch=2, seqlen=256.0, target=target))
    assert plan.share_ft == 0.0 and plan.reason.startswith("pause")


def test_split_costs_reject_an_empty_decode_and_shares_outside_the_device():
    with pytest.raises(PolicyInputError):
        split_costs(MODEL, (0.5,), 0, 200.0)
    with pytest.raises(PolicyInputError):
        split_costs(MODEL, (1.0,), 8, 200.0)
