"""The node's KV pool as one allocation shared by every engine process (Valve §5).

The memory pool (node/memory_pool.py) hands out handles: handle h is KV blocks
[h * blocks_per_handle, (h + 1) * blocks_per_handle). Here those blocks are bytes of one
allocation every engine of the node maps, so a handle taken from an offline engine and given to
the online engine changes owner without a byte moving: both engines see the same memory, and
only the bookkeeping (which engine may write which blocks) changes.

    KVLayout      where block b of layer l lives in the arena (K plane, then V plane, each
                  [layers, blocks, block_size, kv_heads, head_dim], the layout of KVBlockPool),
                  and the byte ranges one handle covers (what a reclamation hands over).
    HostArena     the portable form: a file under /dev/shm mapped by every process.
    CudaIpcArena  one device allocation shared through CUDA IPC (torch's CUDA tensor sharing:
                  torch.multiprocessing.reductions.reduce_tensor / rebuild_cuda_tensor). The
                  creating process (the node runtime's) keeps it alive until every engine stops.
    ArenaDescriptor  what an engine needs to attach (JSON-able: it travels in the engine's spec
                  or in the runtime's reply to register); attach() gives the arena's bytes.

Engines of one arena must share the KV layout (model shape, block size, dtype); models of
different shapes on one node keep a private KV tensor each (the logical pool).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import torch

from backfill.errors import PolicyInputError, SharedMemoryError
from backfill.memory import cuda_ipc

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ARENA_KINDS = ("host-shm", "cuda-ipc")


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PolicyInputError(f"KVLayout.{name} must be an integer >= 1, got {value!r}")
        if self.dtype not in DTYPES:
            raise PolicyInputError(f"KVLayout.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @classmethod
    def of(cls, config, num_blocks: int, block_size: int, dtype: str = "float32") -> "KVLayout":
        """The layout of a model config's KV pool (a ModelConfig)."""
        return cls(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def element_bytes(self) -> int:
        return torch.tensor([], dtype=self.torch_dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """One block of one layer, K or V."""
        return self.block_size * self.kv_heads * self.head_dim * self.element_bytes

    @property
    def plane_shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_blocks, self.block_size, self.kv_heads, self.head_dim)

    @property
    def plane_bytes(self) -> int:
        return self.num_layers * self.num_blocks * self.block_bytes

    @property
    def nbytes(self) -> int:
        return 2 * self.plane_bytes

    def block_ranges(self, block_ids: list[int] | range) -> list[tuple[int, int]]:
        """(offset, nbytes) of every byte of these blocks (all layers, K and V), adjacent blocks
        merged into one range."""
        ids = sorted(set(int(b) for b in block_ids))
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise PolicyInputError(f"no block {b} in a layout of {self.num_blocks} blocks")
        runs: list[tuple[int, int]] = []
        for b in ids:
            if runs and runs[-1][1] == b:
                runs[-1] = (runs[-1][0], b + 1)
            else:
                runs.append((b, b + 1))
        ranges = []
        for plane in range(2):
            for layer in range(self.num_layers):
                base = plane * self.plane_bytes + layer * self.num_blocks * self.block_bytes
                ranges.extend((base + lo * self.block_bytes, (hi - lo) * self.block_bytes) for lo, hi in runs)
        return ranges

    def handle_ranges(self, handle_id: int, blocks_per_handle: int) -> list[tuple[int, int]]:
        """The bytes handle h covers: what changes owner when the pool moves it (Valve §5)."""
        if blocks_per_handle < 1 or self.num_blocks % blocks_per_handle:
            raise PolicyInputError(f"{self.num_blocks} blocks do not split into handles of {blocks_per_handle}")
        return self.block_ranges(range(handle_id * blocks_per_handle, (handle_id + 1) * blocks_per_handle))


@dataclass(frozen=True)
class ArenaDescriptor:
    """How a process attaches to an arena; JSON-able (to_json / from_json)."""

    kind: str                 # host-shm | cuda-ipc
    layout: KVLayout
    path: str = ""            # host-shm: the segment's file
    ipc: str = ""             # cuda-ipc: the allocation's CUDA IPC name (memory/cuda_ipc.py)
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.kind not in ARENA_KINDS:
            raise SharedMemoryError(f"arena kind must be one of {ARENA_KINDS}, got {self.kind!r}")
        if self.kind == "host-shm" and not self.path:
            raise SharedMemoryError("a host-shm arena needs its segment path")
        if self.kind == "cuda-ipc" and not self.ipc:
            raise SharedMemoryError("a cuda-ipc arena needs its IPC handle")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ArenaDescriptor":
        if not isinstance(data, dict) or not isinstance(data.get("layout"), dict):
            raise SharedMemoryError(f"not an arena descriptor: {data!r:.120}")
        try:
            return cls(**{**data, "layout": KVLayout(**data["layout"])})
        except TypeError as exc:
            raise SharedMemoryError(f"not an arena descriptor: {exc}") from None


def kv_planes(arena: torch.Tensor, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V planes of an arena's bytes, shaped as KVBlockPool's k and v."""
    if arena.dtype != torch.uint8 or arena.dim() != 1 or arena.numel() < layout.nbytes:
        raise SharedMemoryError(f"arena of {arena.numel()} bytes cannot hold a layout of {layout.nbytes}")
    typed = arena[:layout.nbytes].view(layout.torch_dtype)
    half = layout.plane_bytes // layout.element_bytes
    return typed[:half].view(layout.plane_shape), typed[half:].view(layout.plane_shape)


def shm_dir() -> str:
    """Where memory shared between processes lives as files: /dev/shm (tmpfs), else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class HostArena:
    """An arena in host memory: a file under /dev/shm that every engine maps (the creator unlinks it)."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.path = os.path.join(shm_dir(), f"backfill-kv-{uuid.uuid4().hex}")
        try:
            with open(self.path, "wb") as f:
                f.truncate(layout.nbytes)
            self.bytes = torch.from_file(self.path, shared=True, size=layout.nbytes, dtype=torch.uint8)
        except (OSError, RuntimeError) as exc:
            self.close()
            raise SharedMemoryError(f"cannot make a {layout.nbytes}-byte host arena: {exc}") from exc

    def descriptor(self) -> ArenaDescriptor:
        return ArenaDescriptor("host-shm", self.layout, path=self.path)

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class CudaIpcArena:
    """An arena in device memory, shared through a CUDA IPC handle of one allocation."""

    def __init__(self, layout: KVLayout, device: str = "cuda") -> None:
        self.layout = layout
        try:
            self.bytes = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
        except RuntimeError as exc:
            raise SharedMemoryError(f"cannot allocate {layout.nbytes} bytes on {device}: {exc}") from exc
        self._ipc = cuda_ipc.share(self.bytes)
        self.device = str(self.bytes.device)

    def descriptor(self) -> ArenaDescriptor:
        return ArenaDescriptor("cuda-ipc", self.layout, ipc=self._ipc, device=self.device)

    def close(self) -> None:
        """Drop the allocation; call after every engine attached to it has stopped."""
        self.bytes = None
        try:
            torch.cuda.ipc_collect()
        except RuntimeError:
            pass


def make_arena(layout: KVLayout, device: str) -> HostArena | CudaIpcArena:
    return CudaIpcArena(layout, device) if str(device).startswith("cuda") else HostArena(layout)


def attach(descriptor: ArenaDescriptor) -> torch.Tensor:
    """The arena's bytes in this process (no copy): a map of the host segment, or the device
    allocation opened from its IPC handle."""
    layout = descriptor.layout
    if descriptor.kind == "host-shm":
        try:
            size = os.path.getsize(descriptor.path)
        except OSError as exc:
            raise SharedMemoryError(f"cannot attach host arena {descriptor.path}: {exc}") from exc
        if size < layout.nbytes:
            raise SharedMemoryError(f"host arena {descriptor.path} has {size} bytes, the layout needs {layout.nbytes}")
        return torch.from_file(descriptor.path, shared=True, size=size, dtype=torch.uint8)
    tensor = cuda_ipc.open_shared(descriptor.ipc)
    if tensor.numel() < layout.nbytes:
        raise SharedMemoryError(f"CUDA IPC arena has {tensor.numel()} bytes, the layout needs {layout.nbytes}")
    return tensor
