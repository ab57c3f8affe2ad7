import pytest
import torch

from backfill.bench.realtime_bench import TINY_SCALES
from backfill.realtime.idempotence import analyze
from backfill.realtime.models import build_model
from backfill.realtime.task_scheduler import profile

SHAPES = ("resnet152", "vgg19", "bert", "gpt2")


@pytest.fixture(scope="session")
def tiny_models():
    """The four model shapes at test widths, analysed and profiled once per session."""
    torch.set_num_threads(1)
    out = {}
    for name in SHAPES:
        model = build_model(name, TINY_SCALES[name])
        out[name] = profile(model, analyze(model), runs=1)
    return out
