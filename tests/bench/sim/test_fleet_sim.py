"""The fleet simulator drives the real ClusterController; the same rounds decide the same on a ClusterService."""

import numpy as np
import pytest

from backfill.bench.sim.fleet_sim import FleetConfig, make_jobs, simulate
from backfill.cluster.ray_cluster import ClusterService
from backfill.errors import ClusterInputError

SMALL = FleetConfig(devices=128, duration_s=600, window_s=120, seed=3)


def test_valve_guards_slas_better_than_naive_placers():
    valve = simulate(SMALL, "valve")
    naive = simulate(SMALL, "random")
    assert 0 < valve.utilisation_gain_pct <= 100 * (1 - valve.online_busy_share) + 1e-9
    assert valve.devices_saved > 0 and valve.offline_tokens > 0
    assert valve.jobs_rejected > 0 and naive.jobs_rejected == 0      # infeasible SLAs are refused, not queued
    assert valve.checks_meeting_sla > naive.checks_meeting_sla
    assert valve.evictions < naive.evictions
    again = simulate(SMALL, "valve")
    assert again.offline_tokens == valve.offline_tokens and again.evictions == valve.evictions


def test_recorded_rounds_decide_the_same_on_a_cluster_service():
    rounds = []
    simulate(SMALL, "valve", record=rounds)
    assert sum(len(r.decisions) for r in rounds) > 50
    service = ClusterService()
    jobs, _ = make_jobs(SMALL, np.random.default_rng(SMALL.seed + 1))
    for job in jobs:
        service.submit(job, ['{"custom_id": "x"}'])
    assert [service.decide(r.snapshot, r.measured, r.finished) for r in rounds] == [r.decisions for r in rounds]


def test_bad_fleet_config():
    with pytest.raises(ClusterInputError):
        FleetConfig(devices=0)
    with pytest.raises(ClusterInputError):
        simulate(SMALL, "nope")
