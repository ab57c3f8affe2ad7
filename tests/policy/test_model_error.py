"""The latency model's error log and the margin the co-serving policy adapts from it."""

import pytest
from test_coserve import LAYOUT, OFF, ON, decoding, state, uncapped_config

from backfill.policy.coserve import MARGIN_MIN_STEPS, CoServePolicy
from backfill.policy.latency_model import BatchShape, LatencyModel
from backfill.policy.model_error import ModelErrorLog, summarize
from backfill.types import SLO


def test_summary_is_median_p90_and_signed_bias_of_relative_errors():
    log = ModelErrorLog()
    for predicted, measured in [(10, 10), (11, 10), (9, 10), (12, 10), (20, 10)]:
        log.observe("co-serving", predicted, measured)
    assert log.observe("co-serving", 5, 0) is None  # an untimed step is not an error
    s = log.summary()["co-serving"]
    assert s.steps == 5 and s.median == pytest.approx(0.1) and s.bias == pytest.approx(0.1)
    assert s.p90 == pytest.approx(0.68)  # numpy percentile, interpolated
    assert summarize([]) is None
    with pytest.raises(ValueError):
        ModelErrorLog(max_samples=0)


def test_policy_logs_its_prediction_per_step_mode_and_adapts_its_margin():
    latency = LatencyModel((1, 2048), (10.0, 50.0))
    policy = CoServePolicy(latency, LAYOUT, uncapped_config(slo=SLO(ttft_ms=500, tpot_ms=50), slo_margin=0.85))
    co = state(decoding(0, ON, arrival=0.5), *[decoding(i, OFF) for i in range(4)])
    for _ in range(MARGIN_MIN_STEPS):
        plan = policy.schedule(co)
        shape = BatchShape()
        for item in plan.scheduled:
            shape = shape.plus(item.num_tokens, 40)
        policy.observe_step(shape, 1.0 * latency.estimate_ms(shape))  # an exact model
    assert set(policy.model_error.summary()) == {"co-serving"}
    assert policy.model_error.summary()["co-serving"].median < 0.05
    assert policy.slo_margin == pytest.approx(policy.config.slo_margin_max, abs=0.05)  # most of the budget
    batching = policy.schedule(state(*[decoding(i, OFF) for i in range(4)]))
    shape = BatchShape()
    for item in batching.scheduled:
        shape = shape.plus(item.num_tokens, 40)
    policy.observe_step(shape, 2.0 * latency.estimate_ms(shape))
    assert policy.model_error.summary()["offline-batching"].bias == pytest.approx(-0.5, abs=0.05)
    # Steps running 1.5x their estimate: the margin shrinks so such a step still meets the SLO.
    for _ in range(300):
        plan = policy.schedule(co)
        shape = BatchShape()
        for item in plan.scheduled:
            shape = shape.plus(item.num_tokens, 40)
        policy.observe_step(shape, 1.5 * policy._planned[1] if policy._planned else 1.0)
    assert policy.slo_margin < 0.7
