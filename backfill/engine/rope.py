"""Rotary position embedding, shared by the eager model, compiled decode and finetuning's layers."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-rotation layout (HF Llama's); eager and compiled decode share it."""
    half = x.shape[-1] // 2
    rotated = torch.cat([x[..., half:].neg(), x[..., :half]], dim=-1)
    return torch.addcmul(x * cos, rotated, sin)
