"""Write a loaded model as an HF directory, so transformers and vLLM can serve the same weights.

The layout is that of the family's transformers class (LlamaForCausalLM, Qwen2ForCausalLM, ...): config.json, model.safetensors (fp32, HF names and HF Q/K
layout), tokenizer.json, tokenizer_config.json (with the chat template) and
generation_config.json. backfill also uses it as its own dequantized-GGUF cache.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from backfill.engine.loaded_model import LoadedModel, validate_weights


HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM"}


def hf_config_dict(loaded: LoadedModel) -> dict:
    c = loaded.config
    rope_scaling = None
    if c.rope_scaling is not None:
        rope_scaling = {"rope_type": "llama3", **asdict(c.rope_scaling)}
    out = {
        "architectures": [HF_CLASSES[c.architecture]],
        "model_type": c.architecture,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta,
        "rope_scaling": rope_scaling,
        "rms_norm_eps": c.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": c.qkv_bias,  # Qwen2 ignores it (its q/k/v always have biases)
        "mlp_bias": False,
        "sliding_window": c.sliding_window,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "torch_dtype": "float32",
    }
    if c.architecture in ("qwen2", "qwen3"):
        out["use_sliding_window"] = c.sliding_window is not None
        out["max_window_layers"] = 0 if c.sliding_window is not None else c.num_layers
    return out


def export_hf_dir(loaded: LoadedModel, out_dir: Path) -> Path:
    """Write `loaded` under out_dir (created if needed) and return out_dir."""
    from safetensors.torch import save_file

    validate_weights(loaded.config, loaded.weights, loaded.source)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in loaded.weights.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    _write_json(out_dir / "config.json", hf_config_dict(loaded))
    generation = {"bos_token_id": loaded.config.bos_token_id, "eos_token_id": loaded.config.eos_token_id}
    tokenizer = loaded.tokenizer
    if tokenizer is not None:
        tokenizer.backend.save(str(out_dir / "tokenizer.json"))
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "add_bos_token": tokenizer.add_bos_token,
            "model_max_length": loaded.config.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
        }
        if tokenizer.chat_template is not None:
            tokenizer_config["chat_template"] = tokenizer.chat_template
        _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
        # End-of-turn tokens stop generation in transformers and vLLM as they do in backfill.
        generation["eos_token_id"] = list(tokenizer.stop_token_ids) or loaded.config.eos_token_id
    _write_json(out_dir / "generation_config.json", generation)
    return out_dir


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
