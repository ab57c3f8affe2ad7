"""Load a Llama model (GGUF file or HF directory) into HF-named fp32 weights plus its tokenizer.

A GGUF is dequantized once; the result is cached as an HF directory (the same layout
hf_export writes) under the cache dir, so later loads only read safetensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from backfill.engine.config import ModelConfig
from backfill.engine.tokenizer import Tokenizer
from backfill.errors import CorruptModelError, ModelLoadError

# Bump when the cached layout or the GGUF conversion changes, so stale caches are not reused.
CACHE_FORMAT_VERSION = 1
_CACHE_KEY_HEAD_BYTES = 1 << 20


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


def random_model(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights under HF names (matrices std 0.02, norms 1) for fast engine tests."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=generator) * 0.02
    return weights


def default_cache_dir() -> Path:
    env = os.environ.get("BACKFILL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "backfill"


def gguf_cache_key(path: Path) -> str:
    """Cheap identity of a GGUF: size, mtime and a hash of its first MiB (header + metadata)."""
    stat = path.stat()
    digest = hashlib.sha256(f"v{CACHE_FORMAT_VERSION}:{stat.st_size}:{stat.st_mtime_ns}:".encode())
    with open(path, "rb") as f:
        digest.update(f.read(_CACHE_KEY_HEAD_BYTES))
    return digest.hexdigest()[:20]


def _model_path(path: str | Path | None) -> Path:
    """A GGUF file or an HF directory that exists; None is the default model's GGUF."""
    if path is None:
        from backfill.engine.default_model import default_model_path
        path = default_model_path()
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    return path


def load_model(path: str | Path | None = None, *, cache_dir: Path | None = None) -> LoadedModel:
    """A GGUF file or an HF directory; None is the default model (SmolLM2-135M-Instruct)."""
    path = _model_path(path)
    if path.is_dir():
        return load_hf_dir(path)
    return _load_gguf_cached(path.resolve(), cache_dir if cache_dir is not None else default_cache_dir())


def read_model_config(path: str | Path | None = None) -> ModelConfig:
    """load_model's config alone, read without the weights (a GGUF's header, an HF config.json)."""
    from backfill.engine.gguf_reader import read_gguf_config

    path = _model_path(path)
    return _hf_config(path, path.resolve().name) if path.is_dir() else read_gguf_config(path.resolve())


def load_hf_dir(directory: Path, *, name: str | None = None, source: str | None = None) -> LoadedModel:
    """config.json + *.safetensors + tokenizer.json (+ tokenizer_config.json)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = _hf_config(directory, name or directory.resolve().name)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CorruptModelError(f"{directory} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptModelError(f"{file} cannot be read: {exc}") from exc
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some tied checkpoints store the shared matrix twice
    weights = {k: v.to(torch.float32).contiguous() for k, v in weights.items()
               if not k.endswith("rotary_emb.inv_freq")}  # a buffer older checkpoints saved
    validate_weights(config, weights, str(directory))
    tokenizer = Tokenizer.from_hf_dir(directory) if (directory / "tokenizer.json").is_file() else None
    return LoadedModel(config, weights, tokenizer, source or str(directory.resolve()))


def _hf_config(directory: Path, name: str) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory} is not a model directory (no config.json)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptModelError(f"{path} is not valid JSON: {exc}") from exc
    if raw.get("model_type") != "llama":
        raise CorruptModelError(f"{path}: unsupported model_type {raw.get('model_type')!r} (backfill runs 'llama')")
    # transformers 5 writes rope settings as rope_parameters, older versions as rope_theta/rope_scaling.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ModelLoadError(f"{path}: rope scaling {rope} is not supported")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ModelLoadError(f"{path}: attention/MLP biases are not supported")
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        if int(raw.get("head_dim") or hidden // heads) != hidden // heads:
            raise ModelLoadError(f"{path}: head_dim != hidden_size / num_attention_heads is not supported")
        return ModelConfig(
            vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]), num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=_first_id(raw.get("bos_token_id")), eos_token_id=_first_id(raw.get("eos_token_id")),
            name=name)
    except KeyError as exc:
        raise CorruptModelError(f"{path} lacks required key {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise CorruptModelError(f"{path} has a malformed value: {exc}") from exc


def _first_id(value) -> int | None:
    if isinstance(value, list):  # HF allows several EOS ids; the config keeps the first
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _load_gguf_cached(path: Path, cache_dir: Path) -> LoadedModel:
    from backfill.engine.gguf_reader import read_gguf

    name = path.name.removesuffix(".gguf")
    entry = cache_dir / f"{name}-{gguf_cache_key(path)}"
    if entry.is_dir():
        try:
            return load_hf_dir(entry, name=name, source=str(path))
        except ModelLoadError:
            shutil.rmtree(entry, ignore_errors=True)  # corrupt or partial cache entry: rebuild it
    config, weights, tokenizer = read_gguf(path)
    validate_weights(config, weights, str(path))
    loaded = LoadedModel(config, weights, tokenizer, str(path))
    try:
        _write_cache_entry(loaded, entry)
    except OSError:
        pass  # a read-only or full cache dir costs speed on the next load, not correctness
    return loaded


def _write_cache_entry(loaded: LoadedModel, entry: Path) -> None:
    """Export into a temporary sibling directory, then rename it into place (atomic on POSIX)."""
    from backfill.engine.hf_export import export_hf_dir

    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        export_hf_dir(loaded, staging)
        os.rename(staging, entry)
    except OSError:
        if entry.is_dir():
            return  # another process finished the same entry first; ours is redundant
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
