"""Decode attention that reads the paged KV pool in place on a GPU: a Triton kernel.

The torch path gathers every sequence's blocks into a padded copy and runs SDPA over it with a
mask: per layer two gathers of the whole padded context, the mask and SDPA's own launches. This
kernel walks each sequence's block table and reads every key and value row once where it lies in
the pool (`KVBlockPool.k[layer]`: [num_blocks, block_size, kv_heads, head_dim]), as the CPU kernel
(engine/paged_attention.py) does.

One program is one (sequence, KV head, stretch of the context). It serves all the query heads that
share the KV head (GQA), so each key is read once per group, not once per query head, and keeps a
running softmax over its stretch (FlashAttention's online softmax). A batch of a few sequences has
too few (sequence, head) pairs to fill the device, so long contexts are cut into stretches whose
partial softmaxes a second kernel merges (flash-decoding). The number of stretches depends only on
the shapes (batch, heads, block-table width), never on the context lengths' values, so the call
never reads the device and replays inside a CUDA graph.

Same signature as the CPU kernel: q [B, n_q, hd], k/v pool [num_blocks, block_size, n_kv, hd],
block_tables [B, max_blocks] (int64), context_lens [B] (int64, >= 1) -> [B, n_q, hd] in q's dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# A loop step's [group, tokens, head_dim] product is held in registers: about this many fp32 values
# (64 per thread of 4 warps) keeps it out of local memory; a step is 16 to 64 tokens.
STEP_VALUES = 8192
# A stretch is never shorter than this: below it the merge costs more than the extra programs win.
MIN_SPLIT_TOKENS = 256
# Programs to aim for when cutting contexts: a few per SM keeps an H100/H200 (132 SMs) busy.
PROGRAMS_PER_SM = 4


def split_count(batch: int, kv_heads: int, table_tokens: int, target_programs: int) -> int:
    """How many stretches to cut each context into: enough programs to fill the device, none
    shorter than MIN_SPLIT_TOKENS. Depends on shapes only (see the module docstring)."""
    if batch < 1 or kv_heads < 1 or table_tokens < 1:
        raise ValueError(f"need a non-empty batch, heads and context, got {batch}, {kv_heads}, {table_tokens}")
    wanted = -(-target_programs // (batch * kv_heads))
    return max(1, min(wanted, -(-table_tokens // MIN_SPLIT_TOKENS)))


def tokens_per_step(group: int, head_dim: int) -> int:
    """Tokens one program reads per loop step: as many as STEP_VALUES allows, a power of two in [16, 64]."""
    fit = STEP_VALUES // (triton.next_power_of_2(group) * triton.next_power_of_2(head_dim))
    return max(16, min(64, 1 << max(0, fit.bit_length() - 1)))


def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # Triton's interpreter on CPU: one stretch unless a test asks for more


@triton.jit
def _decode_stretch(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                    stride_q_seq, stride_q_head, stride_k_block, stride_k_token, stride_k_head,
                    stride_table, num_heads, scale_log2, split_tokens, num_splits,
                    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, STEP: tl.constexpr, SPLIT: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    stretch = tl.program_id(2)
    context = tl.load(lens_ptr + seq)
    first = stretch * split_tokens
    last = tl.minimum(first + split_tokens, context)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, DIM_P2)
    t = tl.arange(0, STEP)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    running_max = tl.full([GROUP_P2], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, DIM_P2], tl.float32)
    for start in range(first, last, STEP):
        token = start + t
        t_ok = token < last
        block = tl.load(tables_ptr + seq * stride_table + token // BLOCK_SIZE, mask=t_ok, other=0)
        row = block * stride_k_block + (token % BLOCK_SIZE) * stride_k_token + kv_head * stride_k_head
        rows_ok = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=rows_ok, other=0.0).to(tl.float32)
        # [GROUP, STEP] scores in log2 units; a broadcast product, not tl.dot: a group is 1-8 rows.
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale_log2
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # finite: token `start` is valid
        rescale = tl.exp2(running_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(p, axis=1)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=rows_ok, other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    out_mask = g_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # A stretch past the context saw no keys: its log-sum-exp is -inf and the merge weighs it 0.
        part = (seq * num_heads + heads) * num_splits + stretch
        lse = running_max + tl.log2(tl.where(running_sum > 0, running_sum, 1.0))
        tl.store(part_lse_ptr + part, lse, mask=g_ok)
        tl.store(part_out_ptr + part[:, None] * DIM_P2 + d[None, :], out, mask=out_mask)
    else:
        tl.store(out_ptr + (seq * num_heads + heads)[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_stretches(part_out_ptr, part_lse_ptr, out_ptr, num_heads, num_splits,
                     HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, SPLITS_P2: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, DIM_P2)
    s_ok = s < num_splits
    base = (seq * num_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + base + s, mask=s_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # stretch 0 holds token 0, so the max is finite
    parts = tl.load(part_out_ptr + (base + s)[:, None] * DIM_P2 + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + (seq * num_heads + head) * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, num_splits: int | None = None) -> torch.Tensor:
    """One query token per sequence against its paged context; see the module docstring for shapes.

    num_splits: stretches per context (None: split_count for this device)."""
    batch, n_q, hd = q.shape
    num_blocks, block_size, n_kv, k_hd = k_pool.shape
    if k_hd != hd or v_pool.shape != k_pool.shape or n_q % n_kv:
        raise ValueError(f"q {tuple(q.shape)} does not fit the pool {tuple(k_pool.shape)} / {tuple(v_pool.shape)}")
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"block tables {tuple(block_tables.shape)} / context lengths {tuple(context_lens.shape)} "
                         f"do not match a batch of {batch}")
    if k_pool.stride(-1) != 1 or k_pool.stride() != v_pool.stride() or block_tables.stride(-1) != 1:
        raise ValueError("the pool's rows and the block tables must be contiguous in their last dimension")
    q = q.contiguous()
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = n_q // n_kv
    table_tokens = block_tables.shape[1] * block_size
    splits = num_splits or split_count(batch, n_kv, table_tokens, _target_programs(q.device))
    split_tokens = -(-table_tokens // splits)
    step = tokens_per_step(group, hd)
    split_tokens = -(-split_tokens // step) * step
    splits = -(-table_tokens // split_tokens)  # no stretch starts past the table
    dim_p2 = triton.next_power_of_2(hd)
    if splits > 1:
        part_out = torch.empty(batch, n_q, splits, dim_p2, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, n_q, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_stretch[(batch, n_kv, splits)](
        q, k_pool, v_pool, block_tables, context_lens, out, part_out, part_lse,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        block_tables.stride(0), n_q, math.log2(math.e) / math.sqrt(hd), split_tokens, splits,
        GROUP=group, GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=hd, DIM_P2=dim_p2,
        BLOCK_SIZE=block_size, STEP=step, SPLIT=splits > 1)
    if splits > 1:
        _merge_stretches[(batch, n_q)](part_out, part_lse, out, n_q, splits, HEAD_DIM=hd, DIM_P2=dim_p2,
                                       SPLITS_P2=triton.next_power_of_2(splits))
    return out
