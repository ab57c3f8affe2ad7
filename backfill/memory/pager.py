"""The scheduler's swap space for paged-out prompts (AQUA §7), kept in elastic tensors.

Paging out gathers a sequence's KV blocks (every layer, K and V) into one tensor and stores it
as one elastic tensor (lent memory when a producer offers some, else host memory); paging in
reads it back in one copy and scatters it into fresh device blocks. The scheduler calls in at
its step boundary, where lent regions a producer reclaimed are vacated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from backfill.engine.kv_pool import KVBlockPool
from backfill.memory.elastic import ElasticStore, Location


def page_shape(kv: KVBlockPool, num_blocks: int) -> tuple[int, ...]:
    """One page of KV: [K/V, layers, blocks, block_size, kv_heads, head_dim]."""
    return (2, kv.k.shape[0], num_blocks, *kv.k.shape[2:])


def _rows(kv: KVBlockPool, block_ids: list[int]) -> torch.Tensor:
    """Rows of the pool seen as [layers x blocks, block bytes]: every layer's copy of each block."""
    blocks = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
    layers = torch.arange(kv.k.shape[0], device=kv.device) * kv.k.shape[1]
    return (layers[:, None] + blocks[None, :]).reshape(-1)


def _flat(pool: torch.Tensor) -> torch.Tensor:
    return pool.view(pool.shape[0] * pool.shape[1], -1)


def gather_blocks(kv: KVBlockPool, block_ids: list[int], out: torch.Tensor) -> None:
    """Every layer's K and V of these blocks into out (page_shape), one indexed copy each; into
    memory off the pool's device through one staging tensor and one transfer (AQUA §7)."""
    rows = _rows(kv, block_ids)
    if out.device == kv.device:
        torch.index_select(_flat(kv.k), 0, rows, out=out[0].view(len(rows), -1))
        torch.index_select(_flat(kv.v), 0, rows, out=out[1].view(len(rows), -1))
    else:
        staged = torch.stack([_flat(kv.k).index_select(0, rows), _flat(kv.v).index_select(0, rows)])
        out.copy_(staged.view(out.shape), non_blocking=True)


def scatter_blocks(kv: KVBlockPool, block_ids: list[int], page: torch.Tensor) -> None:
    """A page back into these device blocks: one transfer, then one indexed copy each for K and V
    over the pool seen as rows (index_copy_ along the pool's block dimension, or layer by layer,
    is an order of magnitude slower on CPU)."""
    rows = _rows(kv, block_ids)
    page = page.to(kv.device, non_blocking=True)
    _flat(kv.k).index_copy_(0, rows, page[0].reshape(len(rows), -1))
    _flat(kv.v).index_copy_(0, rows, page[1].reshape(len(rows), -1))


class SwapReport(NamedTuple):
    """What a policy may know of the swap space: where pages go now, and what paging has cost."""

    location: Location       # where the next page-out lands (lent if a producer offers memory)
    paged_tokens: int        # tokens paged out or in so far
    paging_ms: float         # time spent paging so far (gather + copy + scatter)
    resident_bytes: int      # bytes of paged-out KV held now


@dataclass
class PagerStats:
    pages_out: int = 0
    pages_in: int = 0
    tokens_out: int = 0
    tokens_in: int = 0
    bytes_out: int = 0
    paging_s: float = 0.0
    peak_bytes: int = 0


class KVPager:
    def __init__(self, store: ElasticStore) -> None:
        self.store = store
        self.stats = PagerStats()
        self._tokens: dict[str, int] = {}
        self._first_block: dict[str, int] = {}   # leading blocks left out of the page (shared, cached)

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._tokens

    def page_out(self, seq_id: str, kv: KVBlockPool, block_ids: list[int], num_tokens: int,
                 first_block: int = 0) -> Location:
        """Copy block_ids (the request's blocks from first_block on: those before it are shared and stay
        cached) to the swap space; num_tokens counts the whole request, leading blocks included."""
        started = time.perf_counter()
        page = self.store.empty(seq_id, page_shape(kv, len(block_ids)), kv.dtype)
        gather_blocks(kv, block_ids, page)
        self._tokens[seq_id] = num_tokens
        self._first_block[seq_id] = first_block
        self.stats.pages_out += 1
        self.stats.tokens_out += num_tokens
        self.stats.bytes_out += page.numel() * page.element_size()
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.resident_bytes)
        self.stats.paging_s += time.perf_counter() - started
        return self.store.location(seq_id)

    def page_in(self, seq_id: str, kv: KVBlockPool, block_ids: list[int]) -> int:
        """Copy seq_id's pages into block_ids (the scatter); returns its token count."""
        started = time.perf_counter()
        scatter_blocks(kv, block_ids, self.store.view(seq_id))
        self.store.free(seq_id)
        tokens = self._tokens.pop(seq_id)
        self._first_block.pop(seq_id, None)
        self.stats.pages_in += 1
        self.stats.tokens_in += tokens
        self.stats.paging_s += time.perf_counter() - started
        return tokens

    def discard(self, seq_id: str) -> None:
        self._first_block.pop(seq_id, None)
        if self._tokens.pop(seq_id, None) is not None:
            self.store.free(seq_id)

    def num_blocks(self, seq_id: str) -> int:
        """Blocks the page holds (the request's from first_block(seq_id) on)."""
        return self.store.view(seq_id).shape[2]

    def first_block(self, seq_id: str) -> int:
        """The request's leading blocks the page left out: shared when paged out, found in the cache on return."""
        return self._first_block[seq_id]

    @property
    def resident_bytes(self) -> int:
        return self.store.bytes_in(Location.LENT) + self.store.bytes_in(Location.HOST)

    def at_step_boundary(self) -> SwapReport:
        started = time.perf_counter()
        if self.store.at_step_boundary():
            self.stats.paging_s += time.perf_counter() - started
        return self.report()

    def report(self) -> SwapReport:
        lender = self.store.lender
        lent = self.store.prefer is Location.LENT and lender is not None and lender.can_lend()
        return SwapReport(Location.LENT if lent else Location.HOST,
                          self.stats.tokens_out + self.stats.tokens_in, self.stats.paging_s * 1e3,
                          self.resident_bytes)


def make_pager(device: str | torch.device, coordinator_url: str | None = None, *, consumer: str = "",
               poll_every: int = 5, ttl_s: float = 10.0, chunk_mb: float = 64.0) -> KVPager:
    """Swap space in memory lent through the coordinator at coordinator_url (falling back to host
    memory whenever none is lent), or host memory alone when no coordinator is named."""
    if coordinator_url is None:
        return KVPager(ElasticStore(device=torch.device(device), prefer=Location.HOST))
    from backfill.offload.client import ConsumerLender, CoordinatorClient

    lender = ConsumerLender(CoordinatorClient(coordinator_url), consumer, ttl_s=ttl_s, poll_every=poll_every,
                            chunk_bytes=int(chunk_mb * 2**20))
    return KVPager(ElasticStore(device=torch.device(device), lender=lender, prefer=Location.LENT))
