"""Decode attention that reads the paged KV pool in place: a small C++ kernel, built at first use (CPU).

The eager path gathers a sequence's blocks into a copy (index_select) and runs SDPA over it: per
layer that is two gathers, SDPA's setup and its thread launch, about 90 us at 160 tokens of
context on the 2-core EPYC, most of it fixed cost. The kernel
(`csrc/paged_decode_attention.cpp`) walks the block table and keeps a running softmax, reading
each key and value once where it lies: about 30 us. In a batch nothing is padded, so each
sequence costs its own context. Its arithmetic runs on ATen's Vectorized<float> (AVX-512, AVX2 or
scalar, picked at build time like PyTorch's own kernels), and a batch with fewer (sequence, head)
pairs than threads has its contexts cut into stretches merged afterwards. Every decode attention
of the model goes through it when it is on: eager batches and compiled small decode batches alike
(docs/benchmarks.md has the A/B figures against gather + SDPA).

The kernel is compiled with torch.utils.cpp_extension (a C++ compiler and ninja) on first use and
cached on disk, keyed by the CPU's flags because it is built for the host CPU. Where it cannot be
built, `load_paged_decode_attention` returns None and callers stay on the eager path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"

PagedDecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _cpu_key() -> str:
    """A short hash of the CPU's feature flags: a -march=native build only runs where they match."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = torch.backends.cpu.get_cpu_capability()
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


@functools.lru_cache(maxsize=1)
def kernel_digest() -> str:
    """A short hash of the kernel's source: step-time profiles measured with one version of the
    kernel do not describe another."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:8]


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the pip-installed one lives in the venv, which a
    `.venv/bin/python ...` run does not put on PATH."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _vector_capability_flags() -> list[str]:
    """The macros that pick ATen's Vectorized<float> width (as PyTorch's own kernels and inductor do):
    AVX-512 or AVX2 where this CPU and build have them, else the portable scalar version."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX512", "AVX2"):
        return ["-DCPU_CAPABILITY=DEFAULT"]
    return [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]


@functools.lru_cache(maxsize=1)
def load_paged_decode_attention() -> PagedDecodeAttention | None:
    """The compiled kernel, or None (logged) where it cannot be built or loaded."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    try:
        module = cpp_extension.load(name=f"backfill_paged_decode_{_cpu_key()}", sources=[str(SOURCE)],
                                    extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp",
                                                  *_vector_capability_flags()],
                                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: all mean "stay eager"
        log.warning("paged decode attention kernel unavailable, decode attention stays eager: %s", exc)
        return None
    return module.paged_decode_attention
