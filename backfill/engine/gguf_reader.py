"""Read a llama-architecture GGUF file into HF-named fp32 weights, a ModelConfig and a tokenizer.

llama.cpp's converter stores Q and K projections with the rows of each head permuted: HF
checkpoints rotate the two *halves* of a head (rotate_half RoPE), llama.cpp rotates adjacent
*pairs*, so the converter interleaves the halves. We undo that here, so the weights dict has the
HF layout and the model can use rotate_half RoPE.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from backfill.engine.config import ModelConfig
from backfill.engine.tokenizer import Tokenizer
from backfill.errors import CorruptModelError, ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURE = "llama"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


def hf_name(gguf_name: str) -> str:
    """The HF Llama name of a GGUF tensor; CorruptModelError for a tensor a Llama has no use for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    if gguf_name == "rope_freqs.weight":
        raise ModelLoadError("GGUF uses scaled RoPE (rope_freqs tensor), which backfill does not support")
    raise CorruptModelError(f"GGUF has an unexpected tensor {gguf_name!r} for a llama model")


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's Q/K row permutation: per head, rows (pair, half) -> (half, pair)."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation (HF layout -> GGUF layout); the inverse of unpermute_qk."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.reshape(n_heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def _open(path: Path):
    import gguf

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CorruptModelError(f"{path} is not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as exc:  # the reader fails in many ways (struct, numpy, ValueError) on bad bytes
        raise CorruptModelError(f"{path}: cannot parse GGUF header ({type(exc).__name__}: {exc})") from exc


def _field(reader, key: str, default=None, required: bool = True):
    field = reader.fields.get(key)
    if field is None:
        if required and default is None:
            raise CorruptModelError(f"GGUF metadata lacks required key {key!r}")
        return default
    try:
        return field.contents()
    except Exception as exc:
        raise CorruptModelError(f"GGUF metadata key {key!r} is malformed: {exc}") from exc


def _config(reader, path: Path, name: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != SUPPORTED_ARCHITECTURE:
        raise CorruptModelError(f"{path}: unsupported architecture {arch!r} (backfill runs {SUPPORTED_ARCHITECTURE!r})")
    tokens = _field(reader, "tokenizer.ggml.tokens", required=False)
    vocab_size = _field(reader, "llama.vocab_size", default=len(tokens) if tokens else None)
    tensor_names = {t.name for t in reader.tensors}
    config = ModelConfig(
        vocab_size=int(vocab_size),
        hidden_size=int(_field(reader, "llama.embedding_length")),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=int(_field(reader, "llama.attention.head_count")),
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv",
                                default=_field(reader, "llama.attention.head_count"))),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", default=10000.0)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", default=1e-5)),
        # llama.cpp's converter drops output.weight when the checkpoint ties it to the embedding.
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_optional_int(_field(reader, "tokenizer.ggml.bos_token_id", required=False)),
        eos_token_id=_optional_int(_field(reader, "tokenizer.ggml.eos_token_id", required=False)),
        name=name,
    )
    rope_dims = _field(reader, "llama.rope.dimension_count", required=False)
    if rope_dims is not None and int(rope_dims) != config.head_dim:
        raise ModelLoadError(f"{path}: partial RoPE ({rope_dims} of {config.head_dim} dims) is not supported")
    if _field(reader, "llama.rope.scaling.type", required=False) not in (None, "none"):
        raise ModelLoadError(f"{path}: RoPE scaling is not supported")
    return config


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def _weights(reader, path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    file_bytes = path.stat().st_size
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if tensor.data_offset + tensor.n_bytes > file_bytes:
            raise CorruptModelError(f"{path}: tensor {tensor.name} runs past the end of the file (truncated?)")
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise CorruptModelError(f"{path}: cannot dequantize {tensor.name} "
                                    f"({tensor.tensor_type.name}): {exc}") from exc
        weight = torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))
        if name.endswith("q_proj.weight"):
            weight = _unpermute_checked(weight, config.num_heads, tensor.name, path)
        elif name.endswith("k_proj.weight"):
            weight = _unpermute_checked(weight, config.num_kv_heads, tensor.name, path)
        weights[name] = weight.contiguous()
    return weights


def _unpermute_checked(weight: torch.Tensor, n_heads: int, gguf_name: str, path: Path) -> torch.Tensor:
    if weight.dim() != 2 or weight.shape[0] % n_heads or (weight.shape[0] // n_heads) % 2:
        raise CorruptModelError(f"{path}: {gguf_name} has shape {tuple(weight.shape)}, "
                                f"which does not split into {n_heads} heads of even size")
    return unpermute_qk(weight, n_heads)


def _tokenizer(reader, path: Path) -> Tokenizer | None:
    tokens = _field(reader, "tokenizer.ggml.tokens", required=False)
    if not tokens:
        return None
    kind = _field(reader, "tokenizer.ggml.model", required=False)
    if kind != "gpt2":
        raise ModelLoadError(f"{path}: tokenizer type {kind!r} is not supported (only byte-level BPE 'gpt2')")
    return Tokenizer.from_gguf_vocab(
        tokens=list(tokens),
        merges=list(_field(reader, "tokenizer.ggml.merges", required=False) or []),
        token_types=list(_field(reader, "tokenizer.ggml.token_type", required=False) or []),
        pre_type=_field(reader, "tokenizer.ggml.pre", required=False),
        bos_token_id=_optional_int(_field(reader, "tokenizer.ggml.bos_token_id", required=False)),
        eos_token_id=_optional_int(_field(reader, "tokenizer.ggml.eos_token_id", required=False)),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", default=False, required=False)),
        chat_template=_field(reader, "tokenizer.chat_template", required=False),
    )


def read_gguf_config(path: Path) -> ModelConfig:
    """The model's shape from the GGUF header alone (no tensor is read): for sizing without loading."""
    return _config(_open(path), path, name=path.name.removesuffix(".gguf"))


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]:
    """Parse, dequantize and un-permute a GGUF; the weights are not yet checked against the config."""
    reader = _open(path)
    config = _config(reader, path, name=path.name.removesuffix(".gguf"))
    return config, _weights(reader, path, config), _tokenizer(reader, path)
