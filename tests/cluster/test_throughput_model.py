"""Valve §6 throughput model, scheduler, SLA monitor and controller on constructed cluster states."""

import numpy as np
import pytest

from backfill.cluster.controller import ClusterController
from backfill.cluster.monitor import MonitorConfig, SLAMonitor
from backfill.cluster.job_scheduler import ClusterScheduler, Placement, Rejection, ClusterSchedulerConfig
from backfill.cluster.throughput_model import (ClusterSnapshot, JobProfile, OfflineJob, alignment_factor,
                                               memory_factor, pairwise_alignment, predict)
from backfill.errors import ClusterInputError

T = 100


def snapshot(idle, free_gb=40.0, busy=None, node_of=None):
    idle = np.asarray(idle, dtype=float)
    d = idle.size
    if busy is None:   # busy for the first (1 - idle) of the window
        busy = np.arange(T)[None, :] < np.round((1 - idle) * T)[:, None]
    free = np.broadcast_to(np.asarray(free_gb, dtype=float).reshape(-1, 1) if np.ndim(free_gb) == 1
                           else np.asarray(free_gb, dtype=float), (d, T)).copy()
    return ClusterSnapshot([f"d{i}" for i in range(d)], node_of if node_of is not None else np.arange(d), idle,
                           free, busy)


def test_prediction_is_the_product_of_the_factors():
    profile = JobProfile(100.0, memory_gb=(0.0, 10.0, 20.0), memory_share=(0.0, 0.5, 1.0),
                         required_memory_gb=10.0, deficit_loss=1.0)
    free = np.full((1, T), 20.0)
    free[0, :25] = 5.0     # a quarter of the window at 5 GB: share 0.25 there, deficit 5/10
    snap = snapshot([0.6], free_gb=free)
    m = float(memory_factor(profile, snap.free_memory_gb)[0])
    assert m == pytest.approx(0.75 * 1.0 + 0.25 * 0.25 - 1.0 * 0.25 * 0.5)
    p = predict(profile, snap, [0])
    assert p.tokens_per_s == pytest.approx(100.0 * 0.6 * m)
    assert p.alignment == 1.0 and p.min_pair_score == 1.0


def test_alignment_scores_and_lockstep_factor():
    t = np.arange(T)
    aligned = np.stack([t % 10 < 3, t % 10 < 3])
    shifted = np.stack([t % 10 < 3, (t + 5) % 10 < 3])
    assert pairwise_alignment(aligned)[0, 1] == 1.0
    assert pairwise_alignment(shifted)[0, 1] == 0.0
    assert alignment_factor(aligned, np.array([0.7, 0.7])) == pytest.approx(1.0)
    # misaligned: both idle only 40% of the time while each is idle 70%
    assert alignment_factor(shifted, np.array([0.7, 0.7])) == pytest.approx(0.4 / 0.7)


def test_scheduler_best_fit_meets_sla_and_rejects_with_reason():
    snap = snapshot([0.2, 0.5, 0.9])
    sched = ClusterScheduler(ClusterSchedulerConfig(choice="best-fit"))
    job = OfflineJob("j", JobProfile(100.0), sla_tokens_per_s=40.0)
    placed = sched.place(job, snap)
    assert isinstance(placed, Placement) and placed.device_ids == ("d1",)   # 50 >= 40, the tightest fit
    assert placed.prediction.tokens_per_s == pytest.approx(50.0)
    greedy = ClusterScheduler(ClusterSchedulerConfig(choice="most-throughput")).place(job, snap)
    assert greedy.device_ids == ("d2",)
    hopeless = sched.place(OfflineJob("h", JobProfile(100.0), sla_tokens_per_s=95.0), snap)
    assert isinstance(hopeless, Rejection) and hopeless.permanent
    assert "no device" in hopeless.reason and "95" in hopeless.reason and "90" in hopeless.reason


def test_lockstep_job_needs_aligned_devices_on_one_machine():
    t = np.arange(T)
    busy = np.stack([t % 10 < 3, (t + 5) % 10 < 3, t % 10 < 3, t % 10 < 3])
    snap = snapshot([0.7] * 4, busy=busy, node_of=np.array([0, 0, 1, 1]))
    job = OfflineJob("pair", JobProfile(100.0, devices=2), sla_tokens_per_s=60.0)
    placed = ClusterScheduler().place(job, snap)
    assert isinstance(placed, Placement) and placed.device_ids == ("d2", "d3")   # machine 0 is misaligned
    assert placed.prediction.min_pair_score == 1.0
    snap.occupied = np.array([False, False, True, False])
    waiting = ClusterScheduler().place(job, snap)
    assert isinstance(waiting, Rejection) and not waiting.permanent and "waiting" in waiting.reason


def test_monitor_evicts_only_persistent_misses():
    monitor = SLAMonitor(MonitorConfig(misses_to_evict=3))
    assert not monitor.observe("j", 5, 10) and not monitor.observe("j", 5, 10)
    assert not monitor.observe("j", 10, 10)           # one good check clears the record
    assert [monitor.observe("j", 1, 10) for _ in range(3)] == [False, False, True]


def test_controller_evicts_and_places_elsewhere_and_rejects_for_good():
    ctl = ClusterController(ClusterScheduler(ClusterSchedulerConfig(choice="best-fit")),
                            SLAMonitor(MonitorConfig(misses_to_evict=2)))
    ctl.submit(OfflineJob("a", JobProfile(100.0), 40.0))
    ctl.submit(OfflineJob("never", JobProfile(100.0), 500.0))
    snap = snapshot([0.5, 0.8])
    first = ctl.step(snap, {})
    assert first.decisions() == [("place", "a", ("d0",)), ("reject", "never")]
    assert "500" in first.rejected[0].reason and "never" not in ctl.jobs
    assert ctl.step(snapshot([0.5, 0.8]), {"a": 20.0}).decisions() == []
    second = ctl.step(snapshot([0.5, 0.8]), {"a": 20.0})
    assert second.decisions() == [("evict", "a", ("d0",)), ("place", "a", ("d1",))]
    assert ctl.evictions == 1 and ctl.running["a"].device_ids == ("d1",)
    assert ctl.lose_devices({"d1"}) == ["a"] and list(ctl.queue) == ["a"]
    # the only device left cannot meet the SLA: an admitted job waits instead of being dropped
    third = ctl.step(snapshot([0.3, 0.1]), {})
    assert third.placed == [] and third.rejected == [] and third.waiting[0].job_id == "a"


def test_bad_inputs_are_typed_errors():
    with pytest.raises(ClusterInputError):
        JobProfile(0.0)
    with pytest.raises(ClusterInputError):
        JobProfile(1.0, memory_gb=(2.0, 1.0), memory_share=(0.5, 1.0))
    with pytest.raises(ClusterInputError):
        OfflineJob("x", JobProfile(1.0), sla_tokens_per_s=-1)
    with pytest.raises(ClusterInputError):
        ClusterSnapshot(["a"], [0], [1.5], np.ones((1, 3)), np.zeros((1, 3), bool))
    with pytest.raises(ClusterInputError):
        predict(JobProfile(1.0, devices=2), snapshot([0.5]), [0])
    ctl = ClusterController()
    ctl.submit(OfflineJob("x", JobProfile(1.0), 0.1))
    with pytest.raises(ClusterInputError):
        ctl.submit(OfflineJob("x", JobProfile(1.0), 0.1))
