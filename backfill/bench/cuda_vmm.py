"""Pool handles as physical device pages mapped into each engine's address space (Valve §5, CUDA
virtual memory management).

With CUDA IPC (kv_arena.py) every engine maps the whole pool and only bookkeeping says who may
write which blocks. With the driver's virtual memory management each handle is its own physical
allocation, and a handle is mapped only in the process that holds it: reclaiming unmaps it from
the offline engine and maps it into the online engine. No byte moves, and the offline engine
can no longer touch the pages at all.

    PageMap      the bookkeeping, free of CUDA: which engine maps which handle, at which offset
                 of its reserved range, and the map / unmap operations a grant, release or
                 reclamation takes. Every engine maps handle h at the same offset h * chunk_bytes.
    VmmPages     the physical side (the node runtime): one cuMemCreate allocation per handle,
                 exported as POSIX file descriptors (cuMemExportToShareableHandle), sent to
                 engines over a Unix socket (socket.send_fds).
    VmmSpace     an engine's side: cuMemImportFromShareableHandle of the descriptors, one
                 cuMemAddressReserve range, cuMemMap / cuMemSetAccess / cuMemUnmap as PageMap
                 says; `tensor()` is the range as a torch tensor (__cuda_array_interface__).

The CUDA parts go through `cuda.bindings.driver` (cuda-python), imported only when used. The
node's engines share the pool through the CUDA IPC arena instead; this form is the harness's,
reached by the device checks (scripts/gpu_check*.sh) and tests only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backfill.errors import PolicyInputError, SharedMemoryError


def round_up(nbytes: int, granularity: int) -> int:
    if granularity < 1:
        raise PolicyInputError(f"granularity must be >= 1, got {granularity}")
    return -(-nbytes // granularity) * granularity


@dataclass(frozen=True)
class PageOp:
    kind: str          # map | unmap
    engine: str
    handle: int
    va_offset: int     # in the engine's reserved range
    nbytes: int


class PageMap:
    """Which engine maps which handle (each handle in at most one engine at a time)."""

    def __init__(self, num_handles: int, handle_bytes: int, granularity: int) -> None:
        if num_handles < 1 or handle_bytes < 1:
            raise PolicyInputError(f"need num_handles >= 1 and handle_bytes >= 1, got {num_handles}, {handle_bytes}")
        self.num_handles = num_handles
        self.granularity = granularity
        # The driver maps whole granules: a handle is rounded up to one or more of them.
        self.chunk_bytes = round_up(handle_bytes, granularity)
        self._holder: dict[int, str] = {}
        self.ops_applied = 0

    @property
    def reservation_bytes(self) -> int:
        """The virtual range each engine reserves: room for every handle."""
        return self.num_handles * self.chunk_bytes

    @property
    def physical_bytes(self) -> int:
        return self.num_handles * self.chunk_bytes

    def va_offset(self, handle: int) -> int:
        self._check(handle)
        return handle * self.chunk_bytes

    def holder(self, handle: int) -> str | None:
        self._check(handle)
        return self._holder.get(handle)

    def mapped(self, engine: str) -> tuple[int, ...]:
        return tuple(sorted(h for h, e in self._holder.items() if e == engine))

    def grant(self, engine: str, handles: list[int] | tuple[int, ...]) -> list[PageOp]:
        """Map free handles into engine; a handle another engine maps must be reclaimed first."""
        for h in handles:
            if self.holder(h) is not None:
                raise SharedMemoryError(f"handle {h} is mapped by {self._holder[h]!r}; reclaim it first")
        ops = []
        for h in handles:
            self._holder[h] = engine
            ops.append(PageOp("map", engine, h, self.va_offset(h), self.chunk_bytes))
        return ops

    def release(self, engine: str, handles: list[int] | tuple[int, ...]) -> list[PageOp]:
        for h in handles:
            if self.holder(h) != engine:
                raise SharedMemoryError(f"{engine!r} does not map handle {h}")
        ops = []
        for h in handles:
            del self._holder[h]
            ops.append(PageOp("unmap", engine, h, self.va_offset(h), self.chunk_bytes))
        return ops

    def reclaim(self, handles: list[int] | tuple[int, ...], to_engine: str) -> list[PageOp]:
        """Unmap the handles from whoever maps them, then map them into to_engine: the pages
        change owner, no data moves (Valve §5)."""
        ops = []
        for h in handles:
            holder = self.holder(h)
            if holder is not None and holder != to_engine:
                ops += self.release(holder, [h])
        return ops + self.grant(to_engine, [h for h in handles if self.holder(h) is None])

    def _check(self, handle: int) -> None:
        if not isinstance(handle, int) or not 0 <= handle < self.num_handles:
            raise PolicyInputError(f"no handle {handle!r} in a map of {self.num_handles}")


# --- the CUDA driver side ----------------------------------------------------------------------


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise SharedMemoryError("CUDA virtual memory needs cuda-python (cuda.bindings)") from exc
    return driver


def _ok(result: Any, what: str) -> Any:
    """A cuda.bindings result tuple: (err,) or (err, value) or (err, v1, v2...)."""
    err = result[0]
    if int(err) != 0:
        raise SharedMemoryError(f"{what} failed: {getattr(err, 'name', err)}")
    rest = result[1:]
    return rest[0] if len(rest) == 1 else (rest or None)


def _prop(device_id: int):
    cu = _driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_id
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def granularity(device_id: int = 0) -> int:
    """The driver's minimum mapping granularity on the device (2 MiB on current GPUs)."""
    cu = _driver()
    _ok(cu.cuInit(0), "cuInit")
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(_ok(cu.cuMemGetAllocationGranularity(_prop(device_id), flag), "cuMemGetAllocationGranularity"))


class VmmPages:
    """One physical allocation per handle, exportable to other processes as file descriptors."""

    def __init__(self, page_map: PageMap, device_id: int = 0) -> None:
        cu = _driver()
        self.page_map = page_map
        self.device_id = device_id
        self._handles: list[Any] = []
        self.fds: list[int] = []
        prop = _prop(device_id)
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        try:
            for _ in range(page_map.num_handles):
                handle = _ok(cu.cuMemCreate(page_map.chunk_bytes, prop, 0), "cuMemCreate")
                self._handles.append(handle)
                self.fds.append(int(_ok(cu.cuMemExportToShareableHandle(handle, kind, 0),
                                        "cuMemExportToShareableHandle")))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the physical pages (the driver frees them once no process maps them)."""
        import os

        cu = _driver()
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
        for handle in self._handles:
            cu.cuMemRelease(handle)
        self._handles = []


class VmmSpace:
    """An engine's reserved range over the node's pages; maps and unmaps handles as told."""

    def __init__(self, page_map: PageMap, fds: list[int], device_id: int = 0) -> None:
        cu = _driver()
        self.page_map = page_map
        self.device_id = device_id
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        if len(fds) != page_map.num_handles:
            raise SharedMemoryError(f"{len(fds)} page descriptors for {page_map.num_handles} handles")
        self._handles = [_ok(cu.cuMemImportFromShareableHandle(fd, kind), "cuMemImportFromShareableHandle")
                         for fd in fds]
        self.base = _ok(cu.cuMemAddressReserve(page_map.reservation_bytes, 0, 0, 0), "cuMemAddressReserve")
        self._mapped: set[int] = set()

    def apply(self, ops: list[PageOp]) -> None:
        cu = _driver()
        for op in ops:
            ptr = cu.CUdeviceptr(int(self.base) + op.va_offset)
            if op.kind == "map":
                _ok(cu.cuMemMap(ptr, op.nbytes, 0, self._handles[op.handle], 0), "cuMemMap")
                access = cu.CUmemAccessDesc()
                access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                access.location.id = self.device_id
                access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                _ok(cu.cuMemSetAccess(ptr, op.nbytes, [access], 1), "cuMemSetAccess")
                self._mapped.add(op.handle)
            else:
                _ok(cu.cuMemUnmap(ptr, op.nbytes), "cuMemUnmap")
                self._mapped.discard(op.handle)
            self.page_map.ops_applied += 1

    def tensor(self, handle: int):
        """A mapped handle's bytes as a uint8 torch tensor (no copy)."""
        import torch

        if handle not in self._mapped:
            raise SharedMemoryError(f"handle {handle} is not mapped here")
        ptr = int(self.base) + self.page_map.va_offset(handle)

        class _Pages:
            __cuda_array_interface__ = {"shape": (self.page_map.chunk_bytes,), "typestr": "|u1",
                                        "data": (ptr, False), "version": 3}

        return torch.as_tensor(_Pages(), device=f"cuda:{self.device_id}")

    def close(self) -> None:
        cu = _driver()
        for h in sorted(self._mapped):
            ptr = cu.CUdeviceptr(int(self.base) + self.page_map.va_offset(h))
            cu.cuMemUnmap(ptr, self.page_map.chunk_bytes)
        self._mapped.clear()
        cu.cuMemAddressFree(self.base, self.page_map.reservation_bytes)
        for handle in self._handles:
            cu.cuMemRelease(handle)
        self._handles = []
