"""The knobs of `backfill sim finetune`: the simulated device's stated parameters and the scenario.

Every parameter of the simulated device that is not read from a measured file is a field here,
with the reason for its value beside it, and appears in the command's flags and in its JSON, so a
reader sees what the result rests on. Kept free of numpy at import so `--help` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from backfill.errors import SimDeviceError
from backfill.validation import check_int, check_positive
from backfill.options import knob


@dataclass(frozen=True)
class SmDeviceConfig:
    profile: str | None = knob(None, "full-device step-time profile JSON (decode and prefill); unset: the H200 "
                            "Llama-3-8B-shape profile shipped with backfill (bench/data/h200-llama3-8b/)")
    model_config: str | None = knob(None, "HF config.json of the model shape; unset: the Llama-3-8B shape shipped with backfill")
    # H200 SXM datasheet: 1,979 TFLOP/s bf16 with 2:4 sparsity, so 989 dense.
    peak_tflops: float = knob(989.0, "bf16 dense peak, TFLOP/s (H200 SXM datasheet)")
    # H200 datasheet: 4.8 TB/s HBM3e; B of HARLI Eq. 4-5.
    peak_hbm_tbps: float = knob(4.8, "HBM bandwidth B of HARLI Eq. 4-5, TB/s (H200 datasheet)")
    # Measured on the H200 (docs/gpu.md): what a streaming read reaches, below B by about the share
    # HARLI §2.2 finds decode uses.
    read_tbps: float = knob(4.1, "bandwidth a streaming kernel reaches, TB/s (measured on the H200)")
    # HARLI §2.2: decode keeps ~85% of DRAM bandwidth busy at ~40% SM utilisation, so about 40%
    # of the SMs already saturate HBM; below that its time grows as saturation_share / share.
    saturation_share: float = knob(0.4, "SM share at which decode saturates HBM (HARLI §2.2: ~40% SM "
                                        "utilisation at ~85% DRAM bandwidth)")
    # Measured on the H200 (docs/gpu.md): the share of peak a 512-token prefill's GEMMs reach.
    compute_efficiency: float = knob(0.47, "share of peak the engine's GEMMs reach (measured: a 512-token "
                                            "prefill in 15.7 ms on the H200, 465 TFLOP/s)")
    ft_efficiency: float = knob(0.42, "share of peak the finetuning units' GEMMs reach (stated: a little "
                                      "under the measured prefill, for LoRA's extra small kernels)")
    # HARLI §2.3: co-running finetuning slows decode by up to 40%; Eq. 3's k1 is linear in the
    # finetuning share, so 0.4 per whole share, beyond what Eq. 5's bandwidth sharing explains.
    interference: float = knob(0.4, "slowdown of one task per unit SM share of the other beyond bandwidth "
                                    "sharing (HARLI §2.3: up to 40%)")
    noise_cv: float = knob(0.03, "lognormal spread of every simulated step (stated)")
    # HARLI §8.2 and §4.5: batch size 2, sequence length 1024, for HARLI and StaticMode.
    ft_batch: int = knob(2, "finetuning samples per step (HARLI §8.2)")
    ft_seq_len: int = knob(1024, "tokens per finetuning sample (HARLI §4.5)")
    ft_rank: int = knob(8, "LoRA rank on q/k/v/o and the MLP projections (the job's default)")

    def __post_init__(self) -> None:
        for name in ("peak_tflops", "peak_hbm_tbps", "read_tbps"):
            check_positive(SimDeviceError, name, getattr(self, name))
        if self.read_tbps > self.peak_hbm_tbps:
            raise SimDeviceError(f"read_tbps {self.read_tbps} exceeds peak_hbm_tbps {self.peak_hbm_tbps}")
        for name in ("saturation_share", "compute_efficiency", "ft_efficiency"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise SimDeviceError(f"{name} must be in (0, 1], got {value!r}")
        if not isinstance(self.interference, (int, float)) or not 0 <= self.interference < 10:
            raise SimDeviceError(f"interference must be in [0, 10), got {self.interference!r}")
        if not isinstance(self.noise_cv, (int, float)) or not 0 <= self.noise_cv < 1:
            raise SimDeviceError(f"noise_cv must be in [0, 1), got {self.noise_cv!r}")
        for name in ("ft_batch", "ft_seq_len", "ft_rank"):
            check_int(SimDeviceError, name, getattr(self, name), 1)


@dataclass(frozen=True)
class SmSimScenario:
    duration_s: float = knob(300.0, "seconds of online trace per mode per seed", option="duration")
    online_load: float = 0.3  # set per run from --loads: arrivals as a fraction of one request's service time
    rounds: int = knob(5, "seeds per load (a fresh trace each); the table holds their medians")
    tpot_target_x_solo: float = knob(1.5, "the decode QoS target as a multiple of the first seed's solo P99 TPOT")
    static_share_infer: float = knob(0.6, "StaticMode's inference SM share (HARLI §8.1: 60%)")
    headroom: float = knob(0.05, "harli plans against the target less this share (prediction error, P99)")

    def __post_init__(self) -> None:
        check_positive(SimDeviceError, "duration_s", self.duration_s)
        if not 0 < self.online_load <= 1:
            raise SimDeviceError(f"online_load must be in (0, 1], got {self.online_load!r}")
        check_int(SimDeviceError, "rounds", self.rounds, 1)
        if not self.tpot_target_x_solo >= 1:
            raise SimDeviceError(f"tpot_target_x_solo must be >= 1, got {self.tpot_target_x_solo!r}")
        if not 0 < self.static_share_infer < 1:
            raise SimDeviceError(f"static_share_infer must be in (0, 1), got {self.static_share_infer!r}")
        if not 0 <= self.headroom < 1:
            raise SimDeviceError(f"headroom must be in [0, 1), got {self.headroom!r}")
