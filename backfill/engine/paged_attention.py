"""Attention that reads the paged KV pool in place: small C++ kernels, built at first use (CPU).

The eager path gathers a sequence's blocks into a copy (index_select) and runs SDPA over it: per
layer that is two gathers, SDPA's setup and its thread launch, mostly fixed cost at short
contexts. The kernel (`csrc/paged_decode_attention.cpp`) walks the block table and keeps a running
softmax, reading each key and value once where it lies. In a batch nothing is padded, so each
sequence costs its own context. Its arithmetic runs on ATen's Vectorized<float> (AVX-512, AVX2 or
scalar, picked at build time like PyTorch's own kernels), and a batch with fewer (sequence, head)
pairs than threads has its contexts cut into stretches merged afterwards. Every decode attention
of the model goes through it when it is on: eager batches and compiled small decode batches alike
(docs/benchmarks.md has the A/B figures against gather + SDPA).

Sequences whose block tables start with the same blocks (prefix caching maps one cached prompt into
many tables) read those blocks once per step: the kernel groups them and scores each shared block
against every query row of the group, on AMX tiles where the CPU has them and the pool is bf16
(Intel Xeon since Sapphire Rapids), else on vectors, and merges that partial softmax with each
sequence's own blocks (cascade attention; docs/prefix-caching.md has the figures).

Prompt chunks have their own kernel (`csrc/paged_prompt_attention.cpp`): one call per layer takes
every chunk of a step, causal within the chunk, against the keys before it in the pool. Per chunk,
gather + SDPA cost a short prompt mostly fixed cost per layer (docs/peers.md has the figures).

The kernels are compiled with torch.utils.cpp_extension (a C++ compiler and ninja) on first use and
cached on disk, keyed by the CPU's flags because they are built for the host CPU. Where one cannot
be built, its loader returns None and callers stay on gather + SDPA.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Callable

import torch

from backfill.engine.native_build import build_cpu_extension, source_digest

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
PROMPT_SOURCE = Path(__file__).parent / "csrc" / "paged_prompt_attention.cpp"

# (q [B, n_q, hd], k_pool, v_pool, block tables [B, width], context lengths [B]) -> [B, n_q, hd]; keywords
# min_shared_blocks (fewest shared leading blocks read once per group; 0: every table alone), tiles,
# and k_new, v_new [B, n_kv, hd] with slots [B]: the step's keys and values, written to their slots first.
PagedDecodeAttention = Callable[..., torch.Tensor]
# (q [N, n_q, hd], k_pool, v_pool, spans [S, 3], block tables [S, width], out [N, n_q, hd]) -> None
PagedPromptAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                                None]


@functools.lru_cache(maxsize=1)
def kernel_digest() -> str:
    return source_digest(SOURCE)


@functools.lru_cache(maxsize=1)
def prompt_kernel_digest() -> str:
    return source_digest(PROMPT_SOURCE)


@functools.lru_cache(maxsize=1)
def load_paged_decode_attention() -> PagedDecodeAttention | None:
    """The compiled kernel, or None (logged) where it cannot be built or loaded."""
    try:
        module = build_cpu_extension("backfill_paged_decode", SOURCE)
    except Exception as exc:  # no compiler, no ninja, a build error: all mean "stay eager"
        log.warning("paged decode attention kernel unavailable, decode attention stays eager: %s", exc)
        return None
    return module.paged_decode_attention


def shared_prefix_tiles_available() -> bool:
    """Whether shared prefixes of bf16 pools run on AMX tiles on this CPU (false where the kernel
    cannot be built, the build has no AMX, or the OS refuses the tile state)."""
    try:
        module = build_cpu_extension("backfill_paged_decode", SOURCE)
    except Exception:  # as load_paged_decode_attention: no kernel, no tiles
        return False
    return bool(module.tiles_available())


@functools.lru_cache(maxsize=1)
def load_paged_prompt_attention() -> PagedPromptAttention | None:
    """The compiled prompt kernel, or None (logged) where it cannot be built or loaded."""
    try:
        module = build_cpu_extension("backfill_paged_prompt", PROMPT_SOURCE)
    except Exception as exc:  # as for the decode kernel: prompt attention stays on SDPA
        log.warning("paged prompt attention kernel unavailable, prompt attention stays on SDPA: %s", exc)
        return None
    return module.paged_prompt_attention
