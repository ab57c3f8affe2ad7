"""Weight matmuls in the layout the device's fastest kernel wants, chosen once at load.

On x86 CPUs PyTorch sends a plain fp32 `mm` to MKL, which takes its AVX-512 kernels only on
Intel CPUs: on the AMD EPYC development machine a decode step's fp32 GEMMs ran 1.5-4.7x slower
than the same product through oneDNN with the weight reordered once into oneDNN's blocked
layout (scripts/matmul_bench.py; the bf16 LM head at batch 1 gained 7x). oneDNN picks its
kernels from the CPU's instruction set, not its vendor. The packed weight is opaque (only
oneDNN can read it), so the embedding table keeps its own plain copy.

Elsewhere (CUDA, CPUs without oneDNN, dtypes oneDNN does not pack) the weight is stored
transposed, [in, out]: `x @ W` beats `F.linear`'s `x @ W.T` for decode-sized batches on CPU BLAS.
"""

from __future__ import annotations

import os

import torch

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def onednn_packing_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing is used on CPUs that have it, unless BACKFILL_CPU_MATMUL=blas asks for MKL/BLAS."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES:
        return False
    if os.environ.get("BACKFILL_CPU_MATMUL", "onednn").lower() == "blas":
        return False
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class Linear:
    """y = x @ W.T (+ residual) for a weight given as [out, in], like nn.Linear's."""

    __slots__ = ("weight", "packed", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor, packed: bool) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = packed
        if packed:
            # The batch size only hints oneDNN's choice of block layout; any batch runs on it.
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)
        else:
            self.weight = weight.t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return torch.mm(x, self.weight)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ W.T, with the add fused into the matmul's epilogue."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, None, "add")
        return torch.addmm(residual, x, self.weight)

    def numel(self) -> int:
        return self.out_features * self.in_features
