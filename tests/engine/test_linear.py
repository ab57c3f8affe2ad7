"""Weight matmuls: the oneDNN-packed layout computes what the plain layout does."""

import pytest
import torch

from backfill.engine.linear import Linear, onednn_packing_enabled

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not onednn_packing_enabled(CPU, torch.float32),
                                  reason="this PyTorch build has no oneDNN weight packing")


@needs_onednn
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("rows", [1, 3, 8, 32, 100])
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
