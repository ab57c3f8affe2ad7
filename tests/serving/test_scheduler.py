"""The scheduler mechanism on a tiny random model: equality under batching, preemption,
checkpoint/restore and aborts, and that no offline request is ever dropped."""

import pytest

from backfill.engine.config import ModelConfig, SafepointLayout
from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.runner import ModelRunner
from backfill.sampling_params import SamplingParams
from backfill.errors import ContextLengthError, InvalidRequestError
from backfill.policy.baselines import FCFSPolicy, OnlineOnlyPolicy, PriorityPolicy
from backfill.policy.checkpoint import AdaptiveCheckpointPolicy, CheckpointConfig
from backfill.policy.coserve import CoServePolicy
from backfill.policy.config import CoServeConfig
from backfill.policy.latency_model import LatencyModel
from backfill.policy.planner import BatchLimits
from backfill.types import FinishReason, GenerationRequest, RequestClass, SLO
from backfill.serving.scheduler import Scheduler

GREEDY = SamplingParams.greedy_params(max_tokens=24)
ONLINE, OFFLINE = RequestClass.ONLINE, RequestClass.OFFLINE
TINY_LAYOUT = SafepointLayout(ModelConfig.tiny().num_layers, 0.5)  # the tiny_runner's
FLAT_LATENCY = LatencyModel((1, 4096), (1.0, 1.0 + 4096 * 0.01))


def _requests(n: int, cls=OFFLINE, prompt_len: int = 13, params=GREEDY, prefix="r"):
    return [GenerationRequest([3 + (i * 7 + j * 5) % 250 for j in range(prompt_len + i)], params, cls,
                              request_id=f"{prefix}{i}") for i in range(n)]


def _drain(scheduler: Scheduler, on_step=None) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    reasons = {}
    steps = 0
    while scheduler.has_work():
        for event in scheduler.step():
            out.setdefault(event.request_id, []).extend(event.token_ids)
            if event.finished:
                reasons[event.request_id] = event.finish_reason
        steps += 1
        if on_step:
            on_step(steps)
        assert steps < 5000
    return out, reasons


def _alone(runner, request) -> list[int]:
    solo = GenerationRequest(request.prompt_token_ids, request.sampling, request_id=request.request_id)
    scheduler = Scheduler(runner, FCFSPolicy())
    scheduler.add(solo)
    return _drain(scheduler)[0][request.request_id]


@pytest.mark.parametrize("policy", [FCFSPolicy(BatchLimits(max_batch_tokens=16, prefill_chunk_tokens=8)),
                                    PriorityPolicy(), CoServePolicy(FLAT_LATENCY, TINY_LAYOUT)])
def test_batched_and_chunked_generation_equals_alone(tiny_runner, policy):
    reqs = _requests(3, ONLINE) + _requests(4, OFFLINE, prefix="o")
    expected = {r.request_id: _alone(tiny_runner, r) for r in reqs}
    scheduler = Scheduler(tiny_runner, policy)
    for r in reqs:
        scheduler.add(r)
    out, reasons = _drain(scheduler)
    assert out == expected
    assert all(len(v) == 24 for v in out.values())
    assert set(reasons.values()) == {FinishReason.LENGTH}
    assert tiny_runner.kv.num_free == tiny_runner.kv.num_blocks


def test_online_only_policy_never_runs_offline(tiny_runner):
    scheduler = Scheduler(tiny_runner, OnlineOnlyPolicy())
    scheduler.add(_requests(1, OFFLINE)[0])
    scheduler.add(_requests(1, ONLINE, prefix="on")[0])
    for _ in range(40):
        scheduler.step()
    assert scheduler.stats.output_tokens == {"online": 24, "offline": 0}


def _offline_with_arrivals_at(tiny_runner, layer: int, num_offline: int, num_online: int):
    """A tight-TTFT coserve scheduler on offline work; an online request shows up at `layer`'s
    safepoint of each step until num_online have arrived. Returns it and the offline tokens alone."""
    offline = _requests(num_offline, OFFLINE)
    expected = {r.request_id: _alone(tiny_runner, r) for r in offline}
    tight = CoServePolicy(FLAT_LATENCY, TINY_LAYOUT, CoServeConfig(slo=SLO(ttft_ms=0.001, tpot_ms=50.0)))
    scheduler = Scheduler(tiny_runner, tight)
    for r in offline:
        scheduler.add(r)
    arrivals = iter(_requests(num_online, ONLINE, params=SamplingParams.greedy_params(max_tokens=4), prefix="on"))
    original = scheduler.step_preemption.safepoint

    def safepoint_with_arrival(at: int) -> bool:
        if at == layer and not scheduler.step_preemption.abort.is_set():
            request = next(arrivals, None)
            if request is not None:
                scheduler.add(request)
        return original(at)

    scheduler.step_preemption.safepoint = safepoint_with_arrival
    return scheduler, expected


def test_abort_at_safepoint_then_resume_gives_identical_tokens(tiny_runner):
    """Online arrivals abort pure-offline steps (Algorithm 2); offline output is unchanged."""
    # An online request shows up while an offline step is between layers 1 and 2.
    scheduler, expected = _offline_with_arrivals_at(tiny_runner, 2, num_offline=4, num_online=3)
    out, _ = _drain(scheduler)
    assert scheduler.stats.aborted_steps == 3
    assert len(scheduler.stats.preemption_latencies_ms) == 3
    for event in scheduler.stats.preemption_events:
        # Flagged on arrival (inside add), yielded at the same layer's safepoint: no step in between.
        assert event.layer == 2 and event.step_tokens > 0
        assert 0 <= event.flag_ms <= event.latency_ms
    aborted = [s for s in scheduler.stats.step_log if s.aborted]
    assert len(aborted) == 3 and all(s.mode == "offline-batching" and s.online_tokens == 0 for s in aborted)
    # Every online token fed once: the prompt (but what the prefix cache held: these prompts are
    # the offline ones'), then each output token but the last.
    fed = sum(len(r.prompt_token_ids) + 4 - 1 for r in _requests(3, ONLINE, prefix="on"))
    fed -= scheduler.stats.prefix_cache_hits["online"]
    assert sum(s.online_tokens for s in scheduler.stats.step_log) == fed
    assert {k: out[k] for k in expected} == expected
    assert all(len(out[f"on{i}"]) == 4 for i in range(3))
    # Each aborted step was continued from its safepoint once the online work was done: no layer redone.
    assert scheduler.stats.resumed_steps >= 1 and scheduler.stats.wasted_tokens == 0
    # The step log counts a resumed step's tokens (its plan schedules none of its own).
    assert all(s.offline_tokens > 0 for s in scheduler.stats.step_log if s.mode == "offline-batching")



def test_algorithm_2_sees_how_far_the_running_step_got(tiny_runner):
    scheduler, _ = _offline_with_arrivals_at(tiny_runner, 2, num_offline=2, num_online=1)
    seen = []
    decide = scheduler.policy.should_abort_step
    scheduler.policy.should_abort_step = lambda state, step: seen.append(step.layer_reached) or decide(state, step)
    _drain(scheduler)
    # Consulted when the step starts (an arrival may race with planning), then at the arrival,
    # which the test makes at layer 2's safepoint.
    assert 2 in seen and all(0 <= layer <= tiny_runner.config.num_layers for layer in seen)

def test_a_cancel_voids_the_suspended_step_which_is_redone_for_the_others(tiny_runner):
    scheduler, expected = _offline_with_arrivals_at(tiny_runner, 2, num_offline=4, num_online=1)
    while scheduler.step_preemption.suspended is None:
        scheduler.step()
    victim = next(iter(scheduler.step_preemption.suspended.kv_state))
    scheduler.cancel(victim)
    out, reasons = _drain(scheduler)
    assert reasons[victim] is FinishReason.CANCELLED
    assert scheduler.stats.resumed_steps == 0 and scheduler.stats.wasted_tokens > 0
    assert {k: out[k] for k in expected if k != victim} == {k: v for k, v in expected.items() if k != victim}
    assert tiny_runner.kv.num_free == tiny_runner.kv.num_blocks


class SteadyRunner(ModelRunner):
    """The real runner, with each suspended step reporting 1 ms of forward time: giving a step up is
    weighed against that time, which a loaded machine stretches a hundredfold."""

    def execute(self, chunks, safepoint=None, resume=None):
        out = super().execute(chunks, safepoint, resume)
        if out.suspended is not None:
            out.suspended.ran_s = 0.001
        return out


def test_requests_of_a_suspended_step_ride_in_co_serving_and_still_give_identical_tokens(tiny_runner):
    """Riders cost nothing in this profile (decodes flat at 1 ms), and each online request has 15
    decodes left: co-serving steps give the suspended step up and take its requests as riders.
    Their tokens are those of an undisturbed run."""
    offline = _requests(4, OFFLINE)
    expected = {r.request_id: _alone(tiny_runner, r) for r in offline}
    free_riders = LatencyModel((1, 4096), (1.0, 41.0), decode_grid=(1, 64), decode_ms=(1.0, 1.0))
    policy = CoServePolicy(free_riders, TINY_LAYOUT, CoServeConfig(slo=SLO(ttft_ms=0.001, tpot_ms=50.0)))
    scheduler = Scheduler(SteadyRunner(tiny_runner.model, tiny_runner.kv), policy)
    for r in offline:
        scheduler.add(r)
    arrivals = iter(_requests(2, ONLINE, params=SamplingParams.greedy_params(max_tokens=16), prefix="on"))
    original = scheduler.step_preemption.safepoint

    def safepoint_with_arrival(at: int) -> bool:
        # Once the offline requests decode: requests still in prefill never ride.
        if at == 2 and scheduler.stats.steps >= 3 and not scheduler.step_preemption.abort.is_set():
            request = next(arrivals, None)
            if request is not None:
                scheduler.add(request)
        return original(at)

    scheduler.step_preemption.safepoint = safepoint_with_arrival
    out, _ = _drain(scheduler)
    assert scheduler.stats.aborted_steps >= 1
    assert scheduler.stats.wasted_tokens > 0 and scheduler.stats.wasted_forward_s > 0  # a step given up
    assert any(s.mode == "co-serving" and s.online_tokens and s.offline_tokens for s in scheduler.stats.step_log)
    assert {k: out[k] for k in expected} == expected
    assert all(len(out[f"on{i}"]) == 16 for i in range(2))
    assert tiny_runner.kv.num_free == tiny_runner.kv.num_blocks


def test_arrival_after_the_last_layer_suspends_the_step_in_its_lm_head(tiny_runner):
    """Past the last layer only the LM head is left, the longest stretch of a big step: the step
    yields there too, and is continued from there once the online work is done."""
    scheduler, expected = _offline_with_arrivals_at(tiny_runner, tiny_runner.config.num_layers,
                                                    num_offline=2, num_online=1)
    out, _ = _drain(scheduler)
    assert scheduler.stats.aborted_steps == 1
    assert [e.layer for e in scheduler.stats.preemption_events] == [tiny_runner.config.num_layers]
    assert scheduler.stats.resumed_steps == 1 and scheduler.stats.wasted_tokens == 0
    assert {k: out[k] for k in expected} == expected and len(out["on0"]) == 4


def _online_burst_on_a_small_pool(tiny_config, tiny_runner, device, checkpoint: CheckpointConfig):
    """4 offline requests on a 14-block pool, 2 online ones arriving at step 12: offline is
    preempted. Returns the scheduler, the small runner, the tokens out and the undisturbed tokens."""
    small = ModelRunner(tiny_runner.model, KVBlockPool(tiny_config, num_blocks=14, block_size=8, device=device))
    offline = _requests(4, OFFLINE, prompt_len=10, params=SamplingParams.greedy_params(max_tokens=30))
    online = _requests(2, ONLINE, prompt_len=20, params=SamplingParams.greedy_params(max_tokens=20), prefix="on")
    expected = {r.request_id: _alone(tiny_runner, r) for r in offline + online}
    scheduler = Scheduler(small, CoServePolicy(FLAT_LATENCY, TINY_LAYOUT, CoServeConfig(online_reserve_fraction=0.0)),
                          checkpoint_policy=AdaptiveCheckpointPolicy(checkpoint))
    for r in offline:
        scheduler.add(r)

    def arrive(step: int) -> None:
        if step == 12:
            for r in online:
                scheduler.add(r)

    out, _ = _drain(scheduler, arrive)
    return scheduler, small, out, expected


def test_memory_pressure_preempts_offline_and_checkpoint_restore_is_exact(tiny_config, tiny_runner, device):
    """A small pool forces offline requests off the device; checkpointed KV comes back bit-exact."""
    scheduler, small, out, expected = _online_burst_on_a_small_pool(tiny_config, tiny_runner, device,
                                                                    CheckpointConfig(start_usage=0.0))
    stats = scheduler.stats
    assert out == expected, "preempted-and-resumed requests must produce the undisturbed tokens"
    assert stats.preempted_requests > 0 and stats.restored_tokens > 0 and stats.checkpointed_tokens > 0
    assert stats.finished == {"online": 2, "offline": 4}
    assert small.kv.num_free == small.kv.num_blocks


ALWAYS_CHECKPOINT = CheckpointConfig(start_usage=0.0, full_usage=0.01)   # every offline request, every step


def test_checkpoints_after_steps_copy_whole_blocks_only(tiny_config, tiny_runner, device):
    """Re-copying the partial last block after every decode step would move a block per request per
    step; only blocks that filled up are copied, up to the step before a request's last (after
    its last step a finished request is not checkpointed)."""
    pool = KVBlockPool(tiny_config, num_blocks=64, block_size=8, device=device)
    scheduler = Scheduler(ModelRunner(tiny_runner.model, pool), CoServePolicy(FLAT_LATENCY, TINY_LAYOUT),
                          checkpoint_policy=AdaptiveCheckpointPolicy(ALWAYS_CHECKPOINT))
    reqs = _requests(4, OFFLINE, prompt_len=10, params=SamplingParams.greedy_params(max_tokens=30))
    for r in reqs:
        scheduler.add(r)
    _drain(scheduler)
    whole_blocks = sum((len(r.prompt_token_ids) + 28) // 8 for r in reqs)
    assert scheduler.stats.preempted_requests == 0
    assert scheduler.stats.checkpointed_tokens == whole_blocks * 8
    assert scheduler.stats.checkpoint_bytes == whole_blocks * pool.nbytes // pool.num_blocks


def test_steps_of_online_work_alone_do_not_consult_the_checkpoint_policy(tiny_config, tiny_runner, device):
    """Only a step that computed offline KV has any to copy; online steps skip the selection."""
    pool = KVBlockPool(tiny_config, num_blocks=64, block_size=8, device=device)
    checkpoints = AdaptiveCheckpointPolicy(ALWAYS_CHECKPOINT)
    consulted = []
    select = checkpoints.select
    checkpoints.select = lambda state: consulted.append(state.now_s) or select(state)
    scheduler = Scheduler(ModelRunner(tiny_runner.model, pool), OnlineOnlyPolicy(), checkpoint_policy=checkpoints)
    scheduler.add(_requests(1, ONLINE)[0])
    _drain(scheduler)
    assert consulted == [] and scheduler.stats.checkpointed_tokens == 0
    scheduler.policy = FCFSPolicy()
    scheduler.add(_requests(1, OFFLINE, prefix="o")[0])
    _drain(scheduler)
    assert len(consulted) == 24 and scheduler.stats.checkpointed_tokens > 0  # after every offline step


def test_preemption_saves_the_partial_block_so_nothing_is_recomputed(tiny_config, tiny_runner, device):
    scheduler, _, out, expected = _online_burst_on_a_small_pool(tiny_config, tiny_runner, device, ALWAYS_CHECKPOINT)
    stats = scheduler.stats
    assert out == expected
    assert stats.preempted_requests > 0 and stats.restored_tokens > 0
    assert stats.recomputed_tokens == 0
    # Per-mode accounting covers every offline token.
    assert set(stats.mode_busy_s) == {"offline-batching", "co-serving"}
    assert sum(stats.mode_offline_tokens.values()) == stats.output_tokens["offline"] == 4 * 30


def test_without_checkpoints_preempted_requests_recompute_and_match(tiny_config, tiny_runner, device):
    small = ModelRunner(tiny_runner.model, KVBlockPool(tiny_config, num_blocks=12, block_size=8, device=device))
    reqs = _requests(5, OFFLINE, prompt_len=9, params=SamplingParams.greedy_params(max_tokens=30))
    expected = {r.request_id: _alone(tiny_runner, r) for r in reqs}
    scheduler = Scheduler(small, PriorityPolicy())
    for r in reqs:
        scheduler.add(r)
    out, _ = _drain(scheduler)
    assert out == expected
    assert scheduler.stats.recomputed_tokens > 0
    assert scheduler.stats.finished["offline"] == 5


def test_no_offline_request_is_dropped_under_churn(tiny_config, tiny_runner, device):
    small = ModelRunner(tiny_runner.model, KVBlockPool(tiny_config, num_blocks=16, block_size=8, device=device))
    offline = _requests(12, OFFLINE, prompt_len=6, params=SamplingParams.greedy_params(max_tokens=12))
    online = _requests(8, ONLINE, prompt_len=8, params=SamplingParams.greedy_params(max_tokens=6), prefix="on")
    scheduler = Scheduler(small, CoServePolicy(FLAT_LATENCY, TINY_LAYOUT),
                          checkpoint_policy=AdaptiveCheckpointPolicy())
    for r in offline:
        scheduler.add(r)
    pending = list(online)

    def arrive(step: int) -> None:
        if step % 3 == 0 and pending:
            scheduler.add(pending.pop())

    out, reasons = _drain(scheduler, arrive)
    assert sorted(out) == sorted(r.request_id for r in offline + online)
    assert all(len(out[r.request_id]) == 12 for r in offline)
    assert all(reason is FinishReason.LENGTH for reason in reasons.values())


def test_stop_token_and_stop_string_and_cancel(tiny_runner):
    reference = _alone(tiny_runner, _requests(1, ONLINE)[0])
    stop_at = reference[5]
    req = GenerationRequest(_requests(1)[0].prompt_token_ids,
                            SamplingParams.greedy_params(max_tokens=24, stop_token_ids=[stop_at]), ONLINE)
    scheduler = Scheduler(tiny_runner, FCFSPolicy())
    scheduler.add(req)
    out, reasons = _drain(scheduler)
    assert out[req.request_id] == reference[: reference.index(stop_at) + 1]
    assert reasons[req.request_id] is FinishReason.STOP

    scheduler.add(GenerationRequest([5, 6, 7], GREEDY, request_id="c"))
    scheduler.step()
    scheduler.cancel("c")
    events = scheduler.step()
    assert events[-1].finish_reason is FinishReason.CANCELLED
    assert not scheduler.has_work() and tiny_runner.kv.num_free == tiny_runner.kv.num_blocks


def test_bad_requests_raise_typed_errors(tiny_runner, tiny_config):
    scheduler = Scheduler(tiny_runner, FCFSPolicy())
    with pytest.raises(ContextLengthError, match="maximum context length"):
        scheduler.add(GenerationRequest([5] * tiny_config.max_position_embeddings, GREEDY))
    with pytest.raises(InvalidRequestError, match="token ids"):
        scheduler.add(GenerationRequest([tiny_config.vocab_size + 1], GREEDY))
    with pytest.raises(InvalidRequestError):
        GenerationRequest([], GREEDY)
    assert not scheduler.has_work()


def test_invalidated_blocks_send_requests_back_to_recompute_identically(tiny_config, tiny_runner, device):
    """Valve §4.3: reclaimed blocks invalidate the requests on them; they recompute, nothing is lost."""
    runner = ModelRunner(tiny_runner.model, KVBlockPool(tiny_config, num_blocks=32, block_size=8, device=device))
    reqs = _requests(4, OFFLINE, prompt_len=12, params=SamplingParams.greedy_params(max_tokens=20))
    expected = {r.request_id: _alone(tiny_runner, r) for r in reqs}
    scheduler = Scheduler(runner, PriorityPolicy())
    for r in reqs:
        scheduler.add(r)
    taken: list[int] = []

    def reclaim(step: int) -> None:
        if step == 5:
            victim = next(iter(scheduler.seqs.values()))
            taken.extend(victim.block_table[:1] + [b for b in range(28, 32) if not runner.kv.is_allocated(b)])
            scheduler.invalidate_blocks(taken)

    out, _ = _drain(scheduler, reclaim)
    assert out == expected
    assert scheduler.stats.recomputed_tokens > 0
    assert runner.kv.retired == frozenset(taken)
    assert runner.kv.num_free == runner.kv.num_usable == 32 - len(taken)
    runner.kv.admit(taken)
    assert runner.kv.num_free == 32
