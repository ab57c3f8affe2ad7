"""Elastic tensors (AQUA §6): tensors whose storage moves between the owner's memory, memory a
neighbouring engine lent, and host memory, at a step boundary, without the user noticing.

Portable form: lent memory is a shared-memory segment (a file under /dev/shm) that a producer
process created and offered through the coordinator; the consumer maps it and copies into the
region the coordinator granted. On CUDA, "device" is the GPU and "host" is pinned host memory;
on CPU both are ordinary process memory. Device form: the producer lends device memory of its
own (memory/cuda_ipc.py DeviceSegment), named `cuda-ipc:...` where a path would be; the consumer
opens it through CUDA IPC and pages into it with device-to-device copies (a neighbour on the
same GPU here; a peer GPU over NVLink opens the same way).

Many small tensors moved together are gathered into one staging buffer and sent in one copy
(AQUA §7 "efficient context switching": small copies waste interconnect bandwidth), and read
back with one copy then scattered.
"""

from __future__ import annotations

import enum
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import torch

from backfill.errors import OffloadError, SharedMemoryError, UnknownTensorError
from backfill.memory.kv_arena import shm_dir
from backfill.memory.regions import LentRegion, align, first_fit

class Location(str, enum.Enum):
    DEVICE = "device"   # the owner's own memory
    LENT = "lent"       # memory a producer engine lent (shared memory here)
    HOST = "host"       # host memory (pinned on CUDA)


class Lender(Protocol):
    """Where lent memory comes from: the coordinator's client, or a local segment in tests."""

    def allocate(self, nbytes: int) -> LentRegion | None: ...

    def free(self, region: LentRegion) -> None: ...

    def to_vacate(self) -> set[str]:
        """Region ids whose producer asked for them back (or that can no longer be trusted)."""
        ...

    def can_lend(self) -> bool: ...


class ShmSegment:
    """A shared-memory segment a producer creates and lends (it owns and finally unlinks it)."""

    def __init__(self, nbytes: int, *, path: str | None = None) -> None:
        if nbytes < 1:
            raise OffloadError(f"a segment needs at least one byte, got {nbytes}")
        self.path = path or os.path.join(shm_dir(), f"backfill-lent-{uuid.uuid4().hex}")
        with open(self.path, "wb") as f:
            f.truncate(nbytes)
        self.nbytes = nbytes
        self.bytes = map_segment(self.path)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def make_segment(nbytes: int, device: str | torch.device = "cpu"):
    """Memory a producer lends: a /dev/shm segment, or device memory shared through CUDA IPC."""
    if torch.device(device).type == "cuda":
        from backfill.memory.cuda_ipc import DeviceSegment

        try:
            return DeviceSegment(nbytes, device)
        except SharedMemoryError as exc:
            raise OffloadError(str(exc)) from exc
    return ShmSegment(nbytes)


def map_segment(path: str) -> torch.Tensor:
    """The whole segment as a uint8 tensor shared with every process that maps it: a /dev/shm
    file, or a producer's device memory by its CUDA IPC name."""
    from backfill.memory import cuda_ipc

    if cuda_ipc.is_ipc_name(path):
        try:
            return cuda_ipc.open_shared(path)
        except SharedMemoryError as exc:
            raise OffloadError(f"cannot open lent device memory: {exc}") from exc
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise OffloadError(f"cannot map lent segment {path}: {exc}") from exc
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@dataclass
class ElasticTensor:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    location: Location
    storage: torch.Tensor            # shaped view of wherever the bytes are now
    region: LentRegion | None = None

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()


@dataclass
class MoveStats:
    moves: int = 0                   # move() calls that copied something
    tensors_moved: int = 0
    bytes_moved: int = 0
    move_s: float = 0.0
    fell_back: int = 0               # tensors that wanted lent memory and went to host
    vacated: int = 0                 # tensors moved out because their producer reclaimed


@dataclass
class ElasticStore:
    """A consumer's elastic tensors, by key. Moves happen only when the owner calls in (a step
    boundary), so no compute ever reads a tensor while its bytes move (AQUA §8)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    lender: Lender | None = None
    prefer: Location = Location.LENT
    stats: MoveStats = field(default_factory=MoveStats)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" and "cuda:0" compare unequal: name the index, so lent memory on the same
            # device is written straight into, not staged.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._tensors: dict[str, ElasticTensor] = {}
        self._region_keys: dict[str, set[str]] = {}
        self._regions: dict[str, LentRegion] = {}
        self._segments: dict[str, torch.Tensor] = {}

    # --- reading and writing -----------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def keys(self) -> list[str]:
        return list(self._tensors)

    def location(self, key: str) -> Location:
        return self._get(key).location

    def view(self, key: str) -> torch.Tensor:
        """The tensor where it lies now (no copy); valid until the next move or free."""
        return self._get(key).storage

    def read(self, key: str) -> torch.Tensor:
        """A private copy of the tensor's bytes on the owner's device."""
        return self._get(key).storage.to(self.device, copy=True)

    def put(self, key: str, tensor: torch.Tensor, location: Location | None = None) -> Location:
        """Store a copy of tensor (replacing key) where asked, else where preferred; lent memory
        falls back to host memory when none can be had."""
        if key in self._tensors:
            self.free(key)
        to = location or self.prefer
        # Staged on the owner's device; a copy right away if it is to stay there.
        staged = tensor.to(self.device, copy=to is Location.DEVICE)
        self._tensors[key] = ElasticTensor(key, tuple(tensor.shape), tensor.dtype, Location.DEVICE, staged)
        self.move([key], to)
        return self._tensors[key].location

    def empty(self, key: str, shape: tuple[int, ...], dtype: torch.dtype,
              location: Location | None = None) -> torch.Tensor:
        """Make room for a tensor (replacing key) and return its storage for the caller to fill
        in place, e.g. with one gathering kernel (no staging copy)."""
        if key in self._tensors:
            self.free(key)
        nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
        dest, region, to = self._place(align(nbytes), location or self.prefer)
        if dest is None:
            dest = torch.empty(align(nbytes), dtype=torch.uint8, device=self.device)
        storage = dest[:nbytes].view(dtype).view(shape)
        self._tensors[key] = ElasticTensor(key, tuple(shape), dtype, to, storage, region)
        if region is not None:
            self._regions[region.region_id] = region
            self._region_keys.setdefault(region.region_id, set()).add(key)
        return storage

    def take(self, key: str) -> torch.Tensor:
        """Read and free: the bytes, on the owner's device."""
        data = self.read(key)
        self.free(key)
        return data

    def free(self, key: str) -> None:
        elastic = self._tensors.pop(key, None)
        if elastic is None:
            raise UnknownTensorError(f"no elastic tensor {key!r}")
        self._detach(elastic)

    def bytes_in(self, location: Location) -> int:
        return sum(t.nbytes for t in self._tensors.values() if t.location is location)

    # --- moving --------------------------------------------------------------------------------

    def move(self, keys: list[str], to: Location) -> Location:
        """Move these tensors to one location in one gathered copy; returns where they went
        (host memory when lent memory was asked for and none could be had)."""
        tensors = [self._get(k) for k in keys]
        tensors = [t for t in tensors if t.location is not to]
        if not tensors:
            return to
        started = time.perf_counter()
        offsets, total = _layout(tensors)
        dest, region, to = self._place(total, to)
        if any(t.location is to for t in tensors):  # lent memory fell back to host
            tensors = [t for t in tensors if t.location is not to]
            offsets, _ = _layout(tensors)
        if not tensors:
            return to
        if dest is None or dest.device != self.device:
            staging = self._gather(tensors, offsets, total)
            if dest is None:
                dest = staging
            else:
                dest.copy_(staging)         # the one transfer
        else:
            for t, offset in zip(tensors, offsets):  # straight into the destination
                dest[offset:offset + t.nbytes].copy_(as_bytes(t.storage))
        for t, offset in zip(tensors, offsets):
            self._detach(t)
            t.storage = dest[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
            t.location, t.region = to, region
            if region is not None:
                self._regions[region.region_id] = region
                self._region_keys.setdefault(region.region_id, set()).add(t.key)
        self.stats.moves += 1
        self.stats.tensors_moved += len(tensors)
        self.stats.bytes_moved += total
        self.stats.move_s += time.perf_counter() - started
        return to

    def at_step_boundary(self) -> int:
        """Vacate regions the producers want back (to host memory, gathered), then move host
        tensors back into lent memory while it is offered. Returns tensors moved."""
        if self.lender is None:
            return 0
        moved = 0
        vacate = self.lender.to_vacate() & self._regions.keys()
        for region_id in vacate:
            keys = sorted(self._region_keys.get(region_id, ()))
            self.move(keys, Location.HOST)
            self.stats.vacated += len(keys)
            moved += len(keys)
        if self.prefer is Location.LENT and not vacate and self.lender.can_lend():
            stranded = [k for k, t in self._tensors.items() if t.location is Location.HOST]
            if stranded and self.move(stranded, Location.LENT) is Location.LENT:
                moved += len(stranded)
        return moved

    # --- internals -----------------------------------------------------------------------------

    def _get(self, key: str) -> ElasticTensor:
        try:
            return self._tensors[key]
        except KeyError:
            raise UnknownTensorError(f"no elastic tensor {key!r}") from None

    def _place(self, total: int, to: Location) -> tuple[torch.Tensor | None, LentRegion | None, Location]:
        """Room for total bytes at `to` (host memory if no lent memory can be had); None: the
        owner's device, where a staging buffer is the destination itself."""
        if to is Location.LENT:
            region = self.lender.allocate(total) if self.lender is not None and self.lender.can_lend() else None
            if region is not None:
                return self._segment(region.segment)[region.offset:region.offset + total], region, to
            self.stats.fell_back += 1
            to = Location.HOST
        pinned = to is Location.HOST and self.device.type == "cuda"
        target = self.device if to is Location.DEVICE else torch.device("cpu")
        if target == self.device and not pinned:
            return None, None, to
        return torch.empty(total, dtype=torch.uint8, device=target, pin_memory=pinned), None, to

    def _gather(self, tensors: list[ElasticTensor], offsets: list[int], total: int) -> torch.Tensor:
        """One contiguous staging buffer on the owner's device holding every tensor's bytes."""
        staging = torch.empty(total, dtype=torch.uint8, device=self.device)
        for t, offset in zip(tensors, offsets):
            staging[offset:offset + t.nbytes].copy_(as_bytes(t.storage), non_blocking=True)
        return staging

    def _segment(self, path: str) -> torch.Tensor:
        if path not in self._segments:
            self._segments[path] = map_segment(path)
        return self._segments[path]

    def _detach(self, elastic: ElasticTensor) -> None:
        """Drop elastic's claim on its lent region; free the region when nobody uses it."""
        region = elastic.region
        if region is None:
            return
        elastic.region = None
        users = self._region_keys.get(region.region_id, set())
        users.discard(elastic.key)
        if not users:
            self._region_keys.pop(region.region_id, None)
            self._regions.pop(region.region_id, None)
            if self.lender is not None:
                self.lender.free(region)


def _layout(tensors: list[ElasticTensor]) -> tuple[list[int], int]:
    """Aligned offsets of tensors packed into one buffer, and its size."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += align(t.nbytes)
    return offsets, total


class LocalLender:
    """Lent memory from a segment without a coordinator (one producer, in tests and benches)."""

    def __init__(self, segment: ShmSegment) -> None:
        self.segment = segment
        self.reclaiming = False
        self._taken: dict[str, tuple[int, int]] = {}

    def allocate(self, nbytes: int) -> LentRegion | None:
        if self.reclaiming:
            return None
        offset = first_fit(list(self._taken.values()), self.segment.nbytes, nbytes)
        if offset is None:
            return None
        region = LentRegion(uuid.uuid4().hex, self.segment.path, offset, nbytes)
        self._taken[region.region_id] = (offset, nbytes)
        return region

    def free(self, region: LentRegion) -> None:
        self._taken.pop(region.region_id, None)

    def to_vacate(self) -> set[str]:
        return set(self._taken) if self.reclaiming else set()

    def can_lend(self) -> bool:
        return not self.reclaiming

    @property
    def bytes_lent(self) -> int:
        return sum(n for _, n in self._taken.values())
