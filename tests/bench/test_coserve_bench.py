"""The demo's workload sized to the machine: offline requests that finish within the window."""

from backfill.bench.coserve_bench import OFFLINE_WAVE_SHARE, size_offline_to_machine
from backfill.bench.lengths import parse_length_spec
from backfill.bench.scenario import CoserveScenario
from backfill.policy.latency_model import LatencyModel


def _wave_s(scenario: CoserveScenario, prefill_ms_per_token: float, decode_ms: float) -> float:
    prompt = parse_length_spec(scenario.offline_prompt_len)
    output = parse_length_spec(scenario.offline_output_len)
    return (scenario.offline_concurrency * (prompt.lo + prompt.hi) / 2 * prefill_ms_per_token
            + (output.lo + output.hi) / 2 * decode_ms) / 1e3


def test_a_slow_machine_gets_offline_requests_that_finish_in_the_window():
    scenario = CoserveScenario(duration_s=30.0, online_load=0.3, offline_concurrency=32)
    slow = LatencyModel((1, 2048), (40.0, 2048 * 4.5))      # about 4.5 ms per prompt token, 40 ms a decode step
    sized = size_offline_to_machine(scenario, slow)
    assert parse_length_spec(sized.offline_prompt_len).hi < parse_length_spec(scenario.offline_prompt_len).hi
    budget_s = OFFLINE_WAVE_SHARE * 30.0 * 0.7
    assert _wave_s(sized, 4.5, 60.0) < 2 * budget_s      # within the budget, up to the decode-step estimate
    assert _wave_s(scenario, 4.5, 60.0) > 5 * budget_s


def test_a_fast_machine_keeps_the_scenario_as_given():
    scenario = CoserveScenario(duration_s=30.0, online_load=0.3, offline_concurrency=32)
    fast = LatencyModel((1, 2048), (2.0, 2048 * 0.01))
    assert size_offline_to_machine(scenario, fast) == scenario
