"""x @ W.T for one to eight rows at the speed of a streaming read (CPU: AVX-512 BF16 or AVX2; bf16 or fp32).

Decode steps of a few sequences are weight reads. Inductor's dot products (engine/compiled_decode.py)
read the weights at streaming speed for one sequence, but from four sequences they turn
compute-bound, because each ends in a sum across lanes. The kernel in `csrc/small_batch_matmul.cpp`
multiplies against a weight packed once at load into the pair layout of the VDPBF16PS instruction.
It keeps every row's accumulators in registers, so a weight byte is read once for all rows and no
sums across lanes are needed; that reads faster than oneDNN with pre-packed weights or F.linear at
one to eight rows. Above all it runs inside the compiled pieces, so a decode step of up to eight sequences runs in
compiled code (docs/benchmarks.md).
fp32 weights take the same layout, one input feature at a time, with fused multiply-adds.
More rows than one pass serves take them a chunk at a time against a tile of the weight held in
cache, so the weight is still read from memory once; there the kernel is compute-bound, at about
oneDNN's rate, and serves the padded decode buckets of compiled_decode.py.

The instruction set follows the CPU (and ATEN_CPU_CAPABILITY, which holds it lower): AVX-512 BF16
where present, else AVX2 with FMA, where a pass serves four rows (half the registers) and bf16
weights are widened to fp32 in registers, so they still cross the memory bus at two bytes; from
three passes of rows up, each tile is widened once into an fp32 buffer the passes share, so those
run at fp32's rate. There the rows may be fp32: a bf16 model on a CPU without bf16 matmul kernels
computes in fp32 and reads its weights here at two bytes (docs/models.md has the figures).

On a CPU with AMX tiles (Intel Xeon from Sapphire Rapids) the same packed bf16 weight also
multiplies on them (`torch.ops.backfill.packed_matmul_tiles`): sixteen pair-steps of a column
block are one tile of the layout TDPBF16PS takes. From a handful of rows the vector kernel is
bound by its multiply-adds while the tiles still read the weight at the speed memory gives; the
kernel choice (engine/kernel_choice.py) times both, and oneDNN, on the machine.

It registers `torch.ops.backfill.packed_matmul` (and `packed_matmul_tiles`), operators that
inductor calls from the compiled decode pieces like any other. On a CPU with neither instruction set
`load_small_batch_matmul` returns False and callers keep their own matmuls.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from backfill.engine.native_build import build_cpu_extension, cpu_flags, isa_capped_below_avx512, source_digest

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "small_batch_matmul.cpp"
# Output features per packed column block (one AVX-512 register of fp32 lanes).
COLUMN_BLOCK = 16


@functools.lru_cache(maxsize=1)
def kernel_digest() -> str:
    return source_digest(SOURCE)


def cpu_has_avx512_bf16() -> bool:
    """AVX-512 BF16 in the CPU's flags, unless PyTorch is held below AVX-512 (ATEN_CPU_CAPABILITY)."""
    return {"avx512f", "avx512_bf16"} <= cpu_flags() and not isa_capped_below_avx512()


def kernel_isa() -> str | None:
    """The instruction set the kernel is built for here: "avx512-bf16", "avx2", or None (neither)."""
    if cpu_has_avx512_bf16():
        return "avx512-bf16"
    if {"avx2", "fma"} <= cpu_flags():
        return "avx2"
    return None


@functools.lru_cache(maxsize=1)
def load_small_batch_matmul() -> bool:
    """Build and register the operator; False (logged) where this CPU or machine cannot."""
    if kernel_isa() is None:
        return False
    try:
        build_cpu_extension("backfill_small_batch_matmul", SOURCE, python_module=False)
    except Exception as exc:  # no compiler, no ninja, a build error: all mean "keep the other matmuls"
        log.warning("small-batch matmul kernel unavailable: %s", exc)
        return False
    torch.library.register_fake("backfill::packed_matmul")(_output_like)
    torch.library.register_fake("backfill::packed_matmul_tiles")(_output_like)
    return True


def cpu_has_amx_tiles() -> bool:
    """AMX tiles with bf16 products in the CPU's flags, and the kernel built for AVX-512 BF16."""
    return {"amx_tile", "amx_bf16"} <= cpu_flags() and kernel_isa() == "avx512-bf16"


@functools.lru_cache(maxsize=1)
def load_tiles_matmul() -> bool:
    """Whether packed_matmul_tiles runs here: an AMX CPU, the kernel built, and the OS granting this
    process the tile state (a probe product checked against the vector kernel's)."""
    if not (cpu_has_amx_tiles() and load_small_batch_matmul()):
        return False
    weight = torch.randn(40, TILE_INPUTS, dtype=torch.bfloat16)
    x = torch.randn(3, TILE_INPUTS, dtype=torch.bfloat16)
    packed = pack_for_small_batches(weight)
    try:
        product = torch.ops.backfill.packed_matmul_tiles(packed, x, 40)
    except RuntimeError as exc:  # built without tiles (a cached build), or no permission for them
        log.warning("AMX tile matmul unavailable: %s", exc)
        return False
    if not torch.allclose(product, packed_matmul(packed, x, 40), atol=1e-3, rtol=1e-3):
        log.warning("AMX tile matmul disagrees with the vector kernel; not used")
        return False
    return True


def _output_like(packed_weight: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """The operator's output for tracing: [rows, out_features] fp32."""
    return x.new_empty((x.shape[0], out_features), dtype=torch.float32)


# Input features one multiply-add instruction takes per output lane.
FEATURES_PER_STEP = {torch.bfloat16: 2, torch.float32: 1}


def can_pack(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight: bf16 (with an even `in`) or fp32, [out, in], on CPU."""
    step = FEATURES_PER_STEP.get(weight.dtype)
    return step is not None and weight.device.type == "cpu" and weight.dim() == 2 and weight.shape[1] % step == 0


def pack_for_small_batches(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in * 16]: each block of 16 output features stores, step by
    step along the input, that step's input features of each output in turn (for bf16 a pair, the
    layout VDPBF16PS multiplies; for fp32 one). Output features past `out` are zero and never
    written back."""
    if not can_pack(weight):
        raise ValueError(f"cannot pack a {weight.dtype} weight of shape {tuple(weight.shape)} on {weight.device}")
    out_features, in_features = weight.shape
    step = FEATURES_PER_STEP[weight.dtype]
    blocks = -(-out_features // COLUMN_BLOCK)
    padded = weight.new_zeros(blocks * COLUMN_BLOCK, in_features)
    padded[:out_features] = weight
    steps = padded.view(blocks, COLUMN_BLOCK, in_features // step, step).permute(0, 2, 1, 3)
    return steps.contiguous().view(blocks, in_features * COLUMN_BLOCK)


# Input features one tile of x holds (32 bf16): packed_matmul_tiles takes weights whose `in` is a multiple.
TILE_INPUTS = 32


def tiles_take(dtype: torch.dtype, in_features: int) -> bool:
    """Whether packed_matmul_tiles takes a weight of this dtype and input width: bf16, whole tiles of inputs."""
    return dtype == torch.bfloat16 and in_features % TILE_INPUTS == 0


def can_tile(weight: torch.Tensor) -> bool:
    """Whether packed_matmul_tiles takes this (unpacked) weight: bf16, [out, in] with `in` a multiple of 32."""
    return weight.dim() == 2 and tiles_take(weight.dtype, weight.shape[1])


def packed_matmul_tiles(packed_weight: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """packed_matmul on AMX tiles (bf16 only; see load_tiles_matmul): fp32 [rows, out_features]."""
    return torch.ops.backfill.packed_matmul_tiles(packed_weight, x, out_features)


def packed_matmul(packed_weight: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [rows, in] @ W.T for a weight packed by pack_for_small_batches (same dtype): fp32 [rows, out_features]."""
    return torch.ops.backfill.packed_matmul(packed_weight, x, out_features)
