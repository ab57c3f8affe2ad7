"""Handles as physical pages mapped into one engine at a time: the page map with the real pool,
and (with a GPU) the driver's map / unmap."""

import pytest

from backfill.errors import PolicyInputError, SharedMemoryError
from backfill.bench.cuda_vmm import PageMap, PageOp, round_up
from backfill.memory.shared_pool import EngineRole, PoolConfig, SharedMemoryPool
from backfill.policy.miad import MIADReservation
from backfill.policy.reclaim import GreedyReclaimPolicy
from tests.conftest import TEST_DEVICE

MIB = 2**20


def test_handles_round_up_to_whole_granules():
    assert round_up(1, 2 * MIB) == 2 * MIB and round_up(4 * MIB, 2 * MIB) == 4 * MIB
    pm = PageMap(num_handles=4, handle_bytes=3 * MIB, granularity=2 * MIB)
    assert pm.chunk_bytes == 4 * MIB and pm.reservation_bytes == 16 * MIB and pm.va_offset(3) == 12 * MIB
    with pytest.raises(PolicyInputError):
        PageMap(0, 1, 2)
    with pytest.raises(PolicyInputError, match="no handle"):
        pm.va_offset(4)


def test_a_handle_is_mapped_by_one_engine_at_a_time():
    pm = PageMap(num_handles=3, handle_bytes=MIB, granularity=MIB)
    assert pm.grant("off", [0, 1]) == [PageOp("map", "off", 0, 0, MIB), PageOp("map", "off", 1, MIB, MIB)]
    with pytest.raises(SharedMemoryError, match="reclaim it first"):
        pm.grant("on", [1])
    with pytest.raises(SharedMemoryError, match="does not map"):
        pm.release("on", [0])
    assert pm.release("off", [0]) == [PageOp("unmap", "off", 0, 0, MIB)]
    assert pm.mapped("off") == (1,) and pm.holder(0) is None


def test_page_map_follows_the_pool_through_a_reclamation():
    """The real pool decides (MIAD headroom, selective reclamation); the page map turns its
    grants and invalidations into map / unmap operations. The reclaimed handles leave offline's
    address space and enter online's; nothing is copied."""
    pool = SharedMemoryPool(PoolConfig(num_handles=6, blocks_per_handle=2), reclaim_policy=GreedyReclaimPolicy(),
                            reservation=MIADReservation())
    pm = PageMap(num_handles=6, handle_bytes=5 * MIB, granularity=2 * MIB)
    ops: list[PageOp] = []

    def on_invalidate(notice):
        ops.extend(pm.reclaim(list(notice.handle_ids), "on"))

    pool.register("off", EngineRole.OFFLINE, on_invalidate=on_invalidate)
    ops += pm.grant("off", pool.allocate("off", 6))
    pool.report_blocks("off", {"a": [0, 1, 2], "b": [8, 9]}, {"a": 20, "b": 5})
    ops.clear()
    pool.register("on", EngineRole.ONLINE)
    granted = pool.allocate("on", 2)
    ops += pm.grant("on", [h for h in granted if pm.holder(h) is None])
    on_handles = set(pool.handles_of("on"))
    assert on_handles <= set(pm.mapped("on")) and set(pm.mapped("off")) == set(pool.handles_of("off"))
    unmapped = {op.handle for op in ops if op.kind == "unmap"}
    assert unmapped and all(op.engine == "off" for op in ops if op.kind == "unmap")
    assert unmapped.isdisjoint(pool.handles_of("off"))
    # Selective reclamation avoided the handles of the costly request "a" (blocks 0-2: handles 0, 1).
    assert unmapped.isdisjoint({0, 1})
    assert all(op.nbytes == 6 * MIB for op in ops)


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA virtual memory needs a GPU (BACKFILL_TEST_DEVICE=cuda)")
def test_driver_maps_a_handle_into_one_space_then_another():
    import torch

    from backfill.bench.cuda_vmm import VmmPages, VmmSpace, granularity

    torch.zeros(1, device="cuda")          # the primary context, current on this thread
    pm = PageMap(num_handles=2, handle_bytes=1, granularity=granularity(0))
    pages = VmmPages(pm)
    offline, online = VmmSpace(pm, pages.fds), VmmSpace(pm, pages.fds)
    try:
        offline.apply(pm.grant("off", [0, 1]))
        offline.tensor(1).fill_(7)
        ops = pm.reclaim([1], "on")
        offline.apply([op for op in ops if op.engine == "off"])
        online.apply([op for op in ops if op.engine == "on"])
        torch.cuda.synchronize()
        assert int(online.tensor(1)[:16].sum()) == 7 * 16      # the same pages, no copy
        with pytest.raises(SharedMemoryError, match="not mapped"):
            offline.tensor(1)
    finally:
        offline.close()
        online.close()
        pages.close()
