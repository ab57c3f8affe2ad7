import pytest

from backfill.errors import DoubleFreeError, MemoryPoolError, OverAllocationError, PolicyInputError, UnknownOwnerError
from backfill.memory.shared_pool import EngineRole, PoolConfig, SharedMemoryPool, StaticMemPool
from backfill.policy.miad import MIADConfig, MIADReservation
from backfill.policy.reclaim import FIFOReclaimPolicy, GreedyReclaimPolicy

GREEDY = GreedyReclaimPolicy()  # stateless: one serves every pool here


class Journal:
    """A ComputeControl that records the protocol order alongside invalidations."""

    def __init__(self):
        self.events = []

    def pause_offline(self):
        self.events.append("pause")

    def unpause_offline(self):
        self.events.append("unpause")

    def invalidated(self, notice):
        self.events.append(("invalidate", notice))


def miad(headroom=0, **kw):
    return MIADReservation(MIADConfig(initial_headroom_handles=headroom, initial_interval_s=10.0,
                                      min_interval_s=10.0, **kw))


def test_allocate_release_and_block_mapping():
    pool = SharedMemoryPool(PoolConfig(num_handles=4, blocks_per_handle=8), reclaim_policy=GREEDY)
    pool.register("off", EngineRole.OFFLINE)
    got = pool.allocate("off", 3)
    assert sorted(got) == [0, 1, 2] and pool.free_handles == 1
    assert list(pool.blocks_of_handle(2)) == list(range(16, 24)) and pool.handle_of_block(17) == 2
    pool.release("off", [1])
    assert pool.handles_of("off") == (0, 2) and pool.free_handles == 2
    assert pool.num_blocks == 32


def test_error_paths():
    pool = SharedMemoryPool(PoolConfig(4, 2), reclaim_policy=GREEDY)
    pool.register("off", "offline", max_handles=2)
    pool.register("on", "online")
    with pytest.raises(UnknownOwnerError):
        pool.allocate("ghost", 1)
    with pytest.raises(UnknownOwnerError):
        pool.release("ghost", [0])
    with pytest.raises(OverAllocationError, match="grant is 2"):
        pool.allocate("off", 3)
    (h,) = pool.allocate("off", 1)
    pool.release("off", [h])
    with pytest.raises(DoubleFreeError):
        pool.release("off", [h])
    pool.allocate("off", 2)
    with pytest.raises(DoubleFreeError, match="twice"):
        pool.release("off", [pool.handles_of("off")[0]] * 2)
    with pytest.raises(DoubleFreeError):
        pool.release("on", [pool.handles_of("off")[0]])       # someone else's handle
    with pytest.raises(MemoryPoolError, match="already registered"):
        pool.register("off", "offline")
    with pytest.raises(MemoryPoolError, match="one per pool"):
        pool.register("on2", "online")
    with pytest.raises(MemoryPoolError, match="outside"):
        pool.report_blocks("off", {"r": [100]}, {"r": 3})
    with pytest.raises(PolicyInputError, match="token count"):
        pool.report_blocks("off", {"r": [pool.blocks_of_handle(pool.handles_of("off")[0])[0]]}, {})
    with pytest.raises(MemoryPoolError, match="only offline"):
        pool.report_blocks("on", {}, {})
    with pytest.raises(PolicyInputError):
        pool.allocate("off", -1)
    with pytest.raises(PolicyInputError):
        PoolConfig(0, 4)
    with pytest.raises(PolicyInputError, match="role"):
        pool.register("x", "sideline")


def test_offline_is_refused_when_the_pool_is_out_of_free_handles():
    pool = SharedMemoryPool(PoolConfig(3, 1), reclaim_policy=GREEDY, reservation=miad(headroom=1))
    pool.register("on", "online")
    pool.register("off", "offline")
    assert pool.reserved_handles == 1
    pool.allocate("off", 2)
    with pytest.raises(OverAllocationError, match="0 free"):
        pool.allocate("off", 1)                                 # the headroom is not for offline


def test_online_burst_reclaims_with_pause_first_and_reports_invalid_blocks():
    journal = Journal()
    pool = SharedMemoryPool(PoolConfig(num_handles=4, blocks_per_handle=4), reclaim_policy=GREEDY, compute=journal)
    pool.register("on", "online")
    pool.register("off", "offline", on_invalidate=journal.invalidated)
    h0, h1, h2, h3 = pool.allocate("off", 4)
    b = {h: list(pool.blocks_of_handle(h)) for h in (h0, h1, h2, h3)}
    # long request spans h0 and h1; short ones live on h2 and h3.
    pool.report_blocks("off", {"long": b[h0] + b[h1][:2], "s1": b[h2][:1], "s2": b[h3][:3]},
                       {"long": 300, "s1": 10, "s2": 20})
    got = pool.allocate("on", 2, now_s=1.0)
    assert sorted(got) == sorted([h2, h3])                      # the cheapest two handles
    assert journal.events[0] == "pause" and journal.events[-1] == "unpause"
    (_, notice), = [e for e in journal.events if isinstance(e, tuple)]
    assert notice.owner_id == "off" and notice.request_ids == {"s1", "s2"}
    assert notice.block_ids == tuple(sorted(b[h2][:1] + b[h3][:3])) and notice.cost_tokens == 30
    assert pool.handles_of("off") == tuple(sorted([h0, h1]))
    assert pool.stats.reclamations == 1 and pool.stats.invalidated_tokens == 30


def test_fifo_policy_reclaims_oldest_handles():
    pool = SharedMemoryPool(PoolConfig(3, 2), reclaim_policy=FIFOReclaimPolicy())
    pool.register("on", "online")
    pool.register("off", "offline")
    first, second, third = pool.allocate("off", 1) + pool.allocate("off", 1) + pool.allocate("off", 1)
    assert pool.allocate("on", 1) == (first,)


def test_using_up_the_headroom_is_pressure():
    pool = SharedMemoryPool(PoolConfig(10, 1), reclaim_policy=GREEDY, reservation=miad(headroom=2))
    pool.register("on", "online")
    pool.allocate("on", 4, now_s=0.0)                           # beyond its 2-handle headroom
    assert pool.reservation.pressure_events == 1 and pool.reserved_handles == 4


def test_burst_and_headroom_top_up_share_one_reclamation():
    journal = Journal()
    pool = SharedMemoryPool(PoolConfig(10, 1), reclaim_policy=GREEDY, reservation=miad(headroom=1), compute=journal)
    pool.register("on", "online")
    pool.register("off", "offline", on_invalidate=journal.invalidated)
    pool.allocate("off", 9)
    assert pool.reserved_handles == 1
    pool.allocate("on", 3, now_s=1.0)                           # 3 of 3: pressure -> headroom 2
    assert pool.reserved_handles == 2
    assert journal.events.count("pause") == 1 and pool.stats.reclamations == 1
    assert len(pool.handles_of("off")) == 10 - 3 - 2


def test_each_allocation_past_the_headroom_in_a_burst_is_one_event_and_one_reclamation():
    pool = SharedMemoryPool(PoolConfig(40, 1), reclaim_policy=GREEDY, reservation=miad(headroom=1))
    pool.register("on", "online")
    pool.register("off", "offline")
    pool.allocate("off", 39)
    pool.allocate("on", 2, now_s=1.0)                           # past the headroom: event 1
    pool.allocate("on", pool.reserved_handles, now_s=1.5)       # uses the headroom up, still in pressure
    assert pool.reservation.pressure_events == 1
    pool.allocate("on", pool.reserved_handles + 3, now_s=2.0)   # past it again in the same burst
    # One reclamation per event: MIAD's event rate is the rate offline is disturbed at.
    assert pool.reservation.pressure_events == 2 and pool.stats.reclamations == 2


def test_headroom_use_without_pressure_refills_from_freed_handles_not_by_reclaiming():
    journal = Journal()
    pool = SharedMemoryPool(PoolConfig(10, 1), reclaim_policy=GREEDY, reservation=miad(headroom=4), compute=journal)
    pool.register("on", "online")
    pool.register("off", "offline", on_invalidate=journal.invalidated)
    held = pool.allocate("off", 6)                              # every free handle
    pool.allocate("on", 1, now_s=1.0)                           # 1 of 4: no pressure
    assert pool.stats.reclamations == 0 and "pause" not in journal.events
    assert pool.reserved_handles == 3 and pool.free_handles == 0
    pool.release("off", held[:2], now_s=2.0)                    # the short headroom comes first
    assert pool.reserved_handles == 4 and pool.free_handles == 1


def test_released_online_memory_refills_headroom_and_tick_shrinks_it():
    pool = SharedMemoryPool(PoolConfig(10, 1), reclaim_policy=GREEDY, reservation=miad(headroom=2))
    pool.register("on", "online")
    got = pool.allocate("on", 1, now_s=0.0)                     # 1 of 2 granted: no pressure
    assert pool.reserved_handles == 2 and pool.free_handles == 7   # headroom refilled
    pool.release("on", got, now_s=1.0)
    assert pool.reserved_handles == 2 and pool.free_handles == 8   # excess headroom trimmed
    pool.tick(10.0)
    assert pool.reserved_handles == 1 and pool.free_handles == 9   # one handle per interval
    pool.tick(100.0)
    assert pool.reserved_handles == 0


def test_unregister_returns_everything():
    pool = SharedMemoryPool(PoolConfig(4, 1), reclaim_policy=GREEDY, reservation=miad(headroom=1))
    pool.register("on", "online")
    pool.register("off", "offline")
    pool.allocate("off", 2)
    pool.allocate("on", 1)
    pool.unregister("off")
    pool.unregister("on")
    assert pool.free_handles == 4 and pool.owners() == {}


def test_static_mem_fixed_partition_and_overflow_kills_offline():
    journal = Journal()
    pool = StaticMemPool(PoolConfig(8, 1), reclaim_policy=GREEDY, online_handles=3, compute=journal)
    pool.register("on", "online")
    pool.register("off", "offline", on_invalidate=journal.invalidated)
    assert pool.reserved_handles == 3
    offline = pool.allocate("off", 5)
    with pytest.raises(OverAllocationError):
        pool.allocate("off", 1)
    pool.report_blocks("off", {f"r{h}": [h] for h in offline}, {f"r{h}": 10 for h in offline})
    pool.allocate("on", 3)
    assert journal.events == []                                 # inside the partition: no reclaim
    pool.allocate("on", 1)                                      # beyond it: every offline request dies
    (_, notice), = [e for e in journal.events if isinstance(e, tuple)]
    assert notice.request_ids == {f"r{h}" for h in offline}
    assert pool.handles_of("off") == ()
    with pytest.raises(PolicyInputError):
        StaticMemPool(PoolConfig(2, 1), reclaim_policy=GREEDY, online_handles=3)
