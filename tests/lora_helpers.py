"""Real PEFT LoRA adapters for tests: made with peft on an HF copy of a backfill model's weights."""

from __future__ import annotations

from pathlib import Path

import torch

from backfill.engine.config import ModelConfig

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_llama(cfg: ModelConfig, weights: dict[str, torch.Tensor] | None = None, seed: int = 1):
    """transformers' Llama with cfg's shape: the given weights (HF names), else random ones from seed."""
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    if weights is not None:
        model.load_state_dict(weights, strict=False)
        model.tie_weights()
    return model


def make_peft_adapter(base, out_dir: Path, rank: int, alpha: float, targets: list[str], seed: int,
                      std: float = 0.3, **extra):
    """A real PEFT adapter with random non-zero A and B (PEFT starts B at zero), saved to out_dir."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none",
                             task_type="CAUSAL_LM", **extra)
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out_dir)
    return model.eval()
