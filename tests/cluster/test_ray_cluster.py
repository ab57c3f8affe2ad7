"""A real local Ray cluster (3 nodes on 127.0.0.1): online traffic on every node's HTTP endpoint,
3 offline batch jobs placed by the ClusterService actor, an SLA eviction, a node killed mid-job,
and the fleet simulator's 64-device rounds decided again by a ClusterService actor on Ray.

The eviction does not depend on how fast the machine is: the raised node's online service is kept
busy without a gap (closed-loop clients), so its gate stays shut and its job gets almost no tokens
against an SLA of 0.2 x T_mono, while every other node keeps about half of T_mono or more."""

import numpy as np
import pytest

from backfill.bench.sim.fleet_sim import FleetConfig, make_jobs, simulate
from backfill.cluster.ray_cluster import ClusterService, CpuContention
from backfill.bench.cluster_scenario import ScenarioConfig, run_scenario
from backfill.errors import ClusterInputError


def test_cpu_contention_shares_a_machine_between_its_busy_nodes():
    shared = CpuContention((1.0, 0.8, 0.6))
    assert shared.share(0.2) == 1.0 and shared.share(1) == 1.0     # alone, however lightly loaded the others
    assert shared.share(2.5) == pytest.approx(0.7)                  # linear between measured counts
    assert shared.share(6) == pytest.approx(0.6 * 3 / 6)            # past them, the cores split further
    assert CpuContention().share(5) == pytest.approx(1 / 5)
    for bad in ((), (1.0, 0.0), (1.2,)):
        with pytest.raises(ClusterInputError):
            CpuContention(bad)
    with pytest.raises(ClusterInputError):
        ClusterService(measure_window_s=0)


@pytest.mark.slow
def test_ray_cluster_moves_jobs_and_loses_nothing():
    fleet = FleetConfig(devices=64, duration_s=600, window_s=120)
    rounds = []
    simulate(fleet, "valve", record=rounds)
    jobs, _ = make_jobs(fleet, np.random.default_rng(fleet.seed + 1))
    result = run_scenario(ScenarioConfig(), replay=(jobs, rounds))

    assert result["replayed_decisions"] == [r.decisions for r in rounds]     # the same scheduler objects
    assert "no device in the cluster can meet the SLA" in result["rejection"]
    assert all(n > 0 for n in result["online_sent"].values())
    assert result["finished"] and result["exactly_once"]
    events = result["events"]
    evicted = [e for e in events if e["event"] == "evict"]
    assert evicted and evicted[0]["device_ids"] == [result["raised_node"]] and evicted[0]["job_id"] == "job0"
    moved = [e for e in events[events.index(evicted[0]):] if e["event"] == "place" and e["job_id"] == "job0"]
    assert moved and moved[0]["device_ids"] != [result["raised_node"]]
    assert result["killed_node"] not in (None, result["raised_node"])
    lost = [e for e in events if e["event"] == "node-lost"]
    assert lost and lost[0]["node"] == result["killed_node"] and lost[0]["jobs"]
    assert not any(result["killed_node"] in e.get("device_ids", ()) for e in events[events.index(lost[0]):])
    # the throughput model against what the jobs got (its error is reported, see docs/cluster.md)
    assert result["prediction"]["stays"] and result["prediction"]["median_abs_error"] is not None
