"""Device memory shared by name through CUDA IPC: names, errors, and (with a GPU) elastic tensors
in a neighbour's lent device memory."""

import pytest
import torch

from backfill.errors import SharedMemoryError
from backfill.memory.cuda_ipc import DeviceSegment, is_ipc_name, open_shared, share
from backfill.memory.elastic import ElasticStore, LocalLender, Location
from tests.conftest import TEST_DEVICE


def test_names_and_their_errors():
    assert is_ipc_name("cuda-ipc:abc") and not is_ipc_name("/dev/shm/backfill-lent-1")
    with pytest.raises(SharedMemoryError, match="shares device memory"):
        share(torch.zeros(4))
    with pytest.raises(SharedMemoryError, match="not a CUDA IPC name"):
        open_shared("/dev/shm/x")
    with pytest.raises(SharedMemoryError, match="cannot open the CUDA IPC memory"):
        open_shared("cuda-ipc:bm90IGEgcGlja2xl")
    with pytest.raises(SharedMemoryError, match="at least one byte"):
        DeviceSegment(0)


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="lent device memory needs a GPU (BACKFILL_TEST_DEVICE=cuda)")
def test_elastic_tensors_in_a_neighbours_device_memory_and_in_pinned_host_memory():
    """A producer process lends device memory (CUDA IPC); the consumer's elastic tensors go
    there with device copies, move to pinned host memory when it is reclaimed, and come back."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from backfill.memory.cuda_ipc import DeviceSegment\n"
            "seg = DeviceSegment(1 << 20)\n"
            "print(seg.path, flush=True)\n"
            "sys.stdin.read()\n")
    producer = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
    try:
        name = producer.stdout.readline().strip()

        class _Lent:
            path, nbytes = name, 1 << 20

        lender = LocalLender(_Lent())
        store = ElasticStore(device=torch.device("cuda"), lender=lender)
        data = torch.randn(64, 128, device="cuda")
        assert store.put("a", data) is Location.LENT and store.view("a").is_cuda
        assert torch.equal(store.read("a"), data)
        lender.reclaiming = True
        assert store.at_step_boundary() == 1 and store.location("a") is Location.HOST
        assert store.view("a").is_pinned() and torch.equal(store.read("a"), data)
        lender.reclaiming = False
        store.at_step_boundary()
        assert store.location("a") is Location.LENT and torch.equal(store.read("a"), data)
        store.free("a")
    finally:
        producer.stdin.close()
        producer.wait(timeout=60)
