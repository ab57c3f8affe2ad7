"""The pieces of an engine that runs under a node's gate (Valve §3-§5), shared by the node's model
servers (model_server.py) and the benchmark's engine processes (backfill/bench/node_engines/).

    GatedRunner    a ModelRunner whose every step runs through an extra safepoint hook, so an
                   engine can park (or abort) between layers whatever its scheduling policy is.
    HandleBlocks   maps the engine's KVBlockPool onto the node's memory handles: handle h is
                   blocks [h*B, (h+1)*B). Every block starts retired; blocks of granted handles
                   are admitted, blocks of released handles retired again.
    stream_drain   what a gate point calls before it parks: on CUDA, the launched kernels finish.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.runner import ModelRunner, StepOutput
from backfill.engine.step import SeqChunk, SuspendedStep
from backfill.errors import PolicyInputError


def stream_drain(device: str) -> Callable[[], None] | None:
    """What a gate point calls before it parks: on CUDA, wait for the kernels already launched
    (Valve §4: what a paused engine launched finishes; it launches nothing more)."""
    if not device.startswith("cuda"):
        return None
    import torch

    stream = torch.cuda.current_stream(torch.device(device))
    return stream.synchronize


class GatedRunner(ModelRunner):
    """Runs each step with `gate_point(layer)` in front of the scheduler's own safepoint.

    gate_point may block (a cooperative pause parks the step between layers) and returns True
    to abort the step (nothing is committed; the scheduler continues or redoes it later).
    """

    def __init__(self, model, kv: KVBlockPool, gate_point: Callable[[int], bool] | None = None) -> None:
        super().__init__(model, kv)
        self.gate_point = gate_point
        self.step_durations_s: list[float] = []

    def execute(self, chunks: list[SeqChunk], safepoint: Callable[[int], bool] | None = None,
                resume: SuspendedStep | None = None) -> StepOutput:
        gate = self.gate_point
        blocked_s = 0.0
        if gate is None:
            out = super().execute(chunks, safepoint, resume)
        else:
            def combined(layer: int) -> bool:
                nonlocal blocked_s
                t0 = time.perf_counter()
                stop = gate(layer)
                blocked_s += time.perf_counter() - t0
                return stop or (safepoint is not None and safepoint(layer))
            out = super().execute(chunks, combined, resume)
        if chunks and not out.aborted:
            # Compute time only: time parked at a gate point is not the step's.
            self.step_durations_s.append(out.duration_s - blocked_s)
        return out


class HandleBlocks:
    """Which of the engine's KV blocks it may use: those of the node handles it holds."""

    def __init__(self, kv: KVBlockPool, num_handles: int, blocks_per_handle: int) -> None:
        if kv.num_blocks != num_handles * blocks_per_handle:
            raise PolicyInputError(f"KV pool has {kv.num_blocks} blocks, the node pool "
                                   f"{num_handles} x {blocks_per_handle}")
        self.kv = kv
        self.num_handles = num_handles
        self.blocks_per_handle = blocks_per_handle
        self.held: set[int] = set()
        self._grant_order: dict[int, int] = {}
        self._grants = itertools.count()
        # Nothing is ours until the runtime grants it.
        kv.retire(list(range(kv.num_blocks)))

    def blocks(self, handle_id: int) -> list[int]:
        if not 0 <= handle_id < self.num_handles:
            raise PolicyInputError(f"no handle {handle_id}")
        b = self.blocks_per_handle
        return list(range(handle_id * b, (handle_id + 1) * b))

    def handle_of(self, block_id: int) -> int:
        return block_id // self.blocks_per_handle

    def admit(self, handle_ids: tuple[int, ...] | list[int]) -> None:
        """Use these newly granted handles. Free blocks are handed out oldest handle first (lowest
        block first), like an allocator that fills memory from the bottom, so older handles carry
        the running requests and newer ones the spare room."""
        lent = self.kv.retired   # held handles' retired blocks: lent to a finetuning job, left so
        free = [b for h in self.held for b in self.blocks(h) if not self.kv.is_allocated(b) and b not in lent]
        self.kv.retire(free)
        for h in handle_ids:
            self.held.add(h)
            self._grant_order[h] = next(self._grants)
            free.extend(self.blocks(h))
        # KVBlockPool pops from the end of what admit() appended: put the first to use last.
        free.sort(key=lambda b: (self._grant_order[self.handle_of(b)], b), reverse=True)
        self.kv.admit(free)

    def forget(self, handle_ids: tuple[int, ...] | list[int]) -> list[int]:
        """Handles taken by reclamation; returns their blocks (the scheduler retires them)."""
        blocks: list[int] = []
        for h in handle_ids:
            self.held.discard(h)
            blocks.extend(self.blocks(h))
        return blocks

    def fully_free(self) -> list[int]:
        """Held handles none of whose blocks is in use (these can be released). A held handle's retired
        block is lent to a finetuning job (finetune/memory.py KVLease): its handle stays."""
        lent = self.kv.retired
        return sorted(h for h in self.held
                      if not any(self.kv.is_allocated(b) or b in lent for b in self.blocks(h)))

    def retire(self, handle_ids: list[int]) -> None:
        for h in handle_ids:
            self.kv.retire(self.blocks(h))
            self.held.discard(h)

    def covers(self, block_ids: list[int]) -> bool:
        return all(self.handle_of(b) in self.held for b in block_ids)
