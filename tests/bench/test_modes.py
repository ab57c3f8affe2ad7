import math
from dataclasses import replace

import pytest

from backfill.bench.coserve_bench import CoserveRoundResult, run_in_rounds
from backfill.bench.scenario import CoserveScenario
from backfill.bench.driver import RunResult
from backfill.bench.metrics import RequestRecord
from backfill.bench.modes import ModeSpec, parse_modes
from backfill.errors import InvalidRequestError
from backfill.policy.config import CoServeConfig
from backfill.types import RequestClass
from backfill.serving.config import ServingConfig


def test_a_policy_alone_is_a_mode_with_the_runs_options():
    spec = ModeSpec.parse("coserve")
    assert (spec.label, spec.policy, dict(spec.overrides)) == ("coserve", "coserve", {})
    base = ServingConfig(coserve=CoServeConfig(interference_slack=0.1))
    assert spec.serving(base, kv_cache_gb=0.25) == replace(base, kv_cache_gb=0.25)
    assert not ModeSpec.parse("online-only").with_offline and spec.with_offline


def test_a_variant_sets_knobs_on_top_of_the_runs_options():
    spec = ModeSpec.parse("coserve:rider_cost_share=1,interference_slack=inf,release_suspended=off")
    assert spec.policy == "coserve"
    assert dict(spec.overrides) == {"rider_cost_share": 1.0, "interference_slack": math.inf,
                                    "release_suspended": False}
    cfg = spec.serving(ServingConfig(coserve=CoServeConfig(rider_cost_share=0.5, preempt_target_ms=6.0))).coserve
    assert (cfg.rider_cost_share, cfg.interference_slack, cfg.release_suspended, cfg.preempt_target_ms) == (
        1.0, math.inf, False, 6.0)


@pytest.mark.parametrize("label, message", [
    ("magic", "unknown mode"),
    ("coserve:", "no knob=value"),
    ("coserve:rider_cost_share", "knob=value"),
    ("coserve:threads=4", "knob=value"),
    ("coserve:rider_cost_share=lots", "rider_cost_share"),
    ("coserve:release_suspended=maybe", "not a bool"),
    ("online-only:rider_cost_share=1", "online-only takes none"),
    ("priority:interference_slack=0.1", "priority takes none"),
])
def test_bad_modes_are_refused_with_what_is_wrong(label, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_modes((label,))


def test_values_the_serving_config_refuses_and_repeated_modes_fail_before_anything_runs():
    with pytest.raises(InvalidRequestError, match="rider_cost_share"):
        parse_modes(("coserve:rider_cost_share=-1",))
    with pytest.raises(InvalidRequestError, match="online_reserve_fraction"):
        parse_modes(("coserve:online_reserve_fraction=2",))
    with pytest.raises(InvalidRequestError, match="named twice"):
        parse_modes(("coserve", "priority", "coserve"))


def test_rounds_run_variants_interleaved_with_the_baseline_first():
    calls = []

    def run_mode(spec, scenario, slo, k):
        calls.append((k, spec.label, spec.serving(ServingConfig()).coserve.rider_cost_share))
        record = RequestRecord("on0", RequestClass.ONLINE, scheduled_s=0.0, send_s=0.0, first_token_s=0.1,
                               chunk_times_s=[0.1, 0.15], chunk_tokens=[1, 1], end_s=0.15, prompt_tokens=8,
                               output_tokens=2)
        return CoserveRoundResult(RunResult(records=[record], duration_s=scenario.duration_s)), {}

    results = run_in_rounds(CoserveScenario(duration_s=2.0, rounds=2),
                            ("coserve:rider_cost_share=1", "coserve", "online-only"), run_mode)
    assert calls == [(0, "online-only", 1.0), (0, "coserve:rider_cost_share=1", 1.0), (0, "coserve", 1.0),
                     (1, "online-only", 1.0), (1, "coserve:rider_cost_share=1", 1.0), (1, "coserve", 1.0)]
    assert list(results) == ["online-only", "coserve:rider_cost_share=1", "coserve"]
    variant = results["coserve:rider_cost_share=1"].config
    assert variant["policy"] == "coserve" and variant["overrides"] == {"rider_cost_share": 1.0}
