"""HARLI §4: finetuning memory borrowed from the KV pool's idle blocks, given back on demand.

The pool retires free blocks for the lease (the engine cannot hand them to a sequence while
lent) and admits them back when inference needs them; the §4.4 reserve always stays free for
decode. On CPU the tensors of a finetuning step are not placed inside the retired blocks' bytes
(the pool is one tensor per layer, and PyTorch's CPU allocator cannot be pointed at a range of
it): the lease is an exact accounting of the same bytes, so engine + finetuning never use more
memory than the pool alone. The device form (CUDA virtual memory mapped over the pool's blocks,
and window-based swapping of frozen weights to host memory, §4.3) needs a GPU: not built yet.
"""

from __future__ import annotations

import math

from backfill.engine.kv_pool import KVBlockPool
from backfill.policy.interface import SchedulerState


def reserve_blocks(release_ms: float, tpot_target_ms: float, max_batch: int, block_size: int) -> int:
    """HARLI §4.4's Mem_reserved = (T / QoS) x max_bs x Mem_kv, at block granularity.

    T is how long finetuning takes to give memory back: here one scheduling unit, since memory is
    returned between units. Over T at most ceil(T / QoS) decode steps run; each of max_bs sequences
    grows a token per step and, in the worst case, every one of them opens a new block."""
    steps = max(1, math.ceil(release_ms / tpot_target_ms))
    return max_batch * math.ceil(steps / block_size)


class KVLease:
    def __init__(self, kv: KVBlockPool, reserve: int) -> None:
        self.kv = kv
        self.reserve = reserve
        self.held: list[int] = []
        self.borrowed_total = 0   # blocks ever lent (for the report)
        self.given_back_total = 0

    @property
    def bytes_per_block(self) -> int:
        return self.kv.nbytes // self.kv.num_blocks

    @property
    def held_bytes(self) -> int:
        return len(self.held) * self.bytes_per_block

    def try_hold(self, nbytes: int, inference_demand_blocks: int = 0) -> bool:
        """Hold blocks worth nbytes, leaving the reserve and what waiting requests need free."""
        need = -(-nbytes // self.bytes_per_block)
        extra = need - len(self.held)
        if extra <= 0:
            return True
        if self.kv.num_free - extra < self.reserve + inference_demand_blocks:
            return False
        ids = self.kv.allocate(extra)
        self.kv.free(ids)
        self.kv.retire(ids)
        self.held.extend(ids)
        self.borrowed_total += extra
        return True

    def must_give_back(self, inference_demand_blocks: int = 0) -> bool:
        return bool(self.held) and self.kv.num_free < self.reserve + inference_demand_blocks

    def give_back(self) -> int:
        n = len(self.held)
        if n:
            self.kv.admit(self.held)
            self.held = []
            self.given_back_total += n
        return n


def inference_demand_blocks(state: SchedulerState) -> int:
    """Blocks the requests not yet running need for their prompts (arrivals, preempted ones)."""
    return sum(state.blocks_for(s, s.num_tokens - s.num_computed_tokens) for s in state.seqs if not s.running)
