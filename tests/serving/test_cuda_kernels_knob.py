"""The cuda_kernels knob: declared once in ServingConfig, read by the server's flags and config file,
CUDA only, and taken as a list by `bench engine`, which measures each value in turn."""

import argparse

import pytest

from backfill.cli import build_parser
from backfill.errors import InvalidRequestError
from backfill.server.config import add_serve_arguments, config_from_args
from backfill.serving.build import build_runner
from backfill.serving.config import ServingConfig
from backfill.engine.config import ModelConfig
from backfill.engine.weights import random_model


def _serve(*argv: str):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return config_from_args(parser.parse_args(list(argv))).serving


def test_triton_by_default_torch_on_request_and_a_typed_error_otherwise(tmp_path):
    assert _serve().cuda_kernels == "triton"
    assert _serve("--cuda-kernels", "torch").cuda_kernels == "torch"
    toml = tmp_path / "c.toml"
    toml.write_text('cuda-kernels = "cutlass"\n')
    with pytest.raises(InvalidRequestError, match="cuda_kernels must be one of torch, triton"):
        _serve("--config", str(toml))


def test_triton_kernels_are_a_cuda_mechanism():
    cfg = ServingConfig(device="cpu", cuda_kernels="triton")
    assert not cfg.uses_triton_kernels
    runner = build_runner(ModelConfig.tiny(), random_model(ModelConfig.tiny()), cfg)
    assert runner.model.cuda_kernels == "torch" and runner.device_sampler is None
    assert ServingConfig(device="cuda", cuda_kernels="triton").uses_triton_kernels


def test_bench_engine_takes_several_kernel_sets():
    parser = build_parser()
    args = parser.parse_args(["bench", "engine", "--cuda-kernels", "torch", "triton"])
    assert args.cuda_kernels_compared == ["torch", "triton"] and not hasattr(args, "cuda_kernels")
    assert parser.parse_args(["bench", "engine"]).cuda_kernels_compared == ["triton"]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "engine", "--cuda-kernels", "cutlass"])
