"""The training forward of the engine's LlamaModel with LoRA, one transformer layer at a time.

HARLI §6.1: the step is split into per-layer submodels; the forward keeps each layer's input
(detached), and the backward re-runs one layer with autograd and hands it the gradient of its
output explicitly (`torch.autograd.backward(out, grad)`), so the scheduler may stop between any
two layers. Activations live only for the layer in flight (recomputation), besides the
[layers + 1] saved hidden states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backfill.engine.model import LlamaModel
from backfill.engine.rope import apply_rope
from backfill.finetune.lora import TrainableLoraAdapter, frozen_matmul


def _project(x: torch.Tensor, linear, adapter: TrainableLoraAdapter, layer: int, targets: tuple[str, ...],
             sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """The fused frozen matmul (q|k|v or gate|up), split, with each targeted slice's LoRA delta added."""
    parts = list(frozen_matmul(x, linear).split(sizes, dim=-1))
    for i, target in enumerate(targets):
        if adapter.has(target):
            parts[i] = parts[i] + adapter.delta(layer, target, x)
    return parts


def layer_forward(model: LlamaModel, adapter: TrainableLoraAdapter, li: int, h: torch.Tensor) -> torch.Tensor:
    """One decoder layer on right-padded sequences h [B, L, hidden] -> [B, L, hidden] (causal)."""
    cfg, layer = model.config, model.layers[li]
    batch, length, hidden = h.shape
    n_q, n_kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos = model.rope_cos[:length].unsqueeze(1)
    sin = model.rope_sin[:length].unsqueeze(1)
    x = F.rms_norm(h, (hidden,), layer["attn_norm"], cfg.rms_norm_eps).reshape(batch * length, hidden)
    q, k, v = _project(x, layer["qkv"], adapter, li, ("q_proj", "k_proj", "v_proj"),
                       (n_q * hd, n_kv * hd, n_kv * hd))
    q = apply_rope(q.view(batch, length, n_q, hd), cos, sin).transpose(1, 2)
    k = apply_rope(k.view(batch, length, n_kv, hd), cos, sin).transpose(1, 2)
    v = v.view(batch, length, n_kv, hd).transpose(1, 2)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_q != n_kv)
    attn = attn.transpose(1, 2).reshape(batch * length, n_q * hd)
    o = frozen_matmul(attn, layer["o"])
    if adapter.has("o_proj"):
        o = o + adapter.delta(li, "o_proj", attn)
    h = h + o.view(batch, length, hidden)
    x = F.rms_norm(h, (hidden,), layer["mlp_norm"], cfg.rms_norm_eps).reshape(batch * length, hidden)
    gate, up = _project(x, layer["gate_up"], adapter, li, ("gate_proj", "up_proj"),
                        (cfg.intermediate_size, cfg.intermediate_size))
    act = F.silu(gate) * up
    down = frozen_matmul(act, layer["down"])
    if adapter.has("down_proj"):
        down = down + adapter.delta(li, "down_proj", act)
    return h + down.view(batch, length, hidden)


def embed(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    return model.embed[ids]


def head_loss_sum(model: LlamaModel, h: torch.Tensor, ids: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of the masked next-token targets (divide by the step's target count)."""
    cfg = model.config
    x = F.rms_norm(h[:, :-1], (cfg.hidden_size,), model.final_norm, cfg.rms_norm_eps)
    rows = x[target_mask]                      # only the positions with a target: [N, hidden]
    targets = ids[:, 1:][target_mask]
    if cfg.tie_word_embeddings:
        logits = rows @ model.embed.t()        # the plain embedding table: no copy, autograd-ready
    else:
        logits = torch.cat([frozen_matmul(rows, part) for part in model.lm_head_slices], dim=-1)
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def target_slices(target_mask: torch.Tensor, rows_per_slice: int) -> list[torch.Tensor]:
    """The mask split into the fewest masks of at most rows_per_slice targets each, of near-equal
    size, in order (HARLI §6.1: the head and loss in units of about one decode step; each slice
    reads the whole output embedding, so fewer, even slices); their head_loss_sum values add up
    to the whole."""
    flat = target_mask.flatten()
    positions = flat.nonzero().flatten()
    count = max(1, -(-len(positions) // rows_per_slice))
    out = []
    for chunk in (positions.tensor_split(count) if len(positions) else [positions]):
        part = torch.zeros_like(flat)
        part[chunk] = True
        out.append(part.view_as(target_mask))
    return out


def full_loss(model: LlamaModel, adapter: TrainableLoraAdapter, ids: torch.Tensor, target_mask: torch.Tensor,
              num_targets: int) -> torch.Tensor:
    """The same loss as one ordinary autograd graph (the reference the layer-wise backward must equal)."""
    h = embed(model, ids)
    for li in range(model.config.num_layers):
        h = layer_forward(model, adapter, li, h)
    return head_loss_sum(model, h, ids, target_mask) / num_targets
