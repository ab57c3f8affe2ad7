import pytest
import torch

from backfill.engine.kv_pool import KVBlockPool
from backfill.errors import OutOfBlocksError


def test_allocate_free_and_usage(tiny_config):
    pool = KVBlockPool(tiny_config, num_blocks=10, block_size=4)
    a = pool.allocate(4)
    assert len(set(a)) == 4 and pool.num_free == 6 and pool.usage == pytest.approx(0.4)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(7)
    pool.free(a)
    assert pool.num_free == 10
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([a[0]])


def test_grow_extends_block_table(tiny_config):
    pool = KVBlockPool(tiny_config, num_blocks=10, block_size=4)
    table: list[int] = []
    assert len(pool.grow(table, 9)) == 3 and len(table) == 3
    assert pool.grow(table, 12) == []
    assert len(pool.grow(table, 13)) == 1


def test_host_round_trip_restores_blocks(tiny_config):
    pool = KVBlockPool(tiny_config, num_blocks=6, block_size=4)
    src = pool.allocate(2)
    pool.k[:, src] = torch.randn_like(pool.k[:, src])
    pool.v[:, src] = torch.randn_like(pool.v[:, src])
    host = pool.copy_to_host(src)
    assert host.num_blocks == 2 and host.nbytes > 0
    dst = pool.allocate(2)
    pool.copy_from_host(host, dst)
    assert torch.equal(pool.k[:, dst], pool.k[:, src]) and torch.equal(pool.v[:, dst], pool.v[:, src])
    with pytest.raises(ValueError):
        pool.copy_from_host(host, dst[:1])


def test_for_memory_sizes_pool(tiny_config):
    pool = KVBlockPool.for_memory(tiny_config, kv_bytes=1 << 20, block_size=16)
    assert 0 < pool.nbytes <= 1 << 20
