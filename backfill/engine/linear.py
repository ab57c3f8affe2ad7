"""Weight matmuls in the layout the device's fastest kernel wants, chosen once at load.

On x86 CPUs PyTorch sends a plain fp32 `mm` to MKL, which takes its AVX-512 kernels only on
Intel CPUs: on AMD EPYC a decode step's fp32 GEMMs run several times slower than the same
product through oneDNN with the weight reordered once into oneDNN's blocked layout
(docs/benchmarks.md). oneDNN picks its
kernels from the CPU's instruction set, not its vendor. The packed weight is opaque (only
oneDNN can read it), so the embedding table keeps its own plain copy.

Elsewhere (CUDA, CPUs without oneDNN, dtypes oneDNN does not pack) the weight is stored
transposed, [in, out]: `x @ W` beats `F.linear`'s `x @ W.T` for decode-sized batches on CPU BLAS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN's bf16 brgemm (AVX-512) streams a packed weight more slowly for one or two rows than for
# three to six (docs/finetune.md): a decode step of one or two
# sequences multiplies its rows padded to three, so every batch of one to six runs one kernel regime.
MIN_PACKED_BF16_ROWS = 3


def packed_matmul_rows(rows: int, packed: bool, compute_dtype: torch.dtype) -> int:
    """The rows a weight matmul of `rows` input rows runs at (padded where that is faster)."""
    if packed and compute_dtype == torch.bfloat16:
        return max(rows, MIN_PACKED_BF16_ROWS)
    return rows


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU has native bf16 GEMM kernels (AVX-512 BF16 / AMX / AVX-NE-CONVERT via oneDNN).

    Without them (e.g. an AVX2-only CPU) PyTorch's bf16 matmuls fall back to a scalar-ish path,
    many times slower than fp32 for the same shapes (docs/benchmarks.md).
    """
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return torch.backends.mkldnn.is_available() and probe is not None and bool(probe())


def onednn_packing_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing is used on CPUs that have it, unless BACKFILL_CPU_MATMUL=blas asks for MKL/BLAS."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES:
        return False
    if os.environ.get("BACKFILL_CPU_MATMUL", "onednn").lower() == "blas":
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    # oneDNN reorders bf16 weights only where the CPU converts bf16 natively; elsewhere it raises.
    return dtype != torch.bfloat16 or cpu_has_bf16_matmul()


@dataclass(frozen=True)
class MatmulKernel:
    """How a model's weight matmuls run: packed for oneDNN or plain, and in which dtype."""

    packed: bool
    compute_dtype: torch.dtype
    upcast_from: torch.dtype | None = None  # the model's dtype, where the matmuls cannot run in it

    @property
    def upcast(self) -> bool:
        return self.upcast_from is not None

    @property
    def name(self) -> str:
        kernel = "onednn-packed" if self.packed else "torch.mm"
        return kernel + (f" in {str(self.compute_dtype).removeprefix('torch.')}" if self.upcast else "")

    @property
    def slug(self) -> str:
        """The kernel in a file name (latency profiles depend on it)."""
        return ("onednn" if self.packed else "mm") + ("-fp32" if self.upcast else "")


def matmul_kernel_for(device: torch.device, dtype: torch.dtype) -> MatmulKernel:
    compute_dtype = dtype
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_bf16_matmul():
        # No bf16 GEMM on this CPU: the model keeps its weights' bf16 values but computes in fp32
        # (activations and KV cache too, engine/model.py), far faster than PyTorch's bf16 fallback;
        # the compiled steps' small-batch kernel still reads the bf16 weights at two bytes.
        compute_dtype = torch.float32
    return MatmulKernel(onednn_packing_enabled(device, compute_dtype), compute_dtype,
                        dtype if compute_dtype != dtype else None)


class Linear:
    """y = x @ W.T (+ residual) for a weight given as [out, in], like nn.Linear's."""

    __slots__ = ("weight", "packed", "compute_dtype", "out_features", "in_features", "min_rows")

    def __init__(self, weight: torch.Tensor, packed: bool, compute_dtype: torch.dtype | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = packed
        self.compute_dtype = compute_dtype or weight.dtype
        self.min_rows = packed_matmul_rows(1, packed, self.compute_dtype)
        weight = weight.to(self.compute_dtype)
        if packed:
            # The batch size only hints oneDNN's choice of block layout; any batch runs on it.
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)
        else:
            self.weight = weight.t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.compute_dtype:
            return self(x.to(self.compute_dtype)).to(x.dtype)
        if self.packed:
            rows = x.shape[0]
            if rows < self.min_rows and x.dim() == 2:  # a view of the first rows of the padded product
                x = torch.nn.functional.pad(x, (0, 0, 0, self.min_rows - rows))
                return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")[:rows]
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return torch.mm(x, self.weight)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ W.T, with the add fused into the matmul's epilogue."""
        if x.dtype != self.compute_dtype:
            return self.add_to(residual.to(self.compute_dtype), x.to(self.compute_dtype)).to(x.dtype)
        if self.packed:
            if x.shape[0] < self.min_rows and x.dim() == 2:
                return residual + self(x)
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, None, "add")
        return torch.addmm(residual, x, self.weight)

    def numel(self) -> int:
        return self.out_features * self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads from this weight (in its compute dtype)."""
        return self.numel() * self.compute_dtype.itemsize
