"""HARLI §5's profiling, run on the simulated device: the policy plans with this fit, never with
the simulator's ground truth.

Stage 1 (§5.1, §8.8): decode at each SM share 0.1 ... 1.0, batch sizes 4, 16, 64 and contexts up
to 512, one Eq. 2 fit per share. Stage 2 (§5.2.1): decode co-located with finetuning on the
splits the policy chooses among (share_infer + share_ft = 1), one Eq. 3 fit (b1, k1) over them.
Stage 1 is fitted and evaluated at the CUDA-graph bucket each batch is replayed at, as the engine
runs it. Each point is the median of a few noisy steps, as a profiler on a real device would take; the
errors are reported on the grid and on held-out points the fit never saw (random batch sizes
1-64, contexts 16-512 and splits).
"""

from __future__ import annotations

import math

import numpy as np

from backfill.bench.sim.sm_device import SimulatedDevice
from backfill.policy.harli import HarliLatencyModel
from backfill.policy.harli_sm import share_grid

BATCHES = (4, 16, 64)          # HARLI §8.8: three representative batch sizes
CONTEXTS = (64, 128, 256, 512)  # HARLI §8.8: sequence lengths up to 512
COLO_CONTEXTS = (128, 512)
REPEATS = 3
HELD_OUT = 200


class NoisyDevice:
    """The device as a profiler or the simulator sees it: every step times lognormal noise."""

    def __init__(self, device: SimulatedDevice, rng: np.random.Generator) -> None:
        self.device = device
        self.rng = rng
        cv = device.config.noise_cv
        self.sigma = math.sqrt(math.log(1 + cv ** 2))

    def noisy(self, ms: float) -> float:
        if self.sigma == 0:
            return ms
        return ms * float(self.rng.lognormal(-self.sigma ** 2 / 2, self.sigma))

    def measure(self, ms: float, repeats: int = REPEATS) -> float:
        return float(np.median([self.noisy(ms) for _ in range(repeats)]))


def profile_device(device: SimulatedDevice, seed: int = 0) -> HarliLatencyModel:
    """Stage 1 and 2 fitted on noisy measurements of `device`; errors in `.errors`."""
    from backfill.engine.cuda_graphs import BATCH_BUCKETS  # the buckets the measured steps were replayed at

    probe = NoisyDevice(device, np.random.default_rng(seed))
    shares = (*share_grid(), 1.0)
    solo = [(s, bs, ctx, probe.measure(device.decode_ms(bs, ctx, s))) for s in shares for bs in BATCHES
            for ctx in CONTEXTS]
    # Stage 1 at the CUDA-graph bucket a decode is replayed at, as the engine runs it (ModelRunner.decode_run_batches).
    model = HarliLatencyModel(HarliLatencyModel.fit_solo(solo, BATCH_BUCKETS), model_name="llama3-8b-shape",
                              device="simulated-h200-sm", run_batches=BATCH_BUCKETS)
    colo = [(bs, ctx, round(1 - f, 6), f, probe.measure(device.decode_ms(bs, ctx, round(1 - f, 6), f)))
            for f in share_grid() for bs in BATCHES for ctx in COLO_CONTEXTS]
    model.fit_colo(colo)
    rng = np.random.default_rng(seed + 1)
    held_solo, held_colo = [], []
    for _ in range(HELD_OUT):
        bs, ctx = int(rng.integers(1, 65)), float(rng.integers(16, 513))
        share = float(rng.choice(shares))
        held_solo.append((share, bs, ctx, probe.measure(device.decode_ms(bs, ctx, share))))
        f = float(rng.choice(share_grid()))
        held_colo.append((bs, ctx, round(1 - f, 6), f, probe.measure(device.decode_ms(bs, ctx, round(1 - f, 6), f))))
    model.errors = {"stage1_grid": model.solo_errors(solo), "stage2_grid": model.relative_errors(colo),
                    "stage1_held_out": model.solo_errors(held_solo), "stage2_held_out": model.relative_errors(held_colo)}
    return model
