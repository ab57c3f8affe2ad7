"""The simulated runner: costs on a virtual clock, safepoints where the engine has them, and the
real Scheduler driving it unchanged."""

import pytest

from backfill.engine.config import ModelConfig
from backfill.engine.model import LM_HEAD_SLICES
from backfill.engine.step import SeqChunk
from backfill.sampling_params import SamplingParams
from backfill.errors import InvalidRequestError
from backfill.policy.baselines import FCFSPolicy
from backfill.policy.latency_model import BatchShape, LatencyModel
from backfill.types import GenerationRequest, RequestClass
from backfill.serving.scheduler import Scheduler
from backfill.bench.sim.runner import SimulatedRunner, VirtualClock

REAL = ModelConfig.tiny(num_layers=4)
# 10 ms for a lone token, +1 ms per further token; no context terms.
COST = LatencyModel((1, 101), (10.0, 110.0))


def runner(on_time=lambda now: None, **kwargs) -> SimulatedRunner:
    return SimulatedRunner(REAL, 32, COST, VirtualClock(), block_size=8, on_time=on_time, **kwargs)


def decode_chunk(seq_id="a", pos=5) -> SeqChunk:
    return SeqChunk(seq_id, [1], pos, [0])


def test_a_step_advances_the_clock_by_its_cost_and_returns_one_row_of_logits_per_sequence():
    r = runner()
    out = r.execute([decode_chunk("a"), SeqChunk("b", [1, 2, 3], 0, [1])])
    assert r.clock() == pytest.approx(COST.estimate_ms(BatchShape().plus(1, 5).plus(3, 0)) / 1e3)
    assert out.logit_seq_ids == ["a", "b"] and tuple(out.logits.shape) == (2, r.config.vocab_size)
    assert out.duration_s == pytest.approx(r.clock()) and not out.aborted
    # The KV pool keeps the real model's layer count at a one-float row.
    assert r.config.num_layers == REAL.num_layers and r.kv.num_blocks == 32


def test_safepoints_come_three_per_layer_then_in_the_lm_head_at_growing_times():
    seen = []
    r = runner()
    r.execute([decode_chunk()], safepoint=lambda layer: seen.append((layer, r.clock())) or False)
    layers = [layer for layer, _ in seen]
    # The first layer's first stretch has no check before it, as in the engine's forward.
    assert layers == [0, 0] + [li for li in range(1, REAL.num_layers) for _ in range(3)] \
        + [REAL.num_layers] * LM_HEAD_SLICES
    times = [t for _, t in seen]
    assert times == sorted(times) and times[0] > 0 and times[-1] < r.clock()


def test_an_abort_suspends_the_step_and_resuming_runs_only_what_was_left():
    r = runner()
    full_ms = COST.estimate_ms(BatchShape().plus(1, 5))
    out = r.execute([decode_chunk()], safepoint=lambda layer: layer == 2)
    assert out.aborted and out.aborted_at_layer == 2 and out.suspended.layer == 2
    ran_s = r.clock()
    assert 0 < ran_s < full_ms / 1e3 and out.duration_s == pytest.approx(ran_s)
    done = r.execute([decode_chunk()], resume=out.suspended)
    assert not done.aborted and done.logit_seq_ids == ["a"]
    assert r.clock() == pytest.approx(full_ms / 1e3)  # nothing redone, nothing skipped


def test_what_is_due_is_delivered_before_each_safepoint():
    deliveries = []
    r = runner(on_time=deliveries.append)
    r.execute([decode_chunk()], safepoint=lambda layer: False)
    assert len(deliveries) > 3 * REAL.num_layers and deliveries == sorted(deliveries)


def test_noise_keeps_the_mean_and_overhead_adds_to_every_step():
    r = runner(noise_cv=0.5, seed=1)
    times = []
    for _ in range(400):
        before = r.clock()
        r.execute([decode_chunk()])
        times.append((r.clock() - before) * 1e3)
    assert len(set(times)) > 300 and sum(times) / len(times) == pytest.approx(10.0, rel=0.1)
    slow = runner(step_overhead_ms=2.0)
    slow.execute([decode_chunk()])
    assert slow.clock() == pytest.approx(12.0 / 1e3)


def test_bad_input_is_refused():
    with pytest.raises(InvalidRequestError):
        runner(noise_cv=-1.0)
    with pytest.raises(ValueError, match="block table"):
        runner().execute([SeqChunk("a", [1] * 20, 0, [0])])  # 20 tokens in one 8-token block
    with pytest.raises(ValueError, match="back"):
        VirtualClock().advance_ms(-1.0)


def test_the_real_scheduler_drives_it_on_virtual_time():
    clock = VirtualClock()
    r = SimulatedRunner(REAL, 32, COST, clock, block_size=8)
    scheduler = Scheduler(r, FCFSPolicy(), clock=clock)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    scheduler.add(GenerationRequest([3] * 12, params, RequestClass.ONLINE, "x", arrival_time=0.0))
    times = []
    while scheduler.has_work():
        times += [e.time for e in scheduler.step()]
    # One 12-token prefill (21 ms), then four lone decodes (10 ms each).
    assert times == pytest.approx([0.021, 0.031, 0.041, 0.051, 0.061])
    assert r.kv.num_free == r.kv.num_usable
