"""Fused Triton kernels for a decode layer on a GPU, where PyTorch issues several launches.

In a decode step the matmuls read the weights; everything between them is a few kilobytes of
activations whose cost is the launches (even inside a CUDA graph each kernel has a few
microseconds of fixed cost, and a Llama layer's torch path has about thirty of them). Three kernels
take the work between the matmuls:

- `qkv_rope_write`: the fused q/k/v projection's output -> the family's q/k/v bias (Qwen2) or per-head
  q/k RMSNorm (Qwen3) -> RoPE on q and k -> k and v written to their KV pool slots; q returned.
  The torch path: bias add, view, norm, the rotation's cat/neg/mul/addcmul, two index_copy.
- `add_rms_norm_`: residual += delta, then RMSNorm of the new residual, in one pass.
- `silu_mul`: SwiGLU's silu(gate) * up from the fused gate/up output.

`decode_layer` runs one layer with them (the matmuls stay cuBLAS's), and `DecodeGraphs` captures it
when `cuda_kernels` is "triton" (engine/cuda_graphs.py). Every kernel computes in fp32 and rounds
where the torch path stores a tensor, so the two paths differ by rounding only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from backfill.engine.triton_attention import paged_decode_attention

if TYPE_CHECKING:
    from backfill.engine.kv_pool import KVBlockPool
    from backfill.engine.model import AttentionMetadata, LlamaModel


@triton.jit
def _qkv_rope_write(qkv_ptr, bias_ptr, norm_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr,
                    q_ptr, k_slots_ptr, v_slots_ptr, stride_qkv, stride_rope, stride_slot, eps,
                    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_P2: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads, then v heads, as the fused projection lays them out
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF_P2)
    ok = d < half
    src = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    x1 = tl.load(src + d, mask=ok, other=0.0)
    x2 = tl.load(src + half + d, mask=ok, other=0.0)
    if HAS_BIAS:  # Qwen2: rounded after the add, as the torch path stores qkv + bias
        x1 = x1 + tl.load(bias_ptr + head * HEAD_DIM + d, mask=ok, other=0.0)
        x2 = x2 + tl.load(bias_ptr + head * HEAD_DIM + half + d, mask=ok, other=0.0)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    slot = tl.load(slots_ptr + token)
    if head >= NUM_Q + NUM_KV:
        dst = v_slots_ptr + slot * stride_slot + (head - NUM_Q - NUM_KV) * HEAD_DIM
        tl.store(dst + d, x1.to(v_slots_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + half + d, x2.to(v_slots_ptr.dtype.element_ty), mask=ok)
    else:
        if HAS_NORM:  # Qwen3: RMSNorm over each q and k head, its own weight row per head
            inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
            w1 = tl.load(norm_ptr + head * HEAD_DIM + d, mask=ok, other=0.0).to(tl.float32)
            w2 = tl.load(norm_ptr + head * HEAD_DIM + half + d, mask=ok, other=0.0).to(tl.float32)
            x1 = x1 * inv * w1
            x2 = x2 * inv * w2
        # The model's cos/sin tables repeat their first half (cat(freqs, freqs)): one half is all we read.
        position = tl.load(positions_ptr + token)
        cos = tl.load(cos_ptr + position * stride_rope + d, mask=ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + position * stride_rope + d, mask=ok, other=0.0).to(tl.float32)
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        if head < NUM_Q:
            dst = q_ptr + (token * NUM_Q + head) * HEAD_DIM
            tl.store(dst + d, y1.to(q_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + half + d, y2.to(q_ptr.dtype.element_ty), mask=ok)
        else:
            dst = k_slots_ptr + slot * stride_slot + (head - NUM_Q) * HEAD_DIM
            tl.store(dst + d, y1.to(k_slots_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + half + d, y2.to(k_slots_ptr.dtype.element_ty), mask=ok)


def qkv_rope_write(qkv: torch.Tensor, bias: torch.Tensor | None, qk_norm: torch.Tensor | None, eps: float,
                   rope_cos: torch.Tensor, rope_sin: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                   k_slots: torch.Tensor, v_slots: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """qkv [T, (n_q + 2 n_kv) hd] -> q [T, n_q, hd] with bias / q-k norm and RoPE; k and v go to the
    pool's flat slots [slots, n_kv, hd] at slot_mapping [T]. rope_cos/sin: the model's [positions, hd] tables."""
    tokens = qkv.shape[0]
    hd = k_slots.shape[-1]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * hd or hd % 2:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_heads} + 2 x {num_kv_heads} heads of {hd}")
    if qkv.stride(1) != 1 or not (k_slots.is_contiguous() and v_slots.is_contiguous()):
        raise ValueError("qkv rows and the pool's slots must be contiguous")
    q = torch.empty(tokens, num_heads, hd, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    _qkv_rope_write[(tokens, num_heads + 2 * num_kv_heads)](
        qkv, qkv if bias is None else bias, qkv if qk_norm is None else qk_norm.contiguous(), rope_cos, rope_sin,
        positions, slot_mapping, q, k_slots, v_slots, qkv.stride(0), rope_cos.stride(0), k_slots.stride(0), eps,
        NUM_Q=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=hd, HALF_P2=triton.next_power_of_2(hd // 2),
        HAS_BIAS=bias is not None, HAS_NORM=qk_norm is not None)
    return q


@triton.jit
def _add_rms_norm(residual_ptr, delta_ptr, weight_ptr, out_ptr, stride_residual, stride_delta, stride_out, eps,
                  WIDTH: tl.constexpr, WIDTH_P2: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, WIDTH_P2)
    ok = c < WIDTH
    summed = (tl.load(residual_ptr + row * stride_residual + c, mask=ok, other=0.0).to(tl.float32)
              + tl.load(delta_ptr + row * stride_delta + c, mask=ok, other=0.0).to(tl.float32))
    stored = summed.to(residual_ptr.dtype.element_ty)
    tl.store(residual_ptr + row * stride_residual + c, stored, mask=ok)
    h = stored.to(tl.float32)  # normalize what was stored, as the torch path norms its rounded residual
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / WIDTH + eps)
    w = tl.load(weight_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + c, (h * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm_(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """residual += delta in place; returns RMSNorm(residual) * weight (into out where given)."""
    rows, width = residual.shape
    if delta.shape != residual.shape or weight.shape != (width,):
        raise ValueError(f"residual {tuple(residual.shape)}, delta {tuple(delta.shape)} and weight "
                         f"{tuple(weight.shape)} do not match")
    if residual.stride(1) != 1 or delta.stride(1) != 1:
        raise ValueError("residual and delta rows must be contiguous")
    out = torch.empty_like(residual) if out is None else out
    if rows:
        _add_rms_norm[(rows,)](residual, delta, weight, out, residual.stride(0), delta.stride(0), out.stride(0), eps,
                               WIDTH=width, WIDTH_P2=triton.next_power_of_2(width))
    return out


@triton.jit
def _silu_mul(gate_up_ptr, out_ptr, stride_in, stride_out, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < WIDTH
    gate = tl.load(gate_up_ptr + row * stride_in + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + WIDTH + c, mask=ok, other=0.0).to(tl.float32)
    # Rounded between silu and the product, as F.silu(gate).mul_(up) stores silu(gate) first.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + c, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 I] (gate, then up) -> silu(gate) * up [rows, I]."""
    rows, doubled = gate_up.shape
    if doubled % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate/up {tuple(gate_up.shape)} must have an even, contiguous last dimension")
    width = doubled // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _silu_mul[(rows, triton.cdiv(width, SILU_BLOCK))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                          WIDTH=width, BLOCK=SILU_BLOCK)
    return out


def decode_layer(model: LlamaModel, li: int, hidden: torch.Tensor, normed: torch.Tensor, meta: AttentionMetadata,
                 kv: KVBlockPool, next_norm: torch.Tensor) -> None:
    """One decode layer on fixed tensors: hidden [B, H] is the residual stream (updated in place) and
    normed [B, H] its RMSNorm for this layer's q/k/v (overwritten with next_norm's of the new residual,
    the next layer's input norm or the final norm). Every row is a decode token of its own sequence."""
    cfg, layer = model.config, model.layers[li]
    q = qkv_rope_write(layer["qkv"](normed), layer.get("qkv_bias"), layer.get("qk_norm"), cfg.rms_norm_eps,
                       model.rope_cos, model.rope_sin, meta.positions, meta.slot_mapping,
                       kv.k_slots[li], kv.v_slots[li], cfg.num_heads, cfg.num_kv_heads)
    attn = paged_decode_attention(q, kv.k[li], kv.v[li], meta.decode_block_tables, meta.decode_context_lens)
    x = add_rms_norm_(hidden, layer["o"](attn.view(hidden.shape[0], -1)), layer["mlp_norm"], cfg.rms_norm_eps)
    act = silu_mul(layer["gate_up"](x))
    add_rms_norm_(hidden, layer["down"](act), next_norm, cfg.rms_norm_eps, out=normed)
