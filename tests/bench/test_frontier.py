"""The frontier table: settings, SLO parsing and what the table says."""

import pytest

from backfill.bench.frontier import FrontierPoint, frontier_table, parse_slos, settings
from backfill.bench.scenario import CoserveScenario
from backfill.errors import InvalidRequestError


def test_settings_are_the_product_of_loads_and_slos_and_keep_an_axis_not_given():
    base = CoserveScenario(ttft_slo_ms=None, tpot_slo_ms=None)
    grid = settings(base, [0.1, 0.6], [(200.0, 15.0), (100.0, 10.0)])
    assert [(s.online_load, s.ttft_slo_ms, s.tpot_slo_ms) for s in grid] == [
        (0.1, 200.0, 15.0), (0.1, 100.0, 10.0), (0.6, 200.0, 15.0), (0.6, 100.0, 10.0)]
    assert [(s.online_load, s.tpot_slo_ms) for s in settings(base, [0.3], None)] == [(0.3, None)]


def test_alone_means_online_only_p99s():
    assert parse_slos(["alone", "200/15"]) == [(None, None), (200.0, 15.0)]


@pytest.mark.parametrize("spec", ["200", "a/b", "200/0", "200/15/3"])
def test_malformed_slo_settings_are_refused(spec):
    with pytest.raises(InvalidRequestError):
        parse_slos([spec])


def test_table_gives_attainment_offline_rate_and_the_ratio_to_priority():
    p = FrontierPoint(0.3, 200.0, 15.0, {"online-only": (None, 0.0), "priority": (0.42, 2000.0),
                                         "coserve": (1.0, 1900.0)},
                      {"coserve": {"co-serving": {"median": 0.04, "p90": 0.1, "bias": 0.0, "steps": 9}}})
    table = frontier_table([p])
    row = table.splitlines()[2]
    assert "| 0.3 | 200 / 15 | 42.0% | 2,000 | 100.0% | 1,900 | 0.950x | 4.0% |" == row
    with pytest.raises(InvalidRequestError):
        frontier_table([])


def _alone(ttft_p50, tpot_p50):
    return {"ttft_p50": ttft_p50, "ttft_p99": 2 * ttft_p50, "tpot_p50": tpot_p50, "tpot_p99": 2 * tpot_p50}


def test_an_slo_online_only_misses_alone_is_called_unreachable_with_what_to_give():
    from backfill.bench.frontier import unreachable_slos

    modes = {"online-only": (None, 0.0), "coserve": (0.0, 100.0)}
    points = [FrontierPoint(load, 200.0, 15.0, modes, {}, _alone(ttft, 40.0)) for load, ttft in ((0.1, 400.0),
                                                                                                (0.6, 900.0))]
    lines = unreachable_slos(points)
    assert len(lines) == 1 and "SLO 200/15 ms is below what online-only reaches" in lines[0]
    assert "at load 0.1" in lines[0] and "--slos 960/96" in lines[0]
    reachable = [FrontierPoint(0.1, 2000.0, 150.0, modes, {}, _alone(400.0, 40.0))]
    assert unreachable_slos(reachable) == []
    assert unreachable_slos([FrontierPoint(0.1, None, None, modes, {}, _alone(400.0, 40.0))]) == []
