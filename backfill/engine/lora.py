"""LoRA adapters served in the engine's forward, several in one batch (Punica / S-LoRA's idea).

An adapter is a directory in PEFT's LoRA format: `adapter_config.json` and
`adapter_model.safetensors` with keys such as
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (A: [r, in], B: [out, r]).
Its delta on a projection is `scale * (x @ A^T) @ B^T` with scale = lora_alpha / r (or
lora_alpha / sqrt(r) with use_rslora), added to the base projection's output.

The engine fuses q/k/v into one matmul and gate/up into another (engine/model.py), so an adapter's
targets are fused the same way at load: per layer and site (qkv, o, gate_up, down) one A^T of
[in, sum of ranks] and one B^T of [sum of ranks, out] (block-diagonal where targets were separate,
the scale folded in). A step's delta at a site is then two small matmuls per adapter in the batch.

Batching: a step's flat token batch is one contiguous span per sequence, so the tokens of one
adapter are a few spans. LoraBatch groups them by adapter: a slice when an adapter's tokens are
contiguous (no copy), else an index (gather, two matmuls, scatter-add) - S-LoRA's segmented
gather-matmul done with torch ops. Tokens of the base model take no work at all, and a step with
no adapter has no LoraBatch: the base path is unchanged.
"""

from __future__ import annotations

import json
import math
import re
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backfill.engine.config import ModelConfig
from backfill.errors import AdapterLoadError, UnknownAdapterError

# HF module name -> (fused site in the engine, its position among the site's parts)
TARGET_SITES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
SITES = ("qkv", "o", "gate_up", "down")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


def site_parts(config: ModelConfig) -> dict[str, list[tuple[str, int, int]]]:
    """Per fused site: (HF module, in_features, out_features) of each part, in the engine's order."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"qkv": [("q_proj", hidden, q), ("k_proj", hidden, kv), ("v_proj", hidden, kv)],
            "o": [("o_proj", q, hidden)],
            "gate_up": [("gate_proj", hidden, inter), ("up_proj", hidden, inter)],
            "down": [("down_proj", inter, hidden)]}


@dataclass(frozen=True)
class SiteWeights:
    """One layer's fused adapter at one site: delta = (x @ a_t) @ b_t."""

    a_t: torch.Tensor  # [in, sum of ranks]
    b_t: torch.Tensor  # [sum of ranks, out], scale folded in


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A loaded adapter; identity (not value) equality: two loads are two adapters."""

    name: str
    path: str
    rank: int
    alpha: float
    scale: float
    target_modules: tuple[str, ...]
    base_model: str | None
    layers: tuple[dict[str, SiteWeights], ...]  # per layer, the sites it adapts
    # What sets this load's KV apart in the prefix cache (engine/prefix_cache.py): unique per load, so
    # blocks never match across adapters, nor across two loads under one name.
    cache_key: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def nbytes(self) -> int:
        return sum(w.a_t.nbytes + w.b_t.nbytes for layer in self.layers for w in layer.values())


def read_adapter_config(path: Path) -> dict:
    config_path = path / CONFIG_FILE
    if not path.is_dir():
        raise AdapterLoadError(f"adapter directory {path} does not exist")
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise AdapterLoadError(f"{path} has no {CONFIG_FILE}: not a PEFT adapter directory") from None
    except (OSError, ValueError) as exc:
        raise AdapterLoadError(f"{config_path}: unreadable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterLoadError(f"{config_path}: expected a JSON object")
    return config


def _check_config(config: dict, where: Path) -> tuple[int, float, float]:
    """(rank, alpha, scale) of a PEFT LoRA config, or AdapterLoadError for what the engine cannot serve."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterLoadError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterLoadError(f"{where}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterLoadError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    unsupported = {"bias": config.get("bias", "none") != "none",
                   "use_dora": bool(config.get("use_dora")),
                   "modules_to_save": bool(config.get("modules_to_save")),
                   "rank_pattern": bool(config.get("rank_pattern")),
                   "alpha_pattern": bool(config.get("alpha_pattern"))}
    bad = [name for name, present in unsupported.items() if present]
    if bad:
        raise AdapterLoadError(f"{where}: the engine serves plain LoRA; unsupported options: {', '.join(bad)}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - TARGET_SITES.keys())
        if unknown:
            raise AdapterLoadError(f"{where}: target_modules {unknown} are not among {sorted(TARGET_SITES)}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(alpha), scale


def load_adapter(path: str | Path, name: str, model_config: ModelConfig, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> LoraAdapter:
    """Read a PEFT LoRA directory and fuse it for the engine's sites (AdapterLoadError if unusable)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config = read_adapter_config(path)
    rank, alpha, scale = _check_config(config, path)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.exists():
        raise AdapterLoadError(f"{path} has no {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as exc:
        raise AdapterLoadError(f"{weights_path}: unreadable safetensors ({exc})") from None
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGET_SITES:
            raise AdapterLoadError(f"{weights_path}: tensor {key!r} is not a LoRA weight of "
                                   f"{', '.join(TARGET_SITES)}")
        layer = int(match.group(1))
        if layer >= model_config.num_layers:
            raise AdapterLoadError(f"{weights_path}: {key!r} names layer {layer}; the model has "
                                   f"{model_config.num_layers}")
        found.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor
    if not found:
        raise AdapterLoadError(f"{weights_path} holds no LoRA weights")
    parts = site_parts(model_config)
    layers: list[dict[str, SiteWeights]] = []
    for li in range(model_config.num_layers):
        fused: dict[str, SiteWeights] = {}
        for site, site_modules in parts.items():
            present = [(module, n_in, n_out, found[(li, module)]) for module, n_in, n_out in site_modules
                       if (li, module) in found]
            if present:
                fused[site] = _fuse(site_modules, present, rank, scale, li, weights_path, dtype, device)
        layers.append(fused)
    targets = tuple(sorted({module for _, module in found}, key=list(TARGET_SITES).index))
    return LoraAdapter(name, str(path), rank, alpha, scale, targets, config.get("base_model_name_or_path"),
                       tuple(layers))


def _fuse(site_modules: list[tuple[str, int, int]], present: list[tuple[str, int, int, dict]], rank: int,
          scale: float, layer: int, where: Path, dtype: torch.dtype, device) -> SiteWeights:
    """A^T stacked side by side and B^T block-diagonal over the site's parts (zero for absent parts)."""
    total_out = sum(n_out for _, _, n_out in site_modules)
    offsets, start = {}, 0
    for module, _, n_out in site_modules:
        offsets[module] = start
        start += n_out
    a_parts, b_t = [], torch.zeros(rank * len(present), total_out, dtype=torch.float32)
    for i, (module, n_in, n_out, pair) in enumerate(present):
        a, b = pair.get("A"), pair.get("B")
        label = f"{where}: layer {layer} {module}"
        if a is None or b is None:
            raise AdapterLoadError(f"{label} has lora_{'A' if a is None else 'B'} missing")
        if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
            raise AdapterLoadError(f"{label}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, expected "
                                   f"{(rank, n_in)} / {(n_out, rank)} for r={rank} on this model")
        a_parts.append(a.float().t())
        off = offsets[module]
        b_t[i * rank:(i + 1) * rank, off:off + n_out] = b.float().t() * scale
    a_t = torch.cat(a_parts, dim=1)
    return SiteWeights(a_t.to(device=device, dtype=dtype).contiguous(), b_t.to(device=device, dtype=dtype))


class AdapterRegistry:
    """The adapters an engine can serve, by name. Thread-safe: the server loads and unloads while
    the scheduler resolves. A request holds its adapter object, so unloading never disturbs one
    in flight."""

    def __init__(self, model_config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.model_config = model_config
        self.dtype = dtype
        self.device = device
        self._adapters: dict[str, LoraAdapter] = {}
        self._lock = threading.Lock()

    def load(self, name: str, path: str | Path, replace: bool = False) -> LoraAdapter:
        """Load the adapter at path as name (AdapterLoadError if the name is taken and not replace)."""
        if not name or not isinstance(name, str):
            raise AdapterLoadError("an adapter needs a non-empty name")
        with self._lock:
            if name in self._adapters and not replace:
                raise AdapterLoadError(f"an adapter named {name!r} is already loaded")
        adapter = load_adapter(path, name, self.model_config, self.dtype, self.device)
        with self._lock:
            if name in self._adapters and not replace:
                raise AdapterLoadError(f"an adapter named {name!r} is already loaded")
            self._adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> LoraAdapter:
        with self._lock:
            adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise UnknownAdapterError(f"no adapter named {name!r} is loaded")
        return adapter

    def get(self, name: str) -> LoraAdapter:
        with self._lock:
            adapter = self._adapters.get(name)
        if adapter is None:
            raise UnknownAdapterError(f"no adapter named {name!r} is loaded")
        return adapter

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._adapters

    def names(self) -> list[str]:
        with self._lock:
            return list(self._adapters)


class LoraBatch:
    """Which tokens of a step's flat batch use which adapter; adds the deltas at each site."""

    def __init__(self, groups: list[tuple[LoraAdapter, slice | torch.Tensor]]) -> None:
        self.groups = groups

    @staticmethod
    def from_spans(spans: list[tuple[LoraAdapter | None, int, int]], device: torch.device) -> LoraBatch | None:
        """spans: (adapter or None, first token, token count) in batch order; None when no adapter is used."""
        by_adapter: dict[int, tuple[LoraAdapter, list[tuple[int, int]]]] = {}
        for adapter, start, count in spans:
            if adapter is None or count == 0:
                continue
            runs = by_adapter.setdefault(id(adapter), (adapter, []))[1]
            if runs and runs[-1][1] == start:  # adjacent spans of one adapter merge into one run
                runs[-1] = (runs[-1][0], start + count)
            else:
                runs.append((start, start + count))
        if not by_adapter:
            return None
        groups: list[tuple[LoraAdapter, slice | torch.Tensor]] = []
        for adapter, runs in by_adapter.values():
            if len(runs) == 1:
                groups.append((adapter, slice(*runs[0])))
            else:
                index = torch.cat([torch.arange(a, b) for a, b in runs]).to(device)
                groups.append((adapter, index))
        return LoraBatch(groups)

    def add(self, layer: int, site: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += delta(x[rows]) for every adapter's rows, in place."""
        for adapter, rows in self.groups:
            w = adapter.layers[layer].get(site)
            if w is None:
                continue
            if isinstance(rows, slice):
                xs = x[rows]
                delta = torch.mm(xs.to(w.a_t.dtype), w.a_t).mm(w.b_t)
                out[rows] += delta.to(out.dtype)
            else:
                delta = torch.mm(x.index_select(0, rows).to(w.a_t.dtype), w.a_t).mm(w.b_t)
                out.index_add_(0, rows, delta.to(out.dtype))
