"""The riders' mechanism on its own: which offline decodes fit a co-serving step, what they save,
and what they were measured to add (hand-built states, no engine)."""

import pytest
from test_coserve import OFF, ON, decoding, seq, state

from backfill.policy.latency_model import BatchShape, LatencyModel
from backfill.policy.planner import PlanBuilder
from backfill.policy.riders import Riders

# Decodes: 3 ms for one sequence, +0.1 ms each up to 64 (GPU-like); no attention cost.
LATENCY = LatencyModel((1, 2048), (11.0, 19.0), decode_grid=(1, 64), decode_ms=(3.0, 9.3))


def riders(share: float = 0.5, max_seqs: int = 256) -> Riders:
    return Riders(LATENCY, LATENCY.estimate_ms, cost_share=share, batch_max_seqs=max_seqs)


def online_plan(s):
    plan = PlanBuilder(s, 2048, 256, 512)
    for v in s.online:
        plan.add(v)
    return plan


def test_riders_fill_the_budget_cheapest_first_and_keep_out_of_the_online_reserve():
    s = state(decoding(0, ON), *[decoding(i, OFF, ctx=40 + i) for i in range(10)], seq(99, OFF, tokens=300),
              free=100, total=1000)
    plan = online_plan(s)
    riders().add(plan, list(s.offline), s, budget_ms=3.0 + 0.1 * 4 + 1e-6, correction=1.0, reserve=0)
    assert [v.seq_id for v in plan.scheduled[1:]] == ["offline0", "offline1", "offline2", "offline3"]
    # A request not yet running is not admitted where it would eat into the online reserve.
    s2 = state(decoding(0, ON), seq(99, OFF, tokens=300, computed=299, blocks=19), free=5, total=1000)
    plan2 = online_plan(s2)
    riders().add(plan2, list(s2.offline), s2, budget_ms=100.0, correction=1.0, reserve=10)
    assert len(plan2.scheduled) == 1


def test_a_rider_must_save_against_the_backlog_decoding_at_most_its_share():
    s = state(decoding(0, ON), *[decoding(i, OFF) for i in range(63)])
    per_token = riders().batch_ms_per_token(s)
    assert per_token == pytest.approx(LATENCY.estimate_ms(_backlog(63)) / 63)  # 9.2 ms / 63
    assert riders(max_seqs=8).batch_ms_per_token(s) == pytest.approx(LATENCY.estimate_ms(_backlog(8)) / 8)
    plan = online_plan(s)
    without = plan.shape
    riders(share=1.0).add(plan, list(s.offline[:1]), s, budget_ms=100.0, correction=1.0, reserve=0)
    added_ms = LATENCY.estimate_ms(plan.shape) - LATENCY.estimate_ms(without)  # 0.1 ms
    assert riders(share=1.0).saving_ms(s, without, plan, 1.0) == pytest.approx(per_token - added_ms)
    # At half a batch token's cost (0.073 ms) the same rider is too dear, and so it is at full
    # share once riders were measured to add twice what the profile says.
    assert riders(share=0.5).saving_ms(s, without, plan, 1.0) is None
    measured_dear = riders(share=1.0)
    measured_dear.correction = 2.0
    assert measured_dear.saving_ms(s, without, plan, 1.0) is None
    assert riders().batch_ms_per_token(state(decoding(0, ON))) == float("inf")


def _backlog(n: int) -> BatchShape:
    shape = BatchShape()
    for _ in range(n):
        shape = shape.plus(1, 40)
    return shape


def test_only_the_step_planned_with_riders_teaches_what_riders_add():
    r = riders()
    online, with_riders = _backlog(1), _backlog(5)
    assert not r.observe_step(with_riders, 10.0)  # nothing planned yet: the policy's drift learns
    r.planned(online, online, 1.0)
    assert not r.observe_step(online, 10.0)  # a plan without riders teaches nothing here
    r.planned(online, with_riders, 1.0)
    assert not r.observe_step(_backlog(6), 10.0)  # another step ran than the one planned
    profile_added = LATENCY.estimate_ms(with_riders) - LATENCY.estimate_ms(online)
    r.planned(online, with_riders, 1.0)
    assert r.observe_step(with_riders, LATENCY.estimate_ms(online) + 3 * profile_added)
    assert r.correction == pytest.approx(0.9 + 0.1 * 3)
    for _ in range(100):  # a wild measurement counts at most 8x
        r.planned(online, with_riders, 1.0)
        r.observe_step(with_riders, 1e6)
    assert r.correction == pytest.approx(8.0, rel=1e-3)


@pytest.mark.parametrize("bigger_bucket_ms, riders_kept", [(6.0, 7), (4.0, 15)])
def test_riders_stop_short_of_a_bigger_graph_bucket_unless_filling_it_pays(bigger_bucket_ms, riders_kept):
    # CUDA graphs pad a decode step to its bucket: 1 to 8 sequences cost 3 ms, 9 to 16 the bigger
    # bucket's cost. The ninth sequence pays for the padding, the ones after it ride free: riders
    # are kept up to the prefix that saves the most (break-even), not judged one at a time.
    buckets = LatencyModel((1, 2048), (11.0, 19.0), decode_grid=(1, 8, 9, 16),
                           decode_ms=(3.0, 3.0, bigger_bucket_ms, bigger_bucket_ms))
    n = riders_kept if riders_kept == 15 else 8
    s = state(decoding(0, ON), *[decoding(i, OFF) for i in range(n)])
    plan = online_plan(s)
    Riders(buckets, buckets.estimate_ms, cost_share=1.0, batch_max_seqs=256).add(
        plan, list(s.offline), s, budget_ms=100.0, correction=1.0, reserve=0)
    assert len(plan.scheduled) - 1 == riders_kept


def test_prompt_chunks_ride_within_the_budget_priced_or_not():
    # GPU-like: a lone decode takes 3 ms on its graph, any step with a prompt chunk the eager path's
    # 10 ms and up; an offline batch of 2048 prompt tokens 40 ms (0.0195 ms a token).
    gpu = LatencyModel((1, 512, 2048), (10.0, 12.0, 40.0), decode_grid=(1, 64), decode_ms=(3.0, 4.0))
    s = state(decoding(0, ON), seq(7, OFF, tokens=600))
    plan = online_plan(s)
    budget_ms = gpu.estimate_ms(BatchShape().plus(1, 40).plus(512, 0))
    r = Riders(gpu, gpu.estimate_ms, cost_share=1.0, batch_max_seqs=256)
    r.add_prefill(plan, list(s.offline), budget_ms, correction=1.0, reserve=0, batch_tokens=2048, cost_share=1.0)
    # 512 tokens add 9 ms to the step, against 10 ms in an offline batch: they ride.
    assert [(v.seq_id, v.num_tokens) for v in plan.scheduled[1:]] == [("offline7", 512)]
    # A budget of a few tokens: leaving the 3 ms graph for a 10 ms eager step is not worth them.
    small = online_plan(s)
    r.add_prefill(small, list(s.offline), gpu.estimate_ms(BatchShape().plus(8, 0)), 1.0, 0, 2048, cost_share=1.0)
    assert len(small.scheduled) == 1
    # Without a price (ConServe Algorithm 1 as written), the budget alone decides.
    r.add_prefill(small, list(s.offline), gpu.estimate_ms(BatchShape().plus(8, 0)), 1.0, 0, 2048)
    assert [(v.seq_id, v.num_tokens) for v in small.scheduled[1:]] == [("offline7", 7)]
