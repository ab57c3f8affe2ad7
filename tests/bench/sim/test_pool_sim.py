from dataclasses import replace

import pytest

from backfill.errors import PolicyInputError
from backfill.bench.node_bench import NodeBenchConfig
from backfill.bench.sim.pool_sim import simulate_pool


def test_bench_miad_settings_track_the_reclamation_target_over_ten_minutes():
    cfg = NodeBenchConfig()
    for seed in (0, 1, 2):
        result = simulate_pool(replace(cfg, duration_s=600.0, seed=seed))
        # Offline fills the pool, so every pressure event reclaims and MIAD's count is the pool's.
        assert result.pressure_events == result.reclamations
        assert result.mean_offline_handles > 0.5 * cfg.num_handles
        target = cfg.miad.target_events_per_min
        assert 0.75 * target <= result.reclamations_per_min <= 1.25 * target, (seed, result)


def test_a_lower_target_reclaims_less_often():
    cfg = NodeBenchConfig()
    rates = [simulate_pool(replace(cfg, duration_s=600.0, miad=replace(cfg.miad, target_events_per_min=target)))
             .reclamations_per_min for target in (2.0, 6.0)]
    assert rates[0] < rates[1]


def test_bad_settings_are_refused():
    with pytest.raises(PolicyInputError):
        simulate_pool(NodeBenchConfig(), step_s=0.0)
    with pytest.raises(PolicyInputError):
        simulate_pool(NodeBenchConfig(duration_s=0.0))
