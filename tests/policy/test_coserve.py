"""Policy decisions on hand-built scheduler states (no engine, no tensors)."""

from dataclasses import replace

import pytest

from backfill.errors import InvalidRequestError
from backfill.policy.baselines import FCFSPolicy, OnlineOnlyPolicy, PriorityPolicy
from backfill.policy.coserve import CoServePolicy
from backfill.policy.config import CoServeConfig
from backfill.policy.interface import RunningStep, SafepointLayout
from backfill.policy.latency_model import BatchShape, LatencyModel
from backfill.policy.planner import BatchLimits, PlanBuilder
from backfill.policy.interface import SchedulerState, SeqView
from backfill.types import SLO, RequestClass

ON, OFF = RequestClass.ONLINE, RequestClass.OFFLINE
# 20 ms floor up to 8 tokens, then +1 ms per token: a CPU-like shape.
LATENCY = LatencyModel((1, 8, 1024), (20.0, 20.0, 1036.0))
# LATENCY prices a rider past 8 tokens at what an offline batch pays a token: with riders allowed
# up to the full batch cost, the step's budget alone limits them (the tests of budgets use this).
FILL = {"rider_cost_share": 1.0}
LAYOUT = SafepointLayout(num_layers=30, longest_stretch_share=0.5)  # SmolLM2-135M on the eager path


def uncapped_config(**changes) -> CoServeConfig:
    """Algorithm 1-2 as the paper has them: no interference cap unless a test sets one."""
    return CoServeConfig(**({"interference_slack": None} | changes))


def seq(i, cls, *, tokens=10, computed=0, blocks=0, running=False, arrival=0.0, ckpt=0) -> SeqView:
    return SeqView(f"{cls.value}{i}", cls, arrival, tokens if computed == 0 else computed, tokens, computed,
                   blocks, running, ckpt)


def decoding(i, cls, ctx=40, arrival=0.0, ckpt=0) -> SeqView:
    return seq(i, cls, tokens=ctx + 1, computed=ctx, blocks=-(-(ctx + 1) // 16), running=True,
               arrival=arrival, ckpt=ckpt)


def state(*seqs, free=1000, total=1000, now=1.0) -> SchedulerState:
    return SchedulerState(now, tuple(seqs), free, total, 16, 2048)


def ids(plan):
    return {s.seq_id: s.num_tokens for s in plan.scheduled}


def test_offline_batching_mode_when_no_online_is_preemptible_and_big():
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(preempt_target_ms=5.0))
    plan = policy.schedule(state(*[decoding(i, OFF) for i in range(40)], seq(99, OFF, tokens=248)))
    assert plan.mode == "offline-batching" and plan.preemptible
    # 5 ms between safepoints, 2 such stretches per layer, 30 layers = 300 ms -> 288 tokens.
    assert plan.num_tokens == 288
    assert ids(plan)["offline99"] == 248 and all(ids(plan)[f"offline{i}"] == 1 for i in range(40))


def test_offline_batching_admits_waiting_prompts_before_running_decodes():
    # A step's fixed cost is spread over the requests decoding: a backlog starting at once is
    # best prefilled first, so every later step decodes all of it.
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(preempt_target_ms=5.0))  # 288 tokens
    plan = policy.schedule(state(*[decoding(i, OFF, arrival=0.0) for i in range(10)],
                                 *[seq(20 + i, OFF, tokens=100, arrival=1.0) for i in range(3)]))
    assert ids(plan) == {"offline20": 100, "offline21": 100, "offline22": 88}


def test_offline_batching_counts_decode_context_against_the_preemption_target():
    # 1 ms per 1,000 context tokens: each decode at 1,000 tokens of context adds 1 ms.
    latency = LatencyModel((1, 8, 1024), (20.0, 20.0, 1036.0), ms_per_kctx=1.0)
    policy = CoServePolicy(latency, LAYOUT, uncapped_config(preempt_target_ms=1.0))  # 60 ms steps
    plan = policy.schedule(state(*[decoding(i, OFF, ctx=1000) for i in range(40)]))
    # 24 decodes would be 20 + (24 - 8) + 24 x 1.001 > 60 ms.
    assert plan.mode == "offline-batching" and plan.num_tokens == 23
    # Even one decode over the budget still runs: the step must make progress.
    tight = CoServePolicy(latency, LAYOUT, uncapped_config(preempt_target_ms=0.2))  # 12 ms steps
    assert tight.schedule(state(*[decoding(i, OFF, ctx=1000) for i in range(3)])).num_tokens == 1


def test_co_serving_puts_online_first_and_fills_tpot_budget_with_offline():
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=1.0, **FILL))
    online = [decoding(i, ON, arrival=0.5) for i in range(4)]
    offline = [decoding(i, OFF) for i in range(100)]
    plan = policy.schedule(state(*online, *offline))
    assert plan.mode == "co-serving" and not plan.preemptible
    assert [s.seq_id for s in plan.scheduled[:4]] == [f"online{i}" for i in range(4)]
    assert plan.info["budget_ms"] == 50
    # 50 ms budget allows 8 + 30 = 38 tokens at short context: 4 online + 34 offline.
    assert LATENCY.estimate_ms(BatchShape(plan.num_tokens)) <= 50 + 5
    assert 30 <= plan.num_tokens - 4 <= 34


@pytest.mark.parametrize("prefill_riders", [True, False])
def test_co_serving_steps_carry_offline_decodes_and_prompt_chunks_never_restores(prefill_riders):
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=1.0,
                                                          prefill_riders=prefill_riders, adapt_margin=False))
    # Preempted: no device blocks, 40 tokens of KV on the host; a fresh offline request (prefill);
    # and one decoding.
    preempted = seq(1, OFF, tokens=41, computed=40, ckpt=40, arrival=0.1)
    fresh = seq(2, OFF, tokens=10, arrival=0.2)
    running = decoding(3, OFF, arrival=0.3)
    assert preempted.needs_restore and not fresh.needs_restore and fresh.in_prefill
    co = policy.schedule(state(decoding(0, ON, arrival=0.5), preempted, fresh, running))
    # Algorithm 1: the budget left after the decodes takes the fresh request's whole prompt.
    expected = {"online0", "offline3"} | ({"offline2"} if prefill_riders else set())
    assert co.mode == "co-serving" and set(ids(co)) == expected
    if prefill_riders:
        assert dict((item.seq_id, item.num_tokens) for item in co.scheduled)["offline2"] == 10
    batching = policy.schedule(state(preempted, fresh, running))
    assert batching.mode == "offline-batching" and {"offline1", "offline2", "offline3"} <= set(ids(batching))


def test_co_serving_fills_the_budget_with_the_cheapest_offline_decodes_first():
    # 2 ms per 1,000 context tokens: a decode at 1,500 tokens costs 3 ms more than one at 100.
    latency = LatencyModel((1, 8, 1024), (20.0, 20.0, 1036.0), ms_per_kctx=2.0)
    policy = CoServePolicy(latency, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=23.5), slo_margin=1.0,
                                                  bank_tpot_slack=False))
    long_old = [decoding(i, OFF, ctx=1500, arrival=0.0) for i in range(3)]
    short_young = [decoding(10 + i, OFF, ctx=100, arrival=0.4) for i in range(3)]
    plan = policy.schedule(state(decoding(0, ON, ctx=100, arrival=0.5), *long_old, *short_young))
    # 23.5 ms: after the online decode (20.2 ms), arrival order would take one long context (3 ms)
    # and one short (0.2 ms); cheapest first takes all three short ones and then no long one.
    assert set(ids(plan)) == {"online0", "offline10", "offline11", "offline12"}


def test_a_suspended_offline_step_is_continued_in_offline_batching_and_left_alone_when_dear():
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=1.0))
    suspended = [decoding(i, OFF)._replace(suspended=True) for i in range(3)]
    idle = decoding(9, OFF, arrival=0.2)
    batching = policy.schedule(state(*suspended, idle))
    assert batching.resume and batching.preemptible and batching.mode == "offline-batching"
    assert not batching.scheduled and not batching.preempt
    # The suspended step ran 1 s: three riders cannot save that in the online request's 16 steps.
    co = policy.schedule(replace(state(decoding(0, ON, arrival=0.5), *suspended, idle), suspended_ms=1000.0))
    assert co.mode == "co-serving" and not co.resume and set(ids(co)) == {"online0", "offline9"}


def _suspended_riders_case(suspended_ms: float, online_steps_left: int, **config):
    # A GPU-like step: 3 ms flat for decodes of up to 8 sequences; offline batching's 288-token
    # step (prefilling the waiting prompt: 20 ms floor, +1 ms a token) costs 1.04 ms a token, and
    # a rider adds nothing to the online decode, so each saves that.
    latency = LatencyModel((1, 8, 1024), (20.0, 20.0, 1036.0), decode_grid=(1, 8), decode_ms=(3.0, 3.0))
    policy = CoServePolicy(latency, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=1.0, **config))
    online = decoding(0, ON, arrival=0.5)._replace(max_tokens=10 + online_steps_left, num_output_tokens=10)
    suspended = [decoding(i, OFF)._replace(suspended=True) for i in range(3)]
    waiting = seq(20, OFF, tokens=300)  # offline batching would prefill this: its tokens are cheap
    return policy.schedule(replace(state(online, *suspended, waiting), suspended_ms=suspended_ms))


def test_requests_of_the_suspended_step_ride_when_their_savings_pay_for_its_lost_work():
    plan = _suspended_riders_case(suspended_ms=5.0, online_steps_left=30)
    assert set(ids(plan)) == {"online0", "offline0", "offline1", "offline2"} and not plan.resume
    # Three riders save 3.1 ms a step: one step left cannot pay for 5 ms of lost work, and 30 steps
    # cannot pay for a second of it.
    assert set(ids(_suspended_riders_case(suspended_ms=5.0, online_steps_left=1))) == {"online0"}
    assert set(ids(_suspended_riders_case(suspended_ms=1000.0, online_steps_left=30))) == {"online0"}
    assert set(ids(_suspended_riders_case(suspended_ms=5.0, online_steps_left=30,
                                          release_suspended=False))) == {"online0"}


def test_interference_slack_caps_a_co_serving_step_near_its_online_work_alone():
    # Online work alone: 4 decodes = 20 ms; a 10% slack leaves 2 ms = 2 offline tokens.
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=1.0,
                                                  interference_slack=0.1, bank_tpot_slack=False))
    online = [decoding(i, ON, arrival=0.5) for i in range(4)]
    plan = policy.schedule(state(*online, *[decoding(i, OFF) for i in range(100)]))
    assert plan.info["budget_ms"] == pytest.approx(22.0)
    assert plan.num_tokens - 4 == 6  # the 20 ms floor holds up to 8 tokens, then 2 more fit in 2 ms
    uncapped = CoServePolicy(LATENCY, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=1.0,
                                                    interference_slack=float("inf"), bank_tpot_slack=False))
    assert uncapped.schedule(state(*online, *[decoding(i, OFF) for i in range(100)])).info["budget_ms"] == 50


def online_decoding(i, *, outputs, decode_s, now=1.0) -> SeqView:
    """An online request decoding for decode_s seconds since its first token, outputs tokens out."""
    return decoding(i, ON)._replace(num_output_tokens=outputs, first_token_s=now - decode_s, max_tokens=64)


def test_a_request_ahead_of_its_tpot_slo_lends_the_banked_time_to_offline_tokens():
    cfg = uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=0.8, bank_step_max_slos=1.0,
                          **FILL)  # target 40 ms per token
    offline = [decoding(i, OFF) for i in range(100)]
    # 20 tokens in 0.5 s: 25 ms each, 300 ms banked against the 40 ms target. The step may take up
    # to bank_step_max_slos SLOs (here 1: 50 ms), never the whole bank.
    ahead = online_decoding(0, outputs=20, decode_s=0.5)
    banked = CoServePolicy(LATENCY, LAYOUT, cfg).schedule(state(ahead, *offline))
    assert banked.info["budget_ms"] == 50
    # Three SLOs: 150 ms of the 300 banked (less the reserve for a 41-token prefill) in one step.
    three = CoServePolicy(LATENCY, LAYOUT, replace(cfg, bank_step_max_slos=3.0)).schedule(state(ahead, *offline))
    assert three.info["budget_ms"] == 150
    with pytest.raises(InvalidRequestError):
        replace(cfg, bank_step_max_slos=0.5)
    per_step = CoServePolicy(LATENCY, LAYOUT,
                             uncapped_config(slo=cfg.slo, slo_margin=0.8, bank_tpot_slack=False, **FILL))
    plain = per_step.schedule(state(ahead, *offline))
    assert plain.info["budget_ms"] == pytest.approx(40)
    assert banked.num_tokens - plain.num_tokens == 10  # 10 ms more at 1 ms per token past 8


def test_a_request_behind_its_tpot_target_spends_no_bank():
    cfg = uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=0.8, interference_slack=0.1,
                        bank_reserve_prefills=0)
    # 20 tokens in 0.79 s: its mean would pass 40 ms/token after a step of more than 10 ms, so the
    # step gets the interference cap and nothing from the bank: 1.1 x the 20 ms online step.
    behind = online_decoding(0, outputs=20, decode_s=0.79)
    plan = CoServePolicy(LATENCY, LAYOUT, cfg).schedule(state(behind, *[decoding(i, OFF) for i in range(100)]))
    assert plan.info["budget_ms"] == pytest.approx(22)
    assert plan.num_tokens == 10  # 20 ms up to 8 tokens, then 1 ms per token


def test_the_least_banked_decoding_request_sets_the_budget():
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=0.8,
                                                  interference_slack=0.1, bank_reserve_prefills=0))
    ahead = online_decoding(0, outputs=20, decode_s=0.5)
    tight = online_decoding(1, outputs=10, decode_s=0.37)  # 400 - 370 = 30 ms left
    plan = policy.schedule(state(ahead, tight, *[decoding(i, OFF) for i in range(100)]))
    assert plan.info["budget_ms"] == pytest.approx(30)


def test_the_bank_keeps_a_reserve_for_the_longest_recent_online_prefill():
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(slo=SLO(ttft_ms=5000, tpot_ms=50), slo_margin=0.8,
                                                  interference_slack=0.1, bank_reserve_prefills=1.0,
                                                  bank_step_max_slos=1.0))
    offline = [decoding(i, OFF) for i in range(100)]
    ahead = online_decoding(0, outputs=20, decode_s=0.5)  # 300 ms banked
    # A 300-token prompt seen recently: prefilling it again would take 20 + 292 ms > 300 ms.
    policy.schedule(state(seq(1, ON, tokens=300), *offline))
    assert policy.schedule(state(ahead, *offline)).info["budget_ms"] == pytest.approx(22)
    # Once 32 newer online requests with short prompts have been seen, the long one ages out.
    for i in range(32):
        policy.schedule(state(seq(100 + i, ON, tokens=40), *offline))
    assert policy.schedule(state(ahead, *offline)).info["budget_ms"] == 50


def test_co_serving_ttft_budget_shrinks_as_the_request_waits():
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(slo=SLO(ttft_ms=300, tpot_ms=1000), **FILL))
    waiting_online = seq(0, ON, tokens=100, arrival=0.9)
    offline = [decoding(i, OFF) for i in range(300)]
    fresh = policy.schedule(state(waiting_online, *offline, now=0.9))
    late = policy.schedule(state(waiting_online, *offline, now=1.15))
    assert ids(fresh)["online0"] == 100 and ids(late)["online0"] == 100
    assert fresh.num_tokens > late.num_tokens  # more offline decodes while the request is fresh


def test_online_takes_blocks_from_checkpointed_offline_first():
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(online_reserve_fraction=0.0))
    cheap = decoding(1, OFF, ctx=64, arrival=0.1, ckpt=64)   # fully on the host: free to drop
    costly = decoding(2, OFF, ctx=64, arrival=0.2, ckpt=0)
    plan = policy.schedule(state(cheap, costly, seq(0, ON, tokens=60, arrival=0.9), free=0, total=10))
    assert plan.preempt == ("offline1",)
    assert ids(plan)["online0"] == 60


def test_new_offline_work_stays_out_of_the_online_reserve():
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(online_reserve_fraction=0.2))
    plan = policy.schedule(state(seq(0, OFF, tokens=30), free=20, total=100))
    assert ids(plan) == {}
    plan = policy.schedule(state(seq(0, OFF, tokens=30), free=40, total=100))
    assert ids(plan) == {"offline0": 30}


def test_algorithm_2_aborts_only_when_ttft_would_be_missed():
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(slo=SLO(ttft_ms=200, tpot_ms=50)))
    arrival = state(seq(0, ON, tokens=50, arrival=1.0), now=1.0)   # online prefill: ~62 ms
    long_step = RunningStep(BatchShape(num_tokens=500), started_s=1.0, preemptible=True)   # ~512 ms
    short_step = RunningStep(BatchShape(num_tokens=60), started_s=1.0, preemptible=True)   # ~72 ms
    assert policy.should_abort_step(arrival, long_step)
    assert not policy.should_abort_step(arrival, short_step)
    co_serving_step = RunningStep(BatchShape(num_tokens=500), started_s=1.0, preemptible=False)
    assert not policy.should_abort_step(arrival, co_serving_step)


def test_algorithm_2_with_an_interference_cap_lets_an_arrival_wait_only_a_slack_share_of_its_prefill():
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(slo=SLO(ttft_ms=2000, tpot_ms=50), interference_slack=0.1))
    arrival = state(seq(0, ON, tokens=50, arrival=1.0), now=1.0)   # online prefill: ~62 ms
    # Finishing a ~72 ms step keeps the 2 s TTFT SLO, but 72 ms is more than 10% of 62 ms.
    assert policy.should_abort_step(arrival, RunningStep(BatchShape(num_tokens=60), 1.0, True))
    # 70 ms into it, ~2 ms remain: under 6.2 ms, the step finishes.
    assert not policy.should_abort_step(state(seq(0, ON, tokens=50, arrival=1.07), now=1.07),
                                        RunningStep(BatchShape(num_tokens=60), 1.0, True))



def test_algorithm_2_judges_a_step_that_overran_its_estimate_by_its_own_pace():
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(slo=SLO(ttft_ms=200, tpot_ms=50)))
    # A ~512 ms step, 600 ms in: the estimate says it is done, so the arrival would wait for it.
    arrival = state(seq(0, ON, tokens=50, arrival=1.6), now=1.6)   # online prefill: ~62 ms
    overran = RunningStep(BatchShape(num_tokens=500), started_s=1.0, preemptible=True)
    assert not policy.should_abort_step(arrival, overran)
    # But it is only at layer 10 of 30: at its pace, 21 more layers take 1.26 s.
    assert policy.should_abort_step(arrival, replace(overran, layer_reached=10))
    # At the LM head, 600 ms in, one layer's time (20 ms) is left: the step finishes.
    assert not policy.should_abort_step(arrival, replace(overran, layer_reached=30))

def test_priority_fills_with_offline_without_budget_and_never_aborts():
    policy = PriorityPolicy(BatchLimits(max_batch_tokens=256))
    plan = policy.schedule(state(decoding(0, ON), *[seq(i, OFF, tokens=200) for i in range(3)]))
    assert plan.scheduled[0].seq_id == "online0" and plan.num_tokens == 256
    assert not policy.should_abort_step(state(), RunningStep(BatchShape(500), 0.0, True))


def test_priority_preempts_offline_for_online_memory():
    policy = PriorityPolicy()
    plan = policy.schedule(state(decoding(1, OFF, ctx=64), seq(0, ON, tokens=40), free=0, total=8))
    assert plan.preempt == ("offline1",) and "online0" in ids(plan)


def test_online_only_ignores_offline_and_fcfs_orders_by_arrival():
    assert ids(OnlineOnlyPolicy().schedule(state(seq(0, OFF), seq(1, ON)))) == {"online1": 10}
    plan = FCFSPolicy(BatchLimits(max_batch_tokens=15)).schedule(
        state(seq(0, ON, arrival=2.0), seq(1, OFF, arrival=1.0)))
    assert ids(plan) == {"offline1": 10, "online0": 5}


def test_invalid_policy_configs_raise_typed_errors():
    with pytest.raises(InvalidRequestError):
        CoServeConfig(preempt_target_ms=0)
    with pytest.raises(InvalidRequestError):
        CoServeConfig(online_reserve_fraction=1.0)
    with pytest.raises(InvalidRequestError):
        BatchLimits(max_batch_tokens=0)


def test_measured_step_times_correct_the_profile():
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=1.0, **FILL))
    busy = state(decoding(0, ON, arrival=0.5), *[decoding(i, OFF) for i in range(100)])
    before = policy.schedule(busy).num_tokens
    for _ in range(40):   # steps of this size run twice as slow as profiled
        policy.observe_step(BatchShape(num_tokens=30), 2 * LATENCY.estimate_ms(BatchShape(num_tokens=30)))
    # The observed bucket learns the slow-down; a step size never seen follows all steps' drift.
    assert 1.9 < policy.correction_for(30) <= 2.0 and 1.9 < policy.correction_for(300) <= 2.0
    after = policy.schedule(busy).num_tokens
    assert after < before
    assert LATENCY.estimate_ms(BatchShape(after)) * policy.correction_for(after) <= 50 + 1e-6


def test_a_bucket_keeps_its_own_correction_once_observed():
    policy = CoServePolicy(LATENCY, LAYOUT)
    for _ in range(40):
        policy.observe_step(BatchShape(num_tokens=1), 2 * LATENCY.estimate_ms(BatchShape(num_tokens=1)))
    for _ in range(40):
        policy.observe_step(BatchShape(num_tokens=300), LATENCY.estimate_ms(BatchShape(num_tokens=300)))
    assert 1.9 < policy.correction_for(1) <= 2.0
    assert policy.correction_for(300) == pytest.approx(1.0, abs=0.05)


def test_offline_tokens_added_to_a_step_drift_with_its_online_part():
    # Lone online decodes run faster than profiled (0.8x), big offline batches slower (1.5x); steps
    # of two tokens are never measured. Offline decodes riding on an online decode must be
    # estimated with the online step's drift, not with the overall drift the big batches set.
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=1.0,
                                                  interference_slack=0.1, bank_tpot_slack=False))
    for _ in range(40):
        policy.observe_step(BatchShape(num_tokens=300), 1.5 * LATENCY.estimate_ms(BatchShape(num_tokens=300)))
        policy.observe_step(BatchShape(num_tokens=1), 0.8 * LATENCY.estimate_ms(BatchShape(num_tokens=1)))
    assert policy.correction_for(2) > 1.1 > 0.85 > policy.correction_for(1)
    plan = policy.schedule(state(decoding(0, ON, arrival=0.5), *[decoding(i, OFF) for i in range(100)]))
    assert plan.info["budget_ms"] == pytest.approx(1.1 * policy.correction_for(1) * 20.0)
    # At the online step's drift the budget is 1.1 x its 20 ms: the floor up to 8 tokens, 2 more at 1 ms.
    assert plan.num_tokens == 10


def test_a_lone_compiled_decode_carries_no_offline_token_that_would_make_it_eager():
    # With compiled decode a lone decode takes 15 ms and any 2-token step the eager path's 22 ms:
    # the profile measures 2 tokens, so the first offline token shows its real cost.
    compiled = LatencyModel((1, 2, 8, 1024), (15.0, 22.0, 23.0, 1036.0))
    policy = CoServePolicy(compiled, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=1.0,
                                                   interference_slack=0.05, bank_tpot_slack=False))
    plan = policy.schedule(state(decoding(0, ON, arrival=0.5), *[decoding(i, OFF) for i in range(10)]))
    assert ids(plan) == {"online0": 1}
    assert plan.info["budget_ms"] == pytest.approx(1.05 * 15.0)


def test_offline_tokens_ride_only_where_they_cost_no_more_than_in_an_offline_batch():
    # A lone compiled decode takes 12 ms, any bigger step the eager path's 21 ms and up. A 30 ms
    # budget fits 14 offline decodes: 18 ms more, 1.29 ms each, where an offline batch of the 100
    # running decodes costs 1.15 ms per token. The online decode goes alone.
    compiled = LatencyModel((1, 2, 8, 1024), (12.0, 21.0, 23.0, 1039.0))
    cfg = uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=30), slo_margin=1.0, interference_slack=None,
                        bank_tpot_slack=False)
    online = decoding(0, ON, arrival=0.5)
    plan = CoServePolicy(compiled, LAYOUT, cfg).schedule(state(online, *[decoding(i, OFF) for i in range(100)]))
    assert ids(plan) == {"online0": 1} and plan.info["budget_ms"] == 30
    # With three offline requests an offline batch is mostly fixed cost (21.3 ms for 3 tokens); the
    # same three tokens on the online step cost 9.7 ms more, 3.2 ms each: they ride.
    few = CoServePolicy(compiled, LAYOUT, cfg).schedule(state(online, *[decoding(i, OFF) for i in range(3)]))
    assert ids(few) == {"online0": 1, "offline0": 1, "offline1": 1, "offline2": 1}
    # With a prompt waiting, an offline batch of the four costs 21.7 ms, 5.4 ms a token: the three
    # riders' 9.3 ms is within break-even (16.3 ms) but over a half share (8.1 ms), and at break-even
    # a chunk of the waiting prompt rides as well (ConServe Algorithm 1).
    backlog = state(online, *[decoding(i, OFF) for i in range(3)], seq(9, OFF, tokens=200, arrival=2.0))
    half = CoServePolicy(compiled, LAYOUT, replace(cfg, rider_cost_share=0.5, prefill_riders=False)).schedule(backlog)
    assert ids(half) == {"online0": 1}
    even = ids(CoServePolicy(compiled, LAYOUT, cfg).schedule(backlog))
    assert {"offline0", "offline1", "offline2", "offline9"} <= set(even) and even["offline9"] > 1
    # Where a step is bound by reading the weights (a GPU), riders are nearly free: they fill the
    # step up to its sequence cap.
    flat = LatencyModel((1, 64, 1024), (12.0, 12.5, 40.0))
    full = CoServePolicy(flat, LAYOUT, cfg).schedule(state(online, *[decoding(i, OFF) for i in range(100)]))
    assert full.num_tokens == BatchLimits().max_batch_seqs


def test_rolling_back_a_plan_returns_its_blocks_tokens_and_shape():
    st = state(decoding(0, ON), seq(1, OFF, tokens=40), free=10)
    plan = PlanBuilder(st, 512, 64, 512)
    plan.add(st.seqs[0])
    before = (plan.free_blocks, plan.tokens, plan.shape, plan.mark())
    plan.add(st.seqs[1])
    assert plan.free_blocks < before[0] and plan.tokens == 41
    plan.rollback(before[3])
    assert (plan.free_blocks, plan.tokens, plan.shape, plan.mark()) == before
    assert plan.add(st.seqs[1]) == 40  # it can be scheduled again


def test_prefill_steps_are_capped_at_the_tpot_budget_so_bursts_do_not_stack():
    policy = CoServePolicy(LATENCY, LAYOUT, uncapped_config(slo=SLO(ttft_ms=2000, tpot_ms=50), slo_margin=1.0))
    plan = policy.schedule(state(seq(0, ON, tokens=20, arrival=1.0), seq(0, OFF, tokens=900), now=1.0))
    assert plan.info["budget_ms"] == 50
    assert LATENCY.estimate_ms(BatchShape(plan.num_tokens)) <= 50


def test_riders_must_cost_at_most_their_share_of_a_batch_token():
    # Past 8 sequences a decode adds 0.6 ms: a rider adds that to the online step, while the batch
    # of all 64 offline requests decoding (53.6 ms) spends 0.84 ms a token.
    latency = LatencyModel((1, 8, 1024), (20.0, 20.0, 1036.0), decode_grid=(1, 8, 128),
                           decode_ms=(20.0, 20.0, 20.0 + 120 * 0.6))
    online = [decoding(i, ON, arrival=0.5) for i in range(8)]
    offline = [decoding(i, OFF) for i in range(64)]

    def riders(share: float) -> int:
        policy = CoServePolicy(latency, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=1.0,
                                                      rider_cost_share=share))
        return policy.schedule(state(*online, *offline)).num_tokens - len(online)

    assert riders(0.5) == 0 and riders(1.0) == 50  # 30 ms of budget left at 0.6 ms each
    with pytest.raises(InvalidRequestError, match="rider_cost_share"):
        CoServeConfig(rider_cost_share=-0.1)


def test_riders_are_weighed_against_the_whole_backlog_decoding_not_its_prompts():
    # A GPU-like profile: decodes from graphs are flat (3 ms up to 64), eager steps with prompt
    # chunks cost 11-19 ms. Against a batch priced with 2,048 cheap prompt tokens a rider looked
    # dear; against the backlog decoding it is nearly free.
    latency = LatencyModel((1, 2048), (11.0, 19.0), ms_per_kctx=0.1, decode_grid=(1, 64), decode_ms=(3.0, 3.5))
    policy = CoServePolicy(latency, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=1.0,
                                                  interference_slack=0.05))
    waiting = [seq(100 + i, OFF, tokens=300) for i in range(40)]
    plan = policy.schedule(state(decoding(0, ON, arrival=0.5), *[decoding(i, OFF) for i in range(8)], *waiting))
    assert plan.num_tokens > 1


def test_riders_that_prove_dearer_than_profiled_stop_riding():
    latency = LatencyModel((1, 2048), (11.0, 19.0), ms_per_kctx=0.1, decode_grid=(1, 64), decode_ms=(3.0, 3.5))
    policy = CoServePolicy(latency, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=1.0,
                                                  interference_slack=0.05, rider_cost_share=0.5,
                                                  prefill_riders=False))
    busy = state(decoding(0, ON, arrival=0.5), *[decoding(i, OFF) for i in range(8)],
                 *[seq(100 + i, OFF, tokens=300) for i in range(40)])
    online_ms = latency.estimate_ms(BatchShape().plus(1, 40))

    def run_steps(added_factor: float) -> None:
        for _ in range(20):
            plan = policy.schedule(busy)
            shape = BatchShape()
            for item in plan.scheduled:
                shape = shape.plus(item.num_tokens, 40)
            measured = online_ms + added_factor * (latency.estimate_ms(shape) - online_ms)
            policy.observe_step(shape, measured)

    run_steps(1.0)  # riders cost what the profile said: they keep riding
    assert policy.riders.correction == pytest.approx(1.0) and policy.schedule(busy).num_tokens > 1
    run_steps(8.0)  # each rider took 8x its estimate: riding stops once the correction says so
    assert policy.riders.correction > 1.5 and policy.schedule(busy).num_tokens == 1
