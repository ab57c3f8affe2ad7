"""LoRA adapters over the engine's frozen weights, and their PEFT-format files.

Why our own small LoRA layer and not `peft`: peft wraps `nn.Linear` modules that own a plain
[out, in] weight, but the engine holds each layer's weights once, fused (q|k|v and gate|up) and,
on CPUs with oneDNN, reordered into oneDNN's opaque blocked layout. Wrapping them for peft would
mean a second, plain copy of the base model. Here the base matmul runs through the engine's own
`Linear` (whatever its layout) inside an autograd function whose backward needs only dx = dy @ W:
a transposed view of the plain layout, or a dense copy of that ONE matrix made during its
layer's backward and dropped right after in the packed layout (oneDNN has no transposed kernel
for a packed weight). The files are PEFT's, so peft + transformers can load what we train.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from backfill.engine.linear import Linear
from backfill.errors import CheckpointError
from backfill.finetune.config import FinetuneConfig

# HF projection -> (engine matrix, which slice of its output rows).
ATTN_PREFIX, MLP_PREFIX = "self_attn", "mlp"


class FrozenMatmul(torch.autograd.Function):
    """y = x @ W.T through the engine's Linear; gradients flow to x only (W is frozen)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, linear: Linear) -> torch.Tensor:
        ctx.linear = linear  # not saved_tensors: the weight is the engine's and never changes
        ctx.x_dtype = x.dtype
        return linear(x)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        linear: Linear = ctx.linear
        grad = grad_out.to(linear.compute_dtype)
        if linear.packed:
            # A transient plain copy of this one matrix (see the module docstring).
            grad_x = grad @ linear.weight.to_dense()
        else:
            grad_x = grad @ linear.weight.t()  # stored [in, out]: its transpose is a view
        return grad_x.to(ctx.x_dtype), None


def frozen_matmul(x: torch.Tensor, linear: Linear) -> torch.Tensor:
    return FrozenMatmul.apply(x, linear)


def module_path(layer: int, target: str) -> str:
    prefix = ATTN_PREFIX if target.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else MLP_PREFIX
    return f"base_model.model.model.layers.{layer}.{prefix}.{target}"


class TrainableLoraAdapter:
    """The trainable A [r, in] and B [out, r] of every targeted projection of every layer (fp32)."""

    def __init__(self, config: FinetuneConfig, in_out: dict[str, tuple[int, int]], num_layers: int,
                 generator: torch.Generator | None = None, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.num_layers = num_layers
        self.in_out = in_out
        self.scale = config.scale
        self.params: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(num_layers):
            for target in config.target_modules:
                fan_in, fan_out = in_out[target]
                # PEFT's default init: A ~ kaiming_uniform(a=sqrt(5)), B = 0 (the adapter starts as a no-op).
                bound = 1.0 / math.sqrt(fan_in)
                a = (torch.rand(config.rank, fan_in, generator=generator) * 2 - 1) * bound
                b = torch.zeros(fan_out, config.rank)
                # drawn on the CPU (the same values on every device), trained beside the model's weights
                a, b = a.to(device), b.to(device)
                self.params[(layer, target)] = (a.requires_grad_(), b.requires_grad_())

    @staticmethod
    def shapes_for(model_config) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each HF projection of a Llama layer."""
        c = model_config
        q, kv, h, i = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def parameters(self) -> list[torch.Tensor]:
        return [t for pair in self.params.values() for t in pair]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parameters())

    def has(self, target: str) -> bool:
        return target in self.config.target_modules

    def delta(self, layer: int, target: str, x: torch.Tensor) -> torch.Tensor:
        """scale * (x @ A.T) @ B.T, in fp32, returned in x's dtype."""
        a, b = self.params[(layer, target)]
        return ((x.float() @ a.t()) @ b.t() * self.scale).to(x.dtype)

    # --- PEFT files -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for (layer, target), (a, b) in self.params.items():
            path = module_path(layer, target)
            out[f"{path}.lora_A.weight"] = a.detach().clone().contiguous()
            out[f"{path}.lora_B.weight"] = b.detach().clone().contiguous()
        return out

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for (layer, target), (a, b) in self.params.items():
                path = module_path(layer, target)
                try:
                    a.copy_(tensors[f"{path}.lora_A.weight"])
                    b.copy_(tensors[f"{path}.lora_B.weight"])
                except (KeyError, RuntimeError) as exc:
                    raise CheckpointError(f"adapter file does not match the job at {path}: {exc}") from exc

    def save(self, directory: Path) -> Path:
        """Write adapter_config.json and adapter_model.safetensors (PEFT's LoRA format)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        c = self.config
        adapter_config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": c.rank, "lora_alpha": c.alpha,
            "target_modules": list(c.target_modules), "lora_dropout": 0.0, "bias": "none",
            "base_model_name_or_path": c.base_model, "fan_in_fan_out": False, "use_rslora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        }
        save_file(self.state_dict(), str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
        return directory

    def load(self, directory: Path) -> None:
        path = Path(directory) / "adapter_model.safetensors"
        try:
            tensors = load_file(str(path))
        except (OSError, Exception) as exc:
            raise CheckpointError(f"cannot read adapter weights {path}: {exc}") from exc
        self.load_state_dict(tensors)
