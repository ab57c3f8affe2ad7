"""Model architecture configuration: the Llama family and its relatives (Mistral, Qwen2/2.5, Qwen3).

They share one decoder (pre-norm, RoPE, GQA, SwiGLU) and differ in a few options: Llama 3.1/3.2
scale RoPE's low frequencies (rope_type "llama3"), Qwen2 adds biases to q/k/v, Qwen3 normalizes
each head of q and k (RMSNorm) before RoPE and may have head_dim != hidden_size / num_heads, and
Mistral v0.1 attends within a sliding window. docs/models.md lists what loads and what is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backfill.errors import CorruptModelError, UnsupportedModelError

if TYPE_CHECKING:
    import torch

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE scaling: wavelengths longer than original_max / low_freq_factor are slowed
    by factor, shorter than original_max / high_freq_factor kept, the band between interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not (self.factor >= 1 and 0 < self.low_freq_factor < self.high_freq_factor
                and self.original_max_position_embeddings > 0):
            raise CorruptModelError(f"llama3 rope scaling has inconsistent parameters: {self}")

    def freq_divisors(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """What each inverse frequency is divided by (llama.cpp stores these as rope_freqs)."""
        import torch  # here, not at the top: the command line reads these configs without torch

        wavelen = 2 * math.pi / inv_freq
        original = self.original_max_position_embeddings
        smooth = (original / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        divisors = 1.0 / ((1 - smooth) / self.factor + smooth)
        divisors = torch.where(wavelen < original / self.high_freq_factor, torch.ones_like(inv_freq), divisors)
        return torch.where(wavelen > original / self.low_freq_factor, torch.full_like(inv_freq, self.factor),
                           divisors)

    @staticmethod
    def fit(divisors: torch.Tensor, inv_freq: torch.Tensor) -> "Llama3RopeScaling | None":
        """The scaling whose freq_divisors(inv_freq) are `divisors` (a GGUF's rope_freqs tensor); None
        when nothing is scaled; ValueError when no Llama-3 scaling gives them.

        The divisors fix only the two band edges in wavelength (original / low_freq_factor and
        original / high_freq_factor), not the three parameters: scaling all three by one number
        changes nothing. Inside the band, 1 / divisor interpolates linearly in 1 / wavelength, so
        a line through the band's points gives the edges; with fewer than two points there, any
        edges between the neighbouring wavelengths that give the same divisors will do.
        """
        import torch

        divisors, inv_freq = divisors.double(), inv_freq.double()
        factor = float(divisors.max())
        if abs(factor - 1.0) < 1e-6 and float(divisors.min()) > 1 - 1e-6:
            return None
        wavelen = 2 * math.pi / inv_freq
        tol = 1e-4 * factor
        kept, slowed = divisors <= 1 + tol, divisors >= factor - tol
        band = ~(kept | slowed)
        if not slowed.any() or factor <= 1:
            raise ValueError("no frequency is slowed by the largest divisor")
        # smooth = (original / wavelen - low) / (high - low): 0 at the slowed edge, 1 at the kept one
        smooth = (1 / divisors - 1 / factor) / (1 - 1 / factor)
        if int(band.sum()) >= 2:
            x, y = 1 / wavelen[band], smooth[band]
            slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
            intercept = float(y.mean()) - slope * float(x.mean())
            if not (slope > 0 and intercept < 0):
                raise ValueError("the band's divisors do not fall with the wavelength as Llama 3's do")
            # the wavelengths where smooth is 0 and 1
            slowed_edge, kept_edge = slope / -intercept, slope / (1 - intercept)
        else:
            below = float(wavelen[kept].max()) if kept.any() else float(wavelen.min()) / 2
            above = float(wavelen[slowed].min())
            if band.any():
                point, s = float(wavelen[band][0]), float(smooth[band][0])
                # s = (slowed_edge / point - 1) / (slowed_edge / kept_edge - 1): the slowed edge in the
                # middle of its gap, the kept edge solved from it (moved to its gap's end if past it)
                slowed_edge = math.sqrt(point * above)
                kept_edge = s / (1 / point - (1 - s) / slowed_edge)
                if kept_edge < below and 1 / point - s / below > 0:
                    kept_edge = below
                    slowed_edge = (1 - s) / (1 / point - s / below)
            else:
                slowed_edge, kept_edge = below * (above / below) ** (2 / 3), below * (above / below) ** (1 / 3)
        original = max(1, round(slowed_edge))
        if not 0 < kept_edge < slowed_edge:
            raise ValueError("the divisors leave no band for Llama 3's interpolation")
        scaling = Llama3RopeScaling(factor=factor, low_freq_factor=original / slowed_edge,
                                    high_freq_factor=original / kept_edge, original_max_position_embeddings=original)
        if not torch.allclose(scaling.freq_divisors(inv_freq), divisors, rtol=1e-4, atol=1e-6):
            raise ValueError("the divisors are not those of any Llama-3 scaling")
        return scaling


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = "llama"
    architecture: str = "llama"
    # None: hidden_size // num_heads (filled in at construction). Qwen3 and some Mistrals set it apart.
    head_dim: int | None = None
    qkv_bias: bool = False    # Qwen2/2.5: biases on the q, k and v projections
    qk_norm: bool = False     # Qwen3: RMSNorm over each head of q and k before RoPE
    rope_scaling: Llama3RopeScaling | None = None
    sliding_window: int | None = None  # tokens a query sees; None: the whole context

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "max_position_embeddings")
        for field in positive:
            if getattr(self, field) <= 0:
                raise CorruptModelError(f"model config: {field} must be positive, got {getattr(self, field)}")
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModelError(f"model config: architecture {self.architecture!r} is not supported "
                                        f"(supported: {', '.join(ARCHITECTURES)})")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise CorruptModelError(
                    f"model config: hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim <= 0:
            raise CorruptModelError(f"model config: head_dim must be positive, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise CorruptModelError(
                f"model config: num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise CorruptModelError(f"model config: sliding_window must be positive, got {self.sliding_window}")

    def check_context(self, max_model_len: int) -> None:
        """UnsupportedModelError where serving max_model_len tokens would need the sliding window:
        backfill attends to the whole context, which equals windowed attention only up to the window."""
        if self.sliding_window is not None and max_model_len > self.sliding_window:
            raise UnsupportedModelError(
                f"{self.name} attends within a sliding window of {self.sliding_window} tokens, which backfill "
                f"does not implement; serve it with max_model_len <= {self.sliding_window} "
                f"(--max-model-len {self.sliding_window}; asked for {max_model_len})")

    def rope_inv_freq(self) -> torch.Tensor:
        """RoPE's inverse frequencies [head_dim / 2] in fp64, with the model's scaling applied."""
        import torch

        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64)
                                              / self.head_dim))
        if self.rope_scaling is not None:
            inv_freq = inv_freq / self.rope_scaling.freq_divisors(inv_freq)
        return inv_freq

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        """Bytes of K and V one token occupies across all layers, in fp32."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    @staticmethod
    def smollm2_135m() -> "ModelConfig":
        """The default model's architecture (for benchmarks with random weights of the same shape)."""
        return ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                           num_kv_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                           tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, name="smollm2-135m-random")

    @staticmethod
    def tiny(**overrides) -> "ModelConfig":
        """A small random-weight model for fast unit tests."""
        base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                    num_kv_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, name="tiny-random")
        base.update(overrides)
        return ModelConfig(**base)


@dataclass(frozen=True)
class SafepointLayout:
    """Where a runner's steps can be aborted (ConServe §4.3), as the runner reports it: a policy sizes
    preemptible steps by the longest stretch between two safepoints and judges a step's pace by layers."""

    num_layers: int
    longest_stretch_share: float  # the longest stretch between two safepoints, as a share of a layer's work

    def __post_init__(self) -> None:
        if self.num_layers < 1 or not 0 < self.longest_stretch_share <= 1:
            raise ValueError(f"bad safepoint layout: {self}")
