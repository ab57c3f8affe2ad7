"""A model as loaded: its config, its weights under HF names, its tokenizer; and the check that the
weights are the ones the config expects (the loaders and the HF exporter share it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backfill.engine.config import ModelConfig
from backfill.errors import CorruptModelError

if TYPE_CHECKING:
    import torch

    from backfill.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    source: str


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama of this config has, under HF names, with its shape."""
    h, hd = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (config.num_heads * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (config.num_kv_heads * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (config.num_kv_heads * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.num_heads * hd)
        if config.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (config.num_heads * hd,)
            shapes[p + "self_attn.k_proj.bias"] = (config.num_kv_heads * hd,)
            shapes[p + "self_attn.v_proj.bias"] = (config.num_kv_heads * hd,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    return shapes


def validate_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    """CorruptModelError naming the first missing, unexpected or mis-shaped tensor."""
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CorruptModelError(f"{source}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise CorruptModelError(f"{source}: unexpected tensors {unexpected[:5]}"
                                f"{' ...' if len(unexpected) > 5 else ''}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise CorruptModelError(f"{source}: tensor {name} has shape {tuple(weights[name].shape)}, "
                                    f"expected {shape}")
