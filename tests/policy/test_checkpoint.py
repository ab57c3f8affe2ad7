from backfill.policy.checkpoint import AdaptiveCheckpointPolicy, CheckpointConfig
from backfill.policy.interface import SchedulerState, SeqView
from backfill.types import RequestClass


def _state(free: int, n: int = 10) -> SchedulerState:
    seqs = tuple(SeqView(f"o{i}", RequestClass.OFFLINE, float(i), 10, 20, 19, 2, True) for i in range(n))
    return SchedulerState(0.0, seqs, free, 100, 16, 2048)


def test_no_checkpoints_below_threshold_then_ramp_with_pressure():
    policy = AdaptiveCheckpointPolicy(CheckpointConfig(start_usage=0.5, full_usage=0.9))
    assert policy.select(_state(free=60)) == []
    low = policy.select(_state(free=45))       # 55% used and rising
    high = policy.select(_state(free=15))      # 85% used and rising
    assert 0 < len(low) < len(high) <= 10
    assert low == [f"o{i}" for i in range(len(low))]  # oldest first
    assert len(policy.select(_state(free=5))) == 10


def test_already_checkpointed_requests_are_skipped():
    policy = AdaptiveCheckpointPolicy(CheckpointConfig(start_usage=0.0))
    done = SeqView("done", RequestClass.OFFLINE, 0.0, 10, 20, 19, 2, True, num_checkpointed_tokens=19)
    online = SeqView("on", RequestClass.ONLINE, 0.0, 10, 20, 19, 2, True)
    assert policy.select(SchedulerState(0.0, (done, online), 10, 100, 16, 2048)) == []
