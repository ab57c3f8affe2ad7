"""Paged KV cache: a pool of fixed-size blocks shared by all sequences.

Each sequence owns a block table (list of block ids); token at position p lives in block
block_table[p // block_size] at offset p % block_size. The pool only allocates, frees and
copies blocks; which sequence deserves blocks is decided elsewhere.

Prefix caching (as vLLM v1's automatic prefix caching): a full block may be registered under its
content address (engine/prefix_cache.py); blocks carry reference counts, so several block tables
map one cached block. A freed block that holds a cached prefix stays findable, counted free, until
an allocation needs its memory. Eviction knows the request classes and reuse (Echo): blocks only
offline requests used go first, then blocks an online request computed, and last blocks an online
request found cached (a prefix online traffic shares, such as its system prompt); each class least
recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from backfill.engine.config import ModelConfig
from backfill.engine.prefix_cache import BlockHash, root_hash
from backfill.errors import OutOfBlocksError


@dataclass
class HostBlocks:
    """A copy of some KV blocks in host memory: [layers, 2 (K/V), n, block_size, kv_heads, head_dim]."""

    data: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class KVBlockPool:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 planes: tuple[torch.Tensor, torch.Tensor] | None = None, prefix_caching: bool = True) -> None:
        """planes: K and V tensors to use instead of fresh ones (memory shared with other
        processes, memory/kv_arena.py); each [layers, num_blocks, block_size, kv_heads, head_dim].
        prefix_caching: full blocks may be registered and found by content; off, register is a no-op."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        if planes is None:
            self.k = torch.zeros(shape, dtype=dtype, device=self.device)
            self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        else:
            self.k, self.v = planes
            for plane in planes:
                if tuple(plane.shape) != shape or plane.dtype != dtype or plane.device.type != self.device.type:
                    raise ValueError(f"KV plane {tuple(plane.shape)} {plane.dtype} on {plane.device} does not "
                                     f"match {shape} {dtype} on {self.device}")
        # Each layer's K and V as flat token slots [num_blocks * block_size, kv_heads, head_dim],
        # made once: the model writes every layer's new tokens through them each step.
        slots = (num_blocks * block_size, config.num_kv_heads, config.head_dim)
        self.k_slots = [layer.view(slots) for layer in self.k]
        self.v_slots = [layer.view(slots) for layer in self.v]
        self.prefix_caching = prefix_caching
        # The root of every block address in this pool: a block's values depend on these too.
        self.hash_root: BlockHash = root_hash(config.name, str(dtype), str(block_size))
        # LIFO free list of blocks holding no cached prefix: reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        # Free blocks that hold a cached prefix, least recently used first, in three classes evicted in
        # order (Echo): [0] used by offline requests only; [1] computed by an online request; [2] found
        # cached by an online request.
        self._evictable: tuple[OrderedDict[int, None], ...] = (OrderedDict(), OrderedDict(), OrderedDict())
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        self._class_of = bytearray(num_blocks)   # each block's eviction class, as above
        self.evictions = 0
        # Blocks taken away by a node runtime (Valve §4.3 reclamation) are neither free nor usable.
        self._retired: set[int] = set()

    @staticmethod
    def blocks_in_memory(config: ModelConfig, kv_bytes: int, block_size: int = 16,
                         dtype: torch.dtype = torch.float32) -> int:
        """How many blocks of this model's KV fit in kv_bytes (at least one)."""
        bytes_per_block = (2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim
                           * torch.tensor([], dtype=dtype).element_size())
        return max(1, kv_bytes // bytes_per_block)

    @classmethod
    def for_memory(cls, config: ModelConfig, kv_bytes: int, block_size: int = 16,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   prefix_caching: bool = True) -> "KVBlockPool":
        """Size the pool to use about kv_bytes of memory."""
        return cls(config, cls.blocks_in_memory(config, kv_bytes, block_size, dtype), block_size, dtype, device,
                   prefix_caching=prefix_caching)

    # --- allocation -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: never-cached free blocks and free cached ones (evictable)."""
        return len(self._free) + self.num_cached_free

    @property
    def num_cached_free(self) -> int:
        """Free blocks still holding a cached prefix (reclaimable: evicted when memory is needed)."""
        return sum(len(lru) for lru in self._evictable)

    # The eviction classes of free cached blocks, in the order they are evicted (for reports).
    CACHED_FREE_CLASSES = ("offline", "online_computed", "online_reused")

    @property
    def num_cached_free_by_class(self) -> dict[str, int]:
        """Free blocks holding a cached prefix, per eviction class (CACHED_FREE_CLASSES)."""
        return {name: len(lru) for name, lru in zip(self.CACHED_FREE_CLASSES, self._evictable)}

    @property
    def num_online_reused_free(self) -> int:
        """Free cached blocks an online request found cached (Echo: evicted last; the policies' plans
        keep offline allocations off them)."""
        return len(self._evictable[2])

    @property
    def num_cached(self) -> int:
        """Blocks registered under a content address, in use or free."""
        return len(self._block_of)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - len(self._retired)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / max(1, self.num_usable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """n blocks for new KV: never-cached free blocks first, then evicted cached ones (by class,
        each least recently used first)."""
        if n > self.num_free:
            raise OutOfBlocksError(f"asked for {n} KV blocks, {self.num_free} free of {self.num_blocks}")
        ids = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                lru = next(lru for lru in self._evictable if lru)
                block, _ = lru.popitem(last=False)
                self._uncache(block)
                self.evictions += 1
            self._refs[block] = 1
            ids.append(block)
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block nobody references is free again (findable
        until evicted when it holds a cached prefix)."""
        for i in block_ids:
            if not 0 <= i < self.num_blocks or not self._refs[i]:
                raise ValueError(f"block {i} is not allocated")
        # In reverse: a table's last blocks (its own suffix) become the least recently used, so
        # they are evicted before the prefix other requests share (vLLM v1 frees in this order).
        for i in reversed(block_ids):
            self._refs[i] -= 1
            if self._refs[i]:
                continue
            if i in self._hash_of:
                self._evictable[self._class_of[i]][i] = None
            else:
                self._free.append(i)

    def grow(self, block_table: list[int], num_tokens: int) -> list[int]:
        """Extend block_table in place so it can hold num_tokens; return the new block ids."""
        missing = self.blocks_needed(num_tokens) - len(block_table)
        if missing <= 0:
            return []
        new = self.allocate(missing)
        block_table.extend(new)
        return new

    def is_allocated(self, block_id: int) -> bool:
        return bool(self._refs[block_id])

    def ref_count(self, block_id: int) -> int:
        """How many block tables map this block now."""
        return self._refs[block_id]

    # --- prefix caching -------------------------------------------------------------------------

    def cached_blocks(self, hashes: list[BlockHash]) -> list[int]:
        """The blocks holding the longest run of these addresses from the first (a probe: nothing
        is taken or touched)."""
        found = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def take_cached(self, hashes: list[BlockHash], online: bool) -> list[int]:
        """Map the longest cached run of these addresses: one more reference to each of its blocks
        (a free one leaves the eviction queue); online puts them in the class evicted last."""
        found = self.cached_blocks(hashes)
        for block in found:
            if not self._refs[block]:
                self._evictable[self._class_of[block]].pop(block)
            self._refs[block] += 1
            if online:
                self._class_of[block] = 2
        return found

    def register(self, block_id: int, block_hash: BlockHash, online: bool) -> bool:
        """Record that this allocated, full block holds the KV its address names; False when caching
        is off, the block is registered already, or another block holds that address (two requests
        computed the same prefix at once: the first stays the cached one)."""
        if not self._refs[block_id]:
            raise ValueError(f"block {block_id} is not allocated")
        if online:
            self._class_of[block_id] = max(self._class_of[block_id], 1)
        if not self.prefix_caching or block_id in self._hash_of or block_hash in self._block_of:
            return False
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        return True

    def clear_cache(self) -> int:
        """Forget every cached prefix (free cached blocks become plain free blocks); returns how many
        addresses were dropped."""
        dropped = len(self._block_of)
        for lru in self._evictable:
            self._free.extend(lru)
            lru.clear()
        for block in list(self._hash_of):
            self._uncache(block)
        return dropped

    def _uncache(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
        self._class_of[block] = 0

    # --- reclamation ----------------------------------------------------------------------------

    def retire(self, block_ids: list[int]) -> None:
        """Stop using these blocks (their memory was reclaimed). They must be free already; a free
        cached block is forgotten (Valve §5: free cached blocks are reclaimable)."""
        ids = set(block_ids)
        if busy := [i for i in ids if self._refs[i]]:
            raise ValueError(f"cannot retire allocated blocks {sorted(busy)[:8]}")
        for i in ids:
            for lru in self._evictable:
                lru.pop(i, None)
            self._uncache(i)
        self._retired |= ids
        self._free = [i for i in self._free if i not in ids]

    def admit(self, block_ids: list[int]) -> None:
        """Use these blocks again (memory granted back)."""
        back = [i for i in block_ids if i in self._retired]
        self._retired.difference_update(back)
        self._free.extend(back)

    @property
    def retired(self) -> frozenset[int]:
        return frozenset(self._retired)

    # --- host copies (checkpointing, swap) -------------------------------------------------------

    def copy_to_host(self, block_ids: list[int], non_blocking: bool = False) -> HostBlocks:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        pinned = self.device.type == "cuda"
        data = torch.stack([self.k.index_select(1, index), self.v.index_select(1, index)], dim=1)
        if self.device.type == "cpu":
            return HostBlocks(data)
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=pinned)
        host.copy_(data, non_blocking=non_blocking)
        return HostBlocks(host)

    def copy_from_host(self, host: HostBlocks, block_ids: list[int], non_blocking: bool = False) -> None:
        if len(block_ids) != host.num_blocks:
            raise ValueError(f"{host.num_blocks} host blocks but {len(block_ids)} destination ids")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = host.data.to(self.device, non_blocking=non_blocking)
        self.k.index_copy_(1, index, data[:, 0])
        self.v.index_copy_(1, index, data[:, 1])

    def copy_blocks(self, src_ids: list[int], dst_ids: list[int]) -> None:
        src = torch.tensor(src_ids, dtype=torch.long, device=self.device)
        dst = torch.tensor(dst_ids, dtype=torch.long, device=self.device)
        self.k.index_copy_(1, dst, self.k.index_select(1, src))
        self.v.index_copy_(1, dst, self.v.index_select(1, src))

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
