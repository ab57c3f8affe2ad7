"""Read a GGUF file (architecture llama, qwen2 or qwen3) into HF-named fp32 weights, a ModelConfig
and a tokenizer.

For the `llama` architecture (Llama, Mistral, SmolLM) llama.cpp's converter stores Q and K
projections with the rows of each head permuted: HF checkpoints rotate the two *halves* of a head
(rotate_half RoPE), llama.cpp rotates adjacent *pairs*, so the converter interleaves the halves.
We undo that here, so the weights dict has the HF layout and the model can use rotate_half RoPE.
Qwen2/Qwen3 use the half-rotation ("NEOX") RoPE in llama.cpp too: their rows are stored as in HF.

Llama 3.1's RoPE scaling reaches a GGUF as a `rope_freqs` tensor (what each frequency is divided
by), not as parameters; we recover the parameters from it (Llama3RopeScaling.fit) and refuse a
tensor that no Llama-3 scaling produces.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from backfill.engine.config import Llama3RopeScaling, ModelConfig
from backfill.engine.tokenizer import Tokenizer
from backfill.errors import CorruptModelError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_FREQS_TENSOR = "rope_freqs.weight"

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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str:
    """The HF name of a GGUF tensor; CorruptModelError for a tensor the decoder has no use for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    raise CorruptModelError(f"GGUF has an unexpected tensor {gguf_name!r}")


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
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"{path}: unsupported architecture {arch!r} "
                                    f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def key(suffix: str, default=None, required: bool = True):
        return _field(reader, f"{arch}.{suffix}", default=default, required=required)

    tokens = _field(reader, "tokenizer.ggml.tokens", required=False)
    vocab_size = key("vocab_size", default=len(tokens) if tokens else None)
    tensors = {t.name: t for t in reader.tensors}
    heads = key("attention.head_count")
    head_dim = key("attention.key_length", required=False)
    value_dim = key("attention.value_length", required=False)
    if head_dim is not None and value_dim is not None and int(value_dim) != int(head_dim):
        raise UnsupportedModelError(f"{path}: keys of {head_dim} and values of {value_dim} dims per head "
                                    "are not supported (they must be equal)")
    sliding_window = key("attention.sliding_window", required=False)
    try:
        config = ModelConfig(
            vocab_size=int(vocab_size),
            hidden_size=int(key("embedding_length")),
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=int(heads),
            num_kv_heads=int(key("attention.head_count_kv", default=heads)),
            max_position_embeddings=int(key("context_length")),
            rope_theta=float(key("rope.freq_base", default=10000.0)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", default=1e-5)),
            # llama.cpp's converter drops output.weight when the checkpoint ties it to the embedding.
            tie_word_embeddings="output.weight" not in tensors,
            bos_token_id=_optional_int(_field(reader, "tokenizer.ggml.bos_token_id", required=False)),
            eos_token_id=_optional_int(_field(reader, "tokenizer.ggml.eos_token_id", required=False)),
            name=name,
            architecture=arch,
            head_dim=None if head_dim is None else int(head_dim),
            qkv_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            sliding_window=None if sliding_window is None else int(sliding_window),
        )
    except (TypeError, ValueError) as exc:
        raise CorruptModelError(f"{path}: malformed model metadata: {exc}") from exc
    if "blk.0.attn_output.bias" in tensors:
        raise UnsupportedModelError(f"{path}: a bias on the attention output projection is not supported")
    rope_dims = key("rope.dimension_count", required=False)
    if rope_dims is not None and int(rope_dims) != config.head_dim:
        raise UnsupportedModelError(f"{path}: partial RoPE ({rope_dims} of {config.head_dim} dims) "
                                    "is not supported")
    scaling = key("rope.scaling.type", required=False)
    if scaling not in (None, "none"):
        raise UnsupportedModelError(f"{path}: RoPE scaling {scaling!r} is not supported "
                                    "(Llama 3's scaling, stored as a rope_freqs tensor, is)")
    if ROPE_FREQS_TENSOR in tensors:
        config = replace(config, rope_scaling=_llama3_scaling(tensors[ROPE_FREQS_TENSOR], config, path))
    return config


def _llama3_scaling(tensor, config: ModelConfig, path: Path) -> Llama3RopeScaling | None:
    from gguf.quants import dequantize

    divisors = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1))
    if divisors.numel() != config.head_dim // 2:
        raise CorruptModelError(f"{path}: {ROPE_FREQS_TENSOR} has {divisors.numel()} entries, "
                                f"expected head_dim / 2 = {config.head_dim // 2}")
    try:
        return Llama3RopeScaling.fit(divisors, config.rope_inv_freq())
    except (ValueError, CorruptModelError) as exc:
        raise UnsupportedModelError(f"{path}: its {ROPE_FREQS_TENSOR} tensor is not a Llama-3 RoPE scaling, "
                                    f"the only one backfill runs ({exc})") from exc


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def _weights(reader, path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    file_bytes = path.stat().st_size
    weights: dict[str, torch.Tensor] = {}
    permuted = config.architecture == "llama"  # llama.cpp permutes Q/K rows only for this architecture
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            continue  # read into the config's rope_scaling
        name = hf_name(tensor.name)
        if tensor.data_offset + tensor.n_bytes > file_bytes:
            raise CorruptModelError(f"{path}: tensor {tensor.name} runs past the end of the file (truncated?)")
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise CorruptModelError(f"{path}: cannot dequantize {tensor.name} "
                                    f"({tensor.tensor_type.name}): {exc}") from exc
        weight = torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))
        if permuted and name.endswith("q_proj.weight"):
            weight = _unpermute_checked(weight, config.num_heads, tensor.name, path)
        elif permuted and name.endswith("k_proj.weight"):
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
        raise UnsupportedModelError(f"{path}: tokenizer type {kind!r} is not supported (only byte-level BPE 'gpt2')")
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


def read_gguf_tokenizer(path: Path) -> Tokenizer | None:
    """The tokenizer a GGUF stores, without reading its tensors."""
    return _tokenizer(_open(path), path)
