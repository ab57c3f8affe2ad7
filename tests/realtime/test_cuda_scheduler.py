"""REEF's CUDA form: what the CPU can check (the models moved whole, the refusals) and, with
BACKFILL_TEST_DEVICE=cuda, DISB A on the device with the same harness as on the CPU."""

from __future__ import annotations

import pytest
import torch

from backfill.errors import RealtimeError
from backfill.bench.realtime_bench import run_disb
from backfill.realtime.config import TINY_SCALES
from backfill.realtime.models import build_model
from tests.conftest import TEST_DEVICE


@pytest.mark.parametrize("name", ["resnet152", "vgg19", "bert", "gpt2"])
def test_a_model_moves_to_a_device_whole(name):
    model = build_model(name, TINY_SCALES[name])
    # On the meta device every op fails if a single weight stayed behind on the CPU.
    moved = model.on_device("meta")
    out = moved.infer(moved.example_input)
    assert out.device.type == "meta" and tuple(out.shape) == tuple(model.infer(model.example_input).shape)
    assert [op.name for op in moved.ops] == [op.name for op in model.ops] and moved.buffers == model.buffers
    same = model.on_device("cpu")  # rebuilt closures compute what the originals do
    torch.testing.assert_close(same.infer(same.example_input), model.infer(model.example_input), rtol=0, atol=0)


def test_cuda_modes_are_checked_before_anything_loads():
    with pytest.raises(RealtimeError, match="no CUDA form"):
        run_disb(["A"], ["reef-pad"], 1.0, 1, scales=TINY_SCALES, device="cuda")


@pytest.mark.skipif(TEST_DEVICE == "cuda", reason="this machine has CUDA")
def test_cuda_without_a_device_is_a_clear_error():
    with pytest.raises(RealtimeError, match="CUDA is not available"):
        run_disb(["A"], ["reef"], 1.0, 1, scales=TINY_SCALES, device="cuda")


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="needs a CUDA device (BACKFILL_TEST_DEVICE=cuda)")
def test_disb_a_runs_on_the_device(tmp_path):
    report = run_disb(["A"], ["rt-only", "reef", "seq"], 3.0, 1, scales=TINY_SCALES, metadata_dir=tmp_path,
                      device="cuda", log=lambda *_: None)
    rows = report["workloads"]["A"]["modes"]
    assert report["device"] == "cuda"
    for mode in ("rt-only", "reef", "seq"):
        assert rows[mode]["rt_requests"] > 0 and rows[mode]["rt_p99_norm"] > 0
    assert rows["reef"]["throughput_norm"] > 0 and rows["rt-only"]["throughput_norm"] > 0
