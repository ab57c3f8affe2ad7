"""Model architecture configuration (Llama family)."""

from __future__ import annotations

from dataclasses import dataclass

from backfill.errors import CorruptModelError


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

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "max_position_embeddings")
        for field in positive:
            if getattr(self, field) <= 0:
                raise CorruptModelError(f"model config: {field} must be positive, got {getattr(self, field)}")
        if self.hidden_size % self.num_heads:
            raise CorruptModelError(
                f"model config: hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise CorruptModelError(
                f"model config: num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

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
