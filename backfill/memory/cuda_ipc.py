"""Device memory shared between processes by name, through CUDA IPC (torch's CUDA tensor sharing:
torch.multiprocessing.reductions.reduce_tensor in the owner, rebuild_cuda_tensor in the others).

A name is a string, `cuda-ipc:` and the base64 of the pickled rebuild call, so it travels wherever
a /dev/shm path does (the offload coordinator's offers, an engine's spec, a JSON reply). The owner
keeps the allocation alive until every process that opened it is done (AQUA §6: a producer lends
memory it keeps owning; Valve §5: the node's KV pool outlives its engines).
"""

from __future__ import annotations

import base64
import pickle

import torch

from backfill.errors import SharedMemoryError

PREFIX = "cuda-ipc:"


def is_ipc_name(name: str) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def share(tensor: torch.Tensor) -> str:
    """A name other processes open to reach this CUDA tensor's memory (no copy)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda:
        raise SharedMemoryError(f"CUDA IPC shares device memory, got a tensor on {tensor.device}")
    try:
        rebuild, args = reduce_tensor(tensor)
    except (RuntimeError, AssertionError) as exc:
        raise SharedMemoryError(f"cannot share {tensor.numel()} elements of {tensor.device} memory: {exc}") from exc
    return PREFIX + base64.b64encode(pickle.dumps((rebuild, args))).decode()


def open_shared(name: str) -> torch.Tensor:
    """The tensor another process shared under this name."""
    if not is_ipc_name(name):
        raise SharedMemoryError(f"not a CUDA IPC name: {name[:40]!r}")
    try:
        # Names come from this node's own processes (runtime socket, coordinator): trusted, same user.
        rebuild, args = pickle.loads(base64.b64decode(name[len(PREFIX):]))
        torch.cuda.init()          # the handle opens in this process's CUDA context
        return rebuild(*args)
    except Exception as exc:  # noqa: BLE001 - whatever the driver or pickle says, one typed error here
        raise SharedMemoryError(f"cannot open the CUDA IPC memory: {exc}") from exc


class DeviceSegment:
    """Device memory a producer engine lends (AQUA §4): the device form of elastic.ShmSegment,
    with the same `path` (its IPC name), `nbytes`, `bytes` and `unlink()`."""

    def __init__(self, nbytes: int, device: str | torch.device = "cuda") -> None:
        if nbytes < 1:
            raise SharedMemoryError(f"a segment needs at least one byte, got {nbytes}")
        try:
            self.bytes = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        except RuntimeError as exc:
            raise SharedMemoryError(f"cannot allocate {nbytes} bytes on {device}: {exc}") from exc
        self.nbytes = nbytes
        self.path = share(self.bytes)

    def unlink(self) -> None:
        """Drop the owner's reference; the memory goes once the consumers have closed theirs."""
        self.bytes = None
        try:
            torch.cuda.ipc_collect()
        except RuntimeError:
            pass
