"""Gathered paging vs one copy per block (AQUA §7 "efficient context switching"), measured.

A prompt's KV lives in many small pieces: one [block_size, kv_heads, head_dim] slice per layer,
for K and for V, per block. Paging it out one piece at a time makes 2 x layers x blocks small
copies; the gathered form collects them into one staging tensor and sends that in one copy
(and reads back in one copy, then scatters). Both are timed here into host memory and into a
shared-memory segment (lent memory), with the default model's KV geometry.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from backfill.engine.config import ModelConfig
from backfill.engine.kv_pool import KVBlockPool
from backfill.memory.elastic import ShmSegment
from backfill.memory.pager import gather_blocks, page_shape, scatter_blocks


@dataclass(frozen=True)
class TransferFigure:
    destination: str          # host | lent
    method: str               # per-block | gathered
    direction: str            # out (pool -> swap) | in (swap -> pool)
    blocks: int
    bytes: int
    copies: int               # copy calls per transfer (gathered: one indexed copy for K, one for V)
    median_ms: float
    gb_per_s: float


def _per_block_out(kv: KVBlockPool, block_ids: list[int], dest: torch.Tensor) -> None:
    page = dest.view(kv.dtype).view(page_shape(kv, len(block_ids)))
    for layer in range(kv.k.shape[0]):
        for j, b in enumerate(block_ids):
            page[0, layer, j].copy_(kv.k[layer, b])
            page[1, layer, j].copy_(kv.v[layer, b])


def _per_block_in(kv: KVBlockPool, block_ids: list[int], src: torch.Tensor) -> None:
    page = src.view(kv.dtype).view(page_shape(kv, len(block_ids)))
    for layer in range(kv.k.shape[0]):
        for j, b in enumerate(block_ids):
            kv.k[layer, b].copy_(page[0, layer, j])
            kv.v[layer, b].copy_(page[1, layer, j])


def _gathered_out(kv: KVBlockPool, block_ids: list[int], dest: torch.Tensor) -> None:
    gather_blocks(kv, block_ids, dest.view(kv.dtype).view(page_shape(kv, len(block_ids))))


def _gathered_in(kv: KVBlockPool, block_ids: list[int], src: torch.Tensor) -> None:
    scatter_blocks(kv, block_ids, src.view(kv.dtype).view(page_shape(kv, len(block_ids))))


def measure_transfers(config: ModelConfig, *, blocks: tuple[int, ...] = (4, 16, 64), block_size: int = 16,
                      repeats: int = 15, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
                      lent: torch.Tensor | None = None,
                      methods: tuple[str, ...] = ("per-block", "gathered")) -> list[TransferFigure]:
    """Each (destination, method, direction, size) timed `repeats` times, the methods interleaved.

    On CUDA the pool is on the device, "host" is pinned host memory (the PCIe / NVLink path) and
    `lent` is the lent memory (a neighbour's device memory opened through CUDA IPC); each copy is
    timed to its completion (the stream synchronized)."""
    max_blocks = max(blocks)
    kv = KVBlockPool(config, 2 * max_blocks + 1, block_size, dtype, device)
    g = torch.Generator().manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g).to(dtype))
    per_block_bytes = kv.nbytes // kv.num_blocks
    on_cuda = kv.device.type == "cuda"
    segment = None
    if lent is None:
        segment = ShmSegment(per_block_bytes * max_blocks)
        lent = segment.bytes
    if lent.numel() < per_block_bytes * max_blocks:
        raise ValueError(f"lent memory of {lent.numel()} bytes; {per_block_bytes * max_blocks} needed")
    host = torch.empty(per_block_bytes * max_blocks, dtype=torch.uint8, pin_memory=on_cuda)

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize(kv.device)

    chosen = [m for m in (("per-block", _per_block_out, _per_block_in), ("gathered", _gathered_out, _gathered_in))
              if m[0] in methods]
    figures = []
    try:
        for n in blocks:
            ids = list(range(1, 2 * n, 2))  # every other block: scattered, as a real block table is
            nbytes = per_block_bytes * n
            for dest_name, buffer in (("host", host), ("lent", lent)):
                dest = buffer[:nbytes]
                times: dict[tuple[str, str], list[float]] = {}
                for _ in range(repeats):
                    for method, out_fn, in_fn in chosen:
                        for direction, fn in (("out", out_fn), ("in", in_fn)):
                            sync()
                            started = time.perf_counter()
                            fn(kv, ids, dest)
                            sync()
                            times.setdefault((method, direction), []).append(time.perf_counter() - started)
                for (method, direction), samples in times.items():
                    median = statistics.median(samples)
                    copies = 2 * config.num_layers * n if method == "per-block" else 2  # K, V
                    figures.append(TransferFigure(dest_name, method, direction, n, nbytes, copies,
                                                  median * 1e3, nbytes / median / 1e9))
    finally:
        if segment is not None:
            segment.unlink()
    return figures


def figures_json(figures: list[TransferFigure]) -> list[dict]:
    return [asdict(f) for f in figures]


def speedups(figures: list[TransferFigure]) -> dict[str, float]:
    """Gathered over per-block transfer rate, per destination, direction and size."""
    by = {(f.destination, f.method, f.direction, f.blocks): f for f in figures}
    out = {}
    for (dest, method, direction, n), fig in by.items():
        base = by.get((dest, "per-block", direction, n))
        if method == "gathered" and base is not None:
            out[f"{dest}-{direction}-{n}"] = fig.gb_per_s / base.gb_per_s
    return out
