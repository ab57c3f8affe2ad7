"""Weight matmuls: the oneDNN-packed layout computes what the plain layout does."""

import pytest
import torch

from backfill.engine import linear as linear_module
from backfill.engine.linear import (MIN_PACKED_BF16_ROWS, Linear, cpu_has_bf16_matmul, matmul_kernel_for,
                                    onednn_packing_enabled, packed_matmul_rows)

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not onednn_packing_enabled(CPU, torch.float32),
                                  reason="this PyTorch build has no oneDNN weight packing")


@needs_onednn
@pytest.mark.parametrize("dtype,tol", [
    (torch.float32, 1e-4),
    pytest.param(torch.bfloat16, 5e-2, marks=pytest.mark.skipif(
        not cpu_has_bf16_matmul(), reason="this CPU has no bf16 matmul kernels for oneDNN to pack for")),
])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 32, 100])
def test_packed_matches_plain_at_any_batch_size(dtype, tol, rows):
    torch.manual_seed(rows)
    weight = torch.randn(96, 64).to(dtype)
    x, residual = torch.randn(rows, 64).to(dtype), torch.randn(rows, 96).to(dtype)
    packed, plain = Linear(weight, packed=True), Linear(weight, packed=False)
    expected = (x.float() @ weight.float().t())
    torch.testing.assert_close(packed(x).float(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(plain(x).float(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(packed.add_to(residual, x).float(), residual.float() + expected, atol=tol, rtol=tol)
    torch.testing.assert_close(plain.add_to(residual, x).float(), residual.float() + expected, atol=tol, rtol=tol)


def test_shape_and_parameter_count_survive_packing():
    weight = torch.randn(96, 64)
    for packed in (False, True) if onednn_packing_enabled(CPU, torch.float32) else (False,):
        lin = Linear(weight, packed)
        assert (lin.out_features, lin.in_features, lin.numel()) == (96, 64, 96 * 64)
        assert lin(torch.randn(5, 64)).shape == (5, 96)


def test_packing_is_chosen_per_device_dtype_and_environment(monkeypatch):
    monkeypatch.delenv("BACKFILL_CPU_MATMUL", raising=False)
    assert not onednn_packing_enabled(torch.device("cuda"), torch.float32)
    assert not onednn_packing_enabled(CPU, torch.float16)
    monkeypatch.setenv("BACKFILL_CPU_MATMUL", "blas")
    assert not onednn_packing_enabled(CPU, torch.float32)


def test_bf16_packing_needs_bf16_kernels(monkeypatch):
    monkeypatch.delenv("BACKFILL_CPU_MATMUL", raising=False)
    monkeypatch.setattr(linear_module, "cpu_has_bf16_matmul", lambda: False)
    assert not onednn_packing_enabled(CPU, torch.bfloat16)


def test_bf16_without_bf16_kernels_multiplies_in_fp32(monkeypatch):
    """An AVX2-only CPU runs a bf16 model's matmuls in fp32 (no 8-50x bf16 fallback); a Linear given
    bf16 rows still answers in bf16."""
    monkeypatch.setattr(linear_module, "cpu_has_bf16_matmul", lambda: False)
    kernel = matmul_kernel_for(CPU, torch.bfloat16)
    assert kernel.compute_dtype == torch.float32
    assert matmul_kernel_for(CPU, torch.float32).compute_dtype == torch.float32
    torch.manual_seed(0)
    weight = torch.randn(96, 64).to(torch.bfloat16)
    x, residual = torch.randn(7, 64).to(torch.bfloat16), torch.randn(7, 96).to(torch.bfloat16)
    lin = Linear(weight, kernel.packed, kernel.compute_dtype)
    assert lin.nbytes == 96 * 64 * 4
    expected = x.float() @ weight.float().t()
    assert lin(x).dtype == torch.bfloat16 and lin.add_to(residual, x).dtype == torch.bfloat16
    torch.testing.assert_close(lin(x).float(), expected, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(lin.add_to(residual, x).float(), residual.float() + expected, atol=5e-2, rtol=5e-2)


def test_bf16_keeps_bf16_matmuls_where_the_cpu_has_them(monkeypatch):
    monkeypatch.setattr(linear_module, "cpu_has_bf16_matmul", lambda: True)
    assert matmul_kernel_for(CPU, torch.bfloat16).compute_dtype == torch.bfloat16
    assert matmul_kernel_for(torch.device("cuda"), torch.bfloat16) == linear_module.MatmulKernel(False, torch.bfloat16)


def test_small_bf16_batches_run_padded_and_give_the_unpadded_rows():
    """One or two rows of a packed bf16 matmul run as three (oneDNN streams those faster); the
    result is the first rows, equal to each row's own product."""
    assert packed_matmul_rows(1, True, torch.bfloat16) == MIN_PACKED_BF16_ROWS == 3
    assert packed_matmul_rows(2, True, torch.bfloat16) == 3 and packed_matmul_rows(5, True, torch.bfloat16) == 5
    assert packed_matmul_rows(1, True, torch.float32) == 1 and packed_matmul_rows(1, False, torch.bfloat16) == 1
    if not (onednn_packing_enabled(CPU, torch.bfloat16)):
        pytest.skip("this CPU has no bf16 matmul kernels for oneDNN to pack for")
    torch.manual_seed(0)
    weight, x, residual = (torch.randn(*shape).to(torch.bfloat16) for shape in ((96, 64), (2, 64), (2, 96)))
    lin = Linear(weight, packed=True)
    assert lin.min_rows == 3
    out = lin(x)
    assert out.shape == (2, 96) and out.is_contiguous()
    full = lin(torch.cat([x, torch.zeros(1, 64, dtype=torch.bfloat16)]))
    assert torch.equal(out, full[:2])
    assert torch.equal(lin.add_to(residual, x), residual + full[:2])


def test_the_runner_says_at_which_batch_a_decode_runs():
    """HARLI's stage 1 is evaluated at this batch (policy/harli.py): the padded rows on CPU."""
    from backfill.engine.config import ModelConfig
    from backfill.engine.kv_pool import KVBlockPool
    from backfill.engine.model import LlamaModel
    from backfill.engine.runner import ModelRunner
    from backfill.engine.weights import random_model

    config = ModelConfig.tiny()
    for dtype in (torch.float32, torch.bfloat16):
        model = LlamaModel(config, random_model(config, 0), dtype=dtype)
        runner = ModelRunner(model, KVBlockPool.for_memory(config, 2**20, 16, model.dtype, "cpu"))
        kernel = matmul_kernel_for(CPU, dtype)
        want = (3,) if kernel.packed and kernel.compute_dtype == torch.bfloat16 else ()
        assert runner.decode_run_batches == model.decode_run_batches == want
