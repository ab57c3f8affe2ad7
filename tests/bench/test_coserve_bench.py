"""The demo's workload sized to the machine: offline requests that finish within the window."""

from backfill.bench.coserve_bench import OFFLINE_PREFILL_SHARE, online_rate_per_s, size_offline_to_machine
from backfill.bench.lengths import parse_length_spec
from backfill.bench.scenario import CoserveScenario
from backfill.policy.latency_model import LatencyModel


def test_a_slow_machine_gets_offline_prompts_it_prefills_in_the_window():
    scenario = CoserveScenario(duration_s=30.0, online_load=0.3, offline_concurrency=32)
    slow = LatencyModel((1, 2048), (40.0, 2048 * 4.5))      # about 4.5 ms per prompt token, 40 ms a decode step
    sized = size_offline_to_machine(scenario, slow)
    prompt = parse_length_spec(sized.offline_prompt_len)
    assert prompt.hi < parse_length_spec(scenario.offline_prompt_len).hi
    # the prompts in flight are prefilled within their share of the window (to the rounding of the minimum)
    assert 32 * (prompt.lo + prompt.hi) / 2 * 4.5 / 1e3 <= max(OFFLINE_PREFILL_SHARE * 30.0 * 0.7, 32 * 32 * 4.5 / 1e3)
    assert parse_length_spec(sized.offline_output_len).hi >= 16


def test_the_online_rate_is_the_load_of_one_request_alone():
    scenario = CoserveScenario(online_load=0.5)
    slow, fast = LatencyModel((1, 2048), (400.0, 4000.0)), LatencyModel((1, 2048), (20.0, 200.0))
    assert online_rate_per_s(scenario, fast) > 10 * online_rate_per_s(scenario, slow)


def test_a_fast_machine_keeps_the_scenario_as_given():
    scenario = CoserveScenario(duration_s=30.0, online_load=0.3, offline_concurrency=32)
    fast = LatencyModel((1, 2048), (2.0, 2048 * 0.01))
    assert size_offline_to_machine(scenario, fast) == scenario


def test_a_profile_that_leaves_no_online_request_says_which_duration_to_give():
    import pytest

    from backfill.bench.coserve_bench import make_workload
    from backfill.engine.byte_tokenizer import ByteTokenizer
    from backfill.errors import WorkloadError

    crawling = LatencyModel((1, 2048), (4000.0, 40000.0))     # one request alone: minutes
    with pytest.raises(WorkloadError, match=r"no online request in 20 s.*--duration \(about \d+ s"):
        make_workload(CoserveScenario(duration_s=20.0, online_load=0.3), ByteTokenizer(), crawling,
                      with_offline=False)
