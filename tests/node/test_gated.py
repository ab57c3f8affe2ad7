"""The pieces of an engine under a node's gate (node/gated.py): the handle-to-block map."""

import pytest

from backfill.engine.config import ModelConfig
from backfill.engine.kv_pool import KVBlockPool
from backfill.errors import PolicyInputError
from backfill.node.gated import HandleBlocks

BLOCK_SIZE = 8


def test_handle_blocks_maps_engine_blocks_onto_granted_handles():
    kv = KVBlockPool(ModelConfig.tiny(), 8, BLOCK_SIZE)
    hb = HandleBlocks(kv, num_handles=4, blocks_per_handle=2)
    assert kv.num_usable == 0 and kv.num_free == 0          # nothing until granted
    hb.admit((1, 3))
    assert kv.num_free == 4 and kv.retired == frozenset({0, 1, 4, 5}) and hb.covers([2, 7]) and not hb.covers([0])
    table = kv.allocate(1)
    assert hb.fully_free() == [h for h in (1, 3) if hb.handle_of(table[0]) != h]
    kv.free(table)
    hb.retire([3])
    assert kv.num_usable == 2 and hb.held == {1}
    assert hb.forget([1]) == [2, 3] and hb.held == set()
    with pytest.raises(PolicyInputError):
        HandleBlocks(KVBlockPool(ModelConfig.tiny(), 7, BLOCK_SIZE), num_handles=4, blocks_per_handle=2)
