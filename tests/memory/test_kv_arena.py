"""The node's KV pool as one allocation shared by processes: layout, attach, what a reclaim hands over."""

import json
import subprocess
import sys

import pytest
import torch

from backfill.engine.config import ModelConfig
from backfill.engine.kv_pool import KVBlockPool
from backfill.errors import PolicyInputError, SharedMemoryError
from backfill.memory.kv_arena import ArenaDescriptor, HostArena, KVLayout, attach, kv_planes, make_arena
from backfill.memory.shared_pool import EngineRole, PoolConfig, SharedMemoryPool
from backfill.policy.miad import MIADReservation
from backfill.policy.reclaim import GreedyReclaimPolicy
from tests.conftest import TEST_DEVICE

LAYOUT = KVLayout(num_layers=3, num_blocks=8, block_size=4, kv_heads=2, head_dim=8)   # fp32: 256 B a block


def test_layout_sizes_and_block_ranges():
    assert LAYOUT.block_bytes == 4 * 2 * 8 * 4 and LAYOUT.plane_bytes == 3 * 8 * 256 and LAYOUT.nbytes == 2 * 6144
    # Adjacent blocks merge into one range per layer and plane; apart blocks stay apart.
    assert LAYOUT.block_ranges([2, 3]) == [(p * 6144 + layer * 2048 + 512, 512) for p in (0, 1) for layer in range(3)]
    assert len(LAYOUT.block_ranges([1, 5])) == 2 * 3 * 2
    with pytest.raises(PolicyInputError, match="no block 8"):
        LAYOUT.block_ranges([8])


def test_handles_cover_the_arena_once():
    covered = sorted(r for h in range(4) for r in LAYOUT.handle_ranges(h, 2))
    assert sum(n for _, n in covered) == LAYOUT.nbytes
    assert all(a + n <= b for (a, n), (b, _) in zip(covered, covered[1:]))   # disjoint
    with pytest.raises(PolicyInputError, match="do not split"):
        LAYOUT.handle_ranges(0, 3)


def test_bad_layouts_and_descriptors_raise_typed_errors(tmp_path):
    with pytest.raises(PolicyInputError, match="num_blocks"):
        KVLayout(2, 0, 4, 1, 8)
    with pytest.raises(PolicyInputError, match="dtype"):
        KVLayout(2, 2, 4, 1, 8, dtype="int8")
    with pytest.raises(SharedMemoryError, match="kind"):
        ArenaDescriptor("nvlink", LAYOUT)
    with pytest.raises(SharedMemoryError, match="path"):
        ArenaDescriptor("host-shm", LAYOUT)
    with pytest.raises(SharedMemoryError, match="IPC handle"):
        ArenaDescriptor("cuda-ipc", LAYOUT)
    with pytest.raises(SharedMemoryError, match="not an arena descriptor"):
        ArenaDescriptor.from_json({"kind": "host-shm"})
    with pytest.raises(SharedMemoryError, match="cannot attach"):
        attach(ArenaDescriptor("host-shm", LAYOUT, path=str(tmp_path / "gone")))
    small = tmp_path / "small"
    small.write_bytes(b"\0" * 100)
    with pytest.raises(SharedMemoryError, match="100 bytes"):
        attach(ArenaDescriptor("host-shm", LAYOUT, path=str(small)))
    with pytest.raises(SharedMemoryError, match="not a CUDA IPC name"):
        attach(ArenaDescriptor("cuda-ipc", LAYOUT, ipc="bm90IGEgcGlja2xl"))
    with pytest.raises(SharedMemoryError, match="cannot open the CUDA IPC memory"):
        attach(ArenaDescriptor("cuda-ipc", LAYOUT, ipc="cuda-ipc:bm90IGEgcGlja2xl"))


def test_planes_are_the_kv_pool_the_engine_uses():
    arena = HostArena(LAYOUT)
    try:
        cfg = ModelConfig(**{**vars(ModelConfig.tiny()), "num_layers": 3, "num_kv_heads": 2, "num_heads": 2,
                             "head_dim": 8, "hidden_size": 16})
        assert KVLayout.of(cfg, 8, 4) == LAYOUT
        kv = KVBlockPool(cfg, 8, 4, planes=kv_planes(arena.bytes, LAYOUT))
        kv.k[1, 5].fill_(1.5)
        kv.v[2, 6].fill_(-2.0)
        k_off, _ = LAYOUT.block_ranges([5])[1]               # K plane, layer 1
        v_off, n = LAYOUT.block_ranges([6])[3 + 2]            # V plane, layer 2
        assert torch.all(arena.bytes[k_off:k_off + n].view(torch.float32) == 1.5)
        assert torch.all(arena.bytes[v_off:v_off + n].view(torch.float32) == -2.0)
        with pytest.raises(ValueError, match="does not match"):
            KVBlockPool(cfg, 4, 4, planes=kv_planes(arena.bytes, LAYOUT))
        with pytest.raises(SharedMemoryError, match="cannot hold"):
            kv_planes(arena.bytes[:100], LAYOUT)
    finally:
        arena.close()


def _child_writes(descriptor: ArenaDescriptor, ranges: list[tuple[int, int]], value: int) -> None:
    """Another process attaches the arena from its descriptor and writes into these byte ranges."""
    code = ("import json, sys\n"
            "from backfill.memory.kv_arena import ArenaDescriptor, attach\n"
            "d = json.loads(sys.argv[1])\n"
            "arena = attach(ArenaDescriptor.from_json(d['arena']))\n"
            "for off, n in d['ranges']:\n"
            "    arena[off:off + n] = d['value']\n"
            "arena.cpu() if arena.is_cuda else None\n")
    arg = json.dumps({"arena": descriptor.to_json(), "ranges": ranges, "value": value})
    subprocess.run([sys.executable, "-c", code, arg], check=True, timeout=120)


def test_a_reclaimed_handle_changes_owner_without_a_copy():
    """Offline holds handles and reports computed KV on them; online's burst makes the pool
    reclaim one. The reclaimed handle's bytes are the ones online now writes (another process
    here), and offline's map of the arena sees that write: no data moved, only ownership."""
    layout = KVLayout(num_layers=2, num_blocks=8, block_size=4, kv_heads=1, head_dim=8)
    arena = HostArena(layout)
    try:
        offline_view = attach(arena.descriptor())
        pool = SharedMemoryPool(PoolConfig(num_handles=4, blocks_per_handle=2), reclaim_policy=GreedyReclaimPolicy(),
                                reservation=MIADReservation())
        pool.register("off", EngineRole.OFFLINE)
        held = pool.allocate("off", 4)
        offline_view[:] = 7                                   # offline's KV fills every handle
        pool.report_blocks("off", {"r1": [0, 1], "r2": [4, 5, 6]}, {"r1": 8, "r2": 12})
        pool.register("on", EngineRole.ONLINE)
        pool.allocate("on", 1)
        taken = pool.handles_of("on")
        assert len(taken) == 1 and taken[0] in held and pool.stats.reclamations == 1
        moved = layout.handle_ranges(taken[0], 2)
        _child_writes(arena.descriptor(), moved, 42)
        mask = torch.zeros(layout.nbytes, dtype=torch.bool)
        for off, n in moved:
            mask[off:off + n] = True
        assert torch.all(offline_view[mask] == 42)            # online's write, through offline's map
        assert torch.all(offline_view[~mask] == 7)            # offline's other handles untouched
        assert pool.stats.reclaim_latencies_s and pool.stats.reclaim_latencies_s[-1] >= 0
    finally:
        arena.close()


def test_make_arena_picks_the_host_form_on_cpu():
    arena = make_arena(LAYOUT, "cpu")
    try:
        assert isinstance(arena, HostArena) and arena.descriptor().kind == "host-shm"
        assert ArenaDescriptor.from_json(json.loads(json.dumps(arena.descriptor().to_json()))) == arena.descriptor()
    finally:
        arena.close()


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA IPC needs a GPU (BACKFILL_TEST_DEVICE=cuda)")
def test_cuda_ipc_arena_is_shared_with_another_process():
    arena = make_arena(LAYOUT, "cuda")
    try:
        assert arena.descriptor().kind == "cuda-ipc"
        moved = LAYOUT.handle_ranges(1, 2)
        _child_writes(arena.descriptor(), moved, 9)
        torch.cuda.synchronize()
        host = arena.bytes.cpu()
        for off, n in moved:
            assert torch.all(host[off:off + n] == 9)
        assert int(host.sum()) == 9 * sum(n for _, n in moved)
    finally:
        arena.close()
