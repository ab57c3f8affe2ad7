"""Paged KV cache: a pool of fixed-size blocks shared by all sequences.

Each sequence owns a block table (list of block ids); token at position p lives in block
block_table[p // block_size] at offset p % block_size. The pool only allocates, frees and
copies blocks; which sequence deserves blocks is decided elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backfill.engine.config import ModelConfig
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
                 planes: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """planes: K and V tensors to use instead of fresh ones (memory shared with other
        processes, memory/kv_arena.py); each [layers, num_blocks, block_size, kv_heads, head_dim]."""
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
        # LIFO free list: recently freed blocks are reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._allocated = bytearray(num_blocks)
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
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "KVBlockPool":
        """Size the pool to use about kv_bytes of memory."""
        return cls(config, cls.blocks_in_memory(config, kv_bytes, block_size, dtype), block_size, dtype, device)

    # --- allocation -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - len(self._retired)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / max(1, self.num_usable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._allocated[i] = 1
        return ids

    def free(self, block_ids: list[int]) -> None:
        for i in block_ids:
            if not 0 <= i < self.num_blocks or not self._allocated[i]:
                raise ValueError(f"block {i} is not allocated")
            self._allocated[i] = 0
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
        return bool(self._allocated[block_id])

    def retire(self, block_ids: list[int]) -> None:
        """Stop using these blocks (their memory was reclaimed). They must be free already."""
        ids = set(block_ids)
        if busy := [i for i in ids if self._allocated[i]]:
            raise ValueError(f"cannot retire allocated blocks {sorted(busy)[:8]}")
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
