"""A simulated GPU whose SMs are split between decode and LoRA finetuning (HARLI's device form).

What a step costs on the whole device is measured (a latency profile of the H200 running a
Llama-3-8B-shaped model); what changes with an SM share is a stated model:

- an inference step (decode or prefill) at SM share s takes
  `max(T1 * max(1, s_sat / s), flops / (peak * eff * s))`: its measured full-device time T1 does
  not grow while its SMs still saturate HBM (HARLI §2.2: decode keeps ~85% of DRAM bandwidth busy
  at ~40% SM utilisation) and grows as s_sat / s below that, and its arithmetic at the measured
  GEMM efficiency bounds it from below (a large batch or a prefill is compute-bound, so 1 / s);
- a finetuning unit at share s is the roofline of its FLOPs on s of the SMs at a stated
  efficiency and of its bytes at the bandwidth those SMs can pull;
- co-located, the part of the decode step that streams memory is slowed by HARLI Eq. 5,
  `(f_infer + f_ft) / B` when the two tasks' demand exceeds B, and each task by a stated
  `interference` per unit SM share of the other (Eq. 3's linear term: caches, clocks).

This is a simulation with stated parameters (backfill/bench/sim/sm_config.py), not a
measurement of co-location on a GPU; the device form itself (CUDA green contexts) is not built.
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from backfill.bench.sim.sm_config import SmDeviceConfig
from backfill.errors import BackfillError, SimDeviceError
from backfill.policy.latency_model import BatchShape, LatencyModel

# The measured H200 profile and model shape the device defaults to, shipped as package data (a copy of
# docs/results/h200-llama3-8b/profile-corrected.json and config.json).
H200_DATA = resources.files("backfill.bench") / "data" / "h200-llama3-8b"
BF16 = 2  # bytes
EPS = 1e-9


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @classmethod
    def from_hf_config(cls, path: Path) -> "ModelShape":
        try:
            c = json.loads(Path(path).read_text())
            return cls(int(c["num_hidden_layers"]), int(c["hidden_size"]), int(c["intermediate_size"]),
                       int(c["num_attention_heads"]), int(c.get("num_key_value_heads", c["num_attention_heads"])),
                       int(c["vocab_size"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SimDeviceError(f"cannot read the model shape from {path}: {exc}") from exc

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    @property
    def layer_params(self) -> int:  # q, o: h x h; k, v: h x kv_dim; gate, up, down: h x intermediate
        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_dim + 3 * self.hidden * self.intermediate

    @property
    def streamed_params(self) -> int:
        """What a forward reads: every layer and the LM head (the embedding is a row lookup)."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_dim * BF16


@dataclass(frozen=True)
class Work:
    """A piece of work's arithmetic and memory traffic."""

    flops: float
    bytes: float

    def __add__(self, other: "Work") -> "Work":
        return Work(self.flops + other.flops, self.bytes + other.bytes)

    def __mul__(self, k: float) -> "Work":
        return Work(self.flops * k, self.bytes * k)


@dataclass(frozen=True)
class FinetuneUnits:
    """One training step of the LoRA job in scheduling units, as the CPU job runs it (§6.1): per
    micro-batch a forward unit per layer, the LM head and loss (forward and backward), a backward
    unit per layer (recompute the layer, then the input gradient through the frozen weights and the
    adapters' gradients), and the AdamW update. Micro-batch = the batch: at full device a layer's
    forward over 2 x 1024 tokens is already under HARLI's ~10 ms unit."""

    forward: Work
    head: Work
    backward: Work
    update: Work
    layers: int
    samples: int
    largest_kernel_flops: float   # the fused gate|up GEMM: what a pause waits for at worst

    @classmethod
    def of(cls, shape: ModelShape, batch: int, seq_len: int, rank: int) -> "FinetuneUnits":
        tokens = batch * seq_len
        h, kv, f = shape.hidden, shape.kv_dim, shape.intermediate
        lora_params = rank * ((h + h) * 2 + (h + kv) * 2 + (h + f) * 3)  # A and B on q/o, k/v, gate/up/down
        attention_flops = 2 * batch * seq_len * seq_len * h  # QK^T and PV, causal half of 4 * b * L^2 * h
        # Activations each token writes and reads once in a layer: input, norms, q/k/v/o, the MLP's three.
        activation_bytes = tokens * (8 * h + 2 * kv + 3 * f) * BF16
        forward = Work(2 * tokens * (shape.layer_params + lora_params) + attention_flops,
                       shape.layer_params * BF16 + activation_bytes)
        backward = forward * 2 + Work(2 * tokens * lora_params, lora_params * 4)  # recompute + dX; LoRA dW
        logits_bytes = tokens * shape.vocab * 4 * 2  # fp32 logits and their gradient
        head = Work(2 * 2 * tokens * shape.vocab * h, 2 * shape.vocab * h * BF16 + logits_bytes)
        update = Work(10 * shape.layers * lora_params, shape.layers * lora_params * 4 * 7)  # AdamW, fp32
        return cls(forward, head, backward, update, shape.layers, batch, 2 * tokens * h * 2 * f)

    def kinds(self) -> tuple[tuple[Work, int], ...]:
        return ((self.forward, self.layers), (self.head, 1), (self.backward, self.layers), (self.update, 1))

    @property
    def per_step(self) -> Work:
        total = Work(0.0, 0.0)
        for work, count in self.kinds():
            total = total + work * count
        return total


def check_share(name: str, share: float, allow_zero: bool = False) -> None:
    low_ok = share >= 0 if allow_zero else share > 0
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not (low_ok and share <= 1 + EPS):
        bound = "[0, 1]" if allow_zero else "(0, 1]"
        raise SimDeviceError(f"{name} must be in {bound}, got {share!r}")


class SimulatedDevice:
    """Ground truth of the simulation: what each step costs at a given SM split (no noise; the
    simulator and the profiler add it)."""

    def __init__(self, config: SmDeviceConfig, profile: LatencyModel, shape: ModelShape) -> None:
        self.config = config
        self.profile = profile
        self.shape = shape
        self.units = FinetuneUnits.of(shape, config.ft_batch, config.ft_seq_len, config.ft_rank)
        self._peak_flops = config.peak_tflops * 1e12
        self._read_bps = config.read_tbps * 1e12
        self._hbm_bps = config.peak_hbm_tbps * 1e12
        self._ft_step_ms = lru_cache(maxsize=4096)(self._ft_step_ms_uncached)

    @classmethod
    def load(cls, config: SmDeviceConfig) -> "SimulatedDevice":
        with ExitStack() as stack:
            profile_path = (Path(config.profile) if config.profile
                            else stack.enter_context(resources.as_file(H200_DATA / "profile-corrected.json")))
            shape_path = (Path(config.model_config) if config.model_config
                          else stack.enter_context(resources.as_file(H200_DATA / "config.json")))
            if not profile_path.is_file():
                raise SimDeviceError(f"no latency profile at {profile_path}")
            try:
                profile = LatencyModel.load(profile_path)
            except BackfillError as exc:
                raise SimDeviceError(str(exc)) from exc
            return cls(config, profile, ModelShape.from_hf_config(shape_path))

    # --- inference steps --------------------------------------------------------------------------

    def _decode_work(self, batch: int, seqlen: float) -> tuple[float, Work]:
        full_ms = self.profile.estimate_ms(BatchShape(num_tokens=batch, decode_context_tokens=int(batch * seqlen)))
        work = Work(2 * batch * self.shape.streamed_params,
                    self.shape.streamed_params * BF16 + batch * seqlen * self.shape.kv_bytes_per_token)
        return full_ms, work

    def _prefill_work(self, tokens: int) -> tuple[float, Work]:
        full_ms = self.profile.estimate_ms(BatchShape(num_tokens=tokens, prefill_attention_pairs=1))
        return full_ms, Work(2 * tokens * self.shape.streamed_params, self.shape.streamed_params * BF16)

    def _solo_ms(self, full_ms: float, work: Work, share: float) -> float:
        sat = self.config.saturation_share
        # The measured step holds its arithmetic, so at full share the model is the measurement.
        compute_ms = min(work.flops / (self._peak_flops * self.config.compute_efficiency) * 1e3, full_ms) / share
        return max(full_ms * max(1.0, sat / share), compute_ms)

    def _colo_ms(self, full_ms: float, work: Work, share_infer: float, share_ft: float) -> float:
        check_share("share_infer", share_infer)
        check_share("share_ft", share_ft, allow_zero=True)
        if share_infer + share_ft > 1 + EPS:
            raise SimDeviceError(f"shares {share_infer} + {share_ft} exceed the device")
        solo = self._solo_ms(full_ms, work, share_infer)
        if share_ft <= 0:
            return solo
        # HARLI Eq. 4-5 on the part of the step that streams memory: f_infer is the step's own rate
        # there, f_ft the finetuning's average rate at its share.
        stream_ms = min(solo, work.bytes / self._read_bps * 1e3 * max(1.0, self.config.saturation_share / share_infer))
        f_infer = work.bytes / (stream_ms / 1e3)
        per_step = self.units.per_step
        f_ft = per_step.bytes / (self._ft_step_ms(round(share_ft, 6), 0.0) / 1e3)
        eq5 = max(1.0, (f_infer + f_ft) / self._hbm_bps)
        return (solo - stream_ms + stream_ms * eq5) * (1 + self.config.interference * share_ft)

    def decode_ms(self, batch: int, seqlen: float, share_infer: float = 1.0, share_ft: float = 0.0) -> float:
        """One decode step of `batch` sequences with mean context `seqlen`."""
        if batch < 1:
            raise SimDeviceError(f"a decode step needs at least one sequence, got {batch}")
        full_ms, work = self._decode_work(batch, seqlen)
        return self._colo_ms(full_ms, work, share_infer, share_ft)

    def prefill_ms(self, tokens: int, share_infer: float = 1.0, share_ft: float = 0.0) -> float:
        full_ms, work = self._prefill_work(tokens)
        return self._colo_ms(full_ms, work, share_infer, share_ft)

    # --- finetuning -------------------------------------------------------------------------------

    def ft_step_ms(self, share_ft: float, share_infer_busy: float = 0.0) -> float:
        """One training step with `share_ft` of the SMs while inference runs on `share_infer_busy`
        (0: nothing else runs). Infinite at share 0."""
        check_share("share_ft", share_ft, allow_zero=True)
        check_share("share_infer_busy", share_infer_busy, allow_zero=True)
        if share_ft <= 0:
            return math.inf
        return self._ft_step_ms(round(share_ft, 6), round(share_infer_busy, 6))

    def _ft_step_ms_uncached(self, share_ft: float, share_infer_busy: float) -> float:
        sat = self.config.saturation_share
        slow = 1 + self.config.interference * share_infer_busy
        bandwidth = self._read_bps * min(1.0, share_ft / sat)
        if share_infer_busy > 0:  # Eq. 4: demand beyond B is shared in proportion to demand
            decode_rate = self._read_bps * min(1.0, share_infer_busy / sat)
            if bandwidth + decode_rate > self._hbm_bps:
                bandwidth = self._hbm_bps * bandwidth / (bandwidth + decode_rate)
        total = 0.0
        for work, count in self.units.kinds():
            compute_s = work.flops / (self._peak_flops * self.config.ft_efficiency * share_ft) * slow
            total += count * max(compute_s, work.bytes / bandwidth)
        return total * 1e3

    def samples_per_s(self, share_ft: float = 1.0, share_infer_busy: float = 0.0) -> float:
        return self.units.samples / (self.ft_step_ms(share_ft, share_infer_busy) / 1e3)

    def drain_ms(self, share_ft: float) -> float:
        """Time an in-flight finetuning kernel holds its SMs after a pause, on average half the
        largest kernel (a pause stops launching; green contexts do not preempt a kernel)."""
        if share_ft <= 0:
            return 0.0
        return 0.5 * self.units.largest_kernel_flops / (self._peak_flops * self.config.ft_efficiency * share_ft) * 1e3

    def describe(self) -> dict:
        """The derived figures a reader checks the stated parameters against."""
        per_step = self.units.per_step
        return {"decode_bs1_ms": self.decode_ms(1, 256), "decode_bs64_ms": self.decode_ms(64, 256),
                "decode_bs1_ms_at_share": {f"{s / 10:.1f}": self.decode_ms(1, 256, s / 10) for s in range(1, 11)},
                "prefill_256_ms": self.prefill_ms(256),
                "ft_step_tflop": per_step.flops / 1e12, "ft_step_gb": per_step.bytes / 1e9,
                "ft_step_ms_full_device": self.ft_step_ms(1.0), "ft_samples_per_s_full_device": self.samples_per_s(1.0),
                "ft_drain_ms_full_device": self.drain_ms(1.0)}
