"""FinetuneConfig: every knob of a LoRA finetuning job, declared and validated once."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from backfill.errors import FinetuneConfigError

# HF names of the projections a LoRA adapter may target (PEFT's target_modules).
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTENTION_TARGETS + MLP_TARGETS


@dataclass(frozen=True)
class FinetuneConfig:
    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ALL_TARGETS
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_steps: int | None = None       # None: epochs x ceil(samples / batch_size)
    epochs: int = 1
    batch_size: int = 4                # samples per optimizer step
    micro_batch_size: int = 1          # samples per forward/backward pass (HARLI §6.1)
    seed: int = 0                      # data order and adapter initialisation
    checkpoint_every_steps: int = 10
    max_seq_len: int = 512             # longer conversations are cut here
    layers_per_unit: int = 1           # transformer layers per scheduling unit (HARLI §6.1)
    # HARLI §6.1: a unit should take about one decode step; the LM head over a whole micro-batch
    # takes several, so the head and loss run in slices of at most this many target tokens.
    loss_rows_per_unit: int = 48
    base_model: str = ""               # written into adapter_config.json
    extra: dict = field(default_factory=dict, compare=False, hash=False)  # caller's notes (e.g. job id)

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise FinetuneConfigError(f"rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise FinetuneConfigError(f"alpha must be positive, got {self.alpha!r}")
        targets = tuple(self.target_modules)
        object.__setattr__(self, "target_modules", targets)
        if not targets:
            raise FinetuneConfigError("target_modules must name at least one projection")
        if unknown := [t for t in targets if t not in ALL_TARGETS]:
            raise FinetuneConfigError(f"unknown target modules {unknown}; choose among {list(ALL_TARGETS)}")
        if len(set(targets)) != len(targets):
            raise FinetuneConfigError(f"target_modules has duplicates: {list(targets)}")
        if not self.learning_rate > 0:
            raise FinetuneConfigError(f"learning_rate must be positive, got {self.learning_rate!r}")
        if self.weight_decay < 0:
            raise FinetuneConfigError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise FinetuneConfigError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(self.betas))
        if self.max_steps is not None and self.max_steps < 1:
            raise FinetuneConfigError(f"max_steps must be >= 1, got {self.max_steps!r}")
        for name in ("epochs", "batch_size", "micro_batch_size", "checkpoint_every_steps", "layers_per_unit",
                     "loss_rows_per_unit"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise FinetuneConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.micro_batch_size > self.batch_size:
            raise FinetuneConfigError(
                f"micro_batch_size {self.micro_batch_size} exceeds batch_size {self.batch_size}")
        if not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            raise FinetuneConfigError(f"max_seq_len must be an integer >= 2, got {self.max_seq_len!r}")

    @property
    def scale(self) -> float:
        """LoRA's delta multiplier (PEFT: lora_alpha / r)."""
        return self.alpha / self.rank

    def to_json(self) -> dict:
        out = asdict(self)
        out["target_modules"] = list(self.target_modules)
        out["betas"] = list(self.betas)
        return out

    @classmethod
    def from_json(cls, data: dict) -> "FinetuneConfig":
        data = dict(data)
        data["target_modules"] = tuple(data.get("target_modules", ALL_TARGETS))
        data["betas"] = tuple(data.get("betas", (0.9, 0.999)))
        return cls(**data)
