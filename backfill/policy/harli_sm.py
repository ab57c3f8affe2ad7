"""HARLI's QoS scheduler over SM shares (§6.2), the device form's policy, and its baselines (§8.1).

A plain object over a state snapshot: `plan(ColoState) -> SmSplit`, the SM shares inference and
finetuning get until the next decode step or arrival. The predictor is HARLI's two-stage model
(backfill/policy/harli.py) fitted per SM share: stage 1 `Lat_dec(share)`, stage 2 Eq. 3.

Candidates are the splits in steps of 10% with share_infer + share_ft = 1: a finetuning share
leaves decode the rest, and more SMs never slow a step, so a split that leaves SMs idle is never
better for either task (HARLI §5.2.3 finds idle SMs useful only once bandwidth binds, which
Eq. 3 does not see).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from backfill.errors import PolicyInputError
from backfill.policy.harli import ColoState, HarliLatencyModel

SHARE_STEP = 0.1  # HARLI §5.2.1: a 10% granularity of SM partitioning
EPS = 1e-9


@dataclass(frozen=True)
class SmSplit:
    share_infer: float     # SMs decode (and prefill) run on; 0 while no decode runs
    share_ft: float        # SMs the finetuning job runs on; 0: paused
    predicted_ms: float    # predicted decode step under this split (inf: no decode to predict)
    reason: str

    def __post_init__(self) -> None:
        for name in ("share_infer", "share_ft"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1 + EPS:
                raise PolicyInputError(f"{name} must be in [0, 1], got {value!r}")
        if self.share_infer + self.share_ft > 1 + EPS:
            raise PolicyInputError(f"shares {self.share_infer} + {self.share_ft} exceed the device")


def share_grid(step: float = SHARE_STEP) -> tuple[float, ...]:
    """Finetuning shares step, 2 * step, ... below 1 (0.1 ... 0.9 at HARLI's granularity)."""
    if not 0 < step < 1:
        raise PolicyInputError(f"the share step must be in (0, 1), got {step}")
    n = round(1 / step)
    return tuple(round(k * step, 6) for k in range(1, n))


def _checked_shares(shares: tuple[float, ...]) -> tuple[float, ...]:
    out = tuple(sorted(float(x) for x in shares))
    if any(not 0 < x < 1 for x in out):
        raise PolicyInputError(f"finetuning shares must lie in (0, 1), got {shares!r}")
    return out


class HarliSmPolicy:
    """§6.2: predict the co-located decode step for each split, take the one predicted closest
    below the target (the largest finetuning share while predictions grow with it), pause
    finetuning when none fits, give inference every SM while finetuning is stalled."""

    name = "harli"

    def __init__(self, latency: HarliLatencyModel, headroom: float = 0.05, step: float = SHARE_STEP,
                 ft_shares: tuple[float, ...] | None = None) -> None:
        if not 0 <= headroom < 1:
            raise PolicyInputError(f"headroom must be in [0, 1), got {headroom}")
        self.latency = latency
        # Plan against the target less this share: the predictor errs by a few percent and the
        # QoS is a P99 (HARLI §8.4 reports < 5% mean error for stage 2).
        self.headroom = headroom
        # The finetuning shares the device realises (engine/compute_partition.py: whole cores, SM
        # groups), so a plan is made among the splits the mechanism will give, rounding known.
        self.ft_shares = share_grid(step) if ft_shares is None else _checked_shares(ft_shares)

    def plan(self, state: ColoState) -> SmSplit:
        if not state.finetune_ready:
            return SmSplit(1.0, 0.0, math.inf, "stalled: inference gets every SM")
        batch = state.decode_batch + state.waiting
        if batch == 0:
            return SmSplit(0.0, 1.0, math.inf, "no decode: finetuning gets every SM")
        if state.waiting:  # their prefill runs now, compute-bound and beyond what stage 1 models
            return SmSplit(1.0, 0.0, math.inf, "pause: arrivals' prefill first")
        seqlen = max(state.seqlen, 1.0)
        target = state.tpot_target_ms * (1 - self.headroom)
        solo = self.latency.colo_ms(batch, seqlen, 1.0, 0.0)
        if solo > target:
            return SmSplit(1.0, 0.0, solo, "pause: decode alone is predicted over the target")
        best = SmSplit(1.0, 0.0, solo, "pause: any finetuning share is predicted over the target")
        for share_ft in self.ft_shares:
            share_infer = 1.0 - share_ft  # unrounded: a realised share (k / SMs) and its rest sum to 1
            predicted = self.latency.colo_ms(batch, seqlen, share_infer, share_ft)
            if predicted <= target and predicted >= best.predicted_ms:
                best = SmSplit(share_infer, share_ft, predicted, "split closest below the target")
        return best


@dataclass(frozen=True)
class SplitCost:
    """A realisable split as the predictor sees it: decode's step beside finetuning there."""

    share_infer: float
    share_ft: float
    decode_ms: float       # stage 2: the decode step with finetuning on share_ft
    x_whole_device: float  # against decode alone on the whole device (stage 1 at share 1)


def split_costs(latency: HarliLatencyModel, ft_shares: tuple[float, ...], batch: float,
                seqlen: float) -> tuple[SplitCost, ...]:
    """Every split's predicted decode step against the whole device's, for a decode of `batch`
    sequences at `seqlen` of context. HARLI's gain needs a split whose slowdown the QoS allows
    (§5.1: decode is memory-bound, so fewer SMs barely slow it); where every split slows decode
    past the allowance, the planner pauses whenever decode runs and partitioning equals pause-only."""
    if batch < 1 or seqlen < 1:
        raise PolicyInputError(f"batch and seqlen must be >= 1, got {batch} and {seqlen}")
    whole = latency.solo_ms(batch, seqlen, 1.0)
    costs = []
    for share_ft in _checked_shares(ft_shares):
        decode_ms = latency.colo_ms(batch, seqlen, 1.0 - share_ft, share_ft)
        costs.append(SplitCost(round(1.0 - share_ft, 6), share_ft, decode_ms, decode_ms / whole))
    return tuple(costs)


class PauseOnlySmPolicy:
    """Baseline: finetuning on every SM while no decode runs, paused otherwise."""

    name = "pause-only"

    def plan(self, state: ColoState) -> SmSplit:
        if state.finetune_ready and state.decode_batch + state.waiting == 0:
            return SmSplit(0.0, 1.0, math.inf, "no decode")
        return SmSplit(1.0, 0.0, math.inf, "decode running: paused")


class StaticSmPolicy:
    """HARLI's StaticMode (§8.1): a fixed SM partition, inference at `share_infer` whatever the load."""

    name = "static"

    def __init__(self, share_infer: float = 0.6) -> None:
        if isinstance(share_infer, bool) or not isinstance(share_infer, (int, float)) or not 0 < share_infer < 1:
            raise PolicyInputError(f"share_infer must be in (0, 1), got {share_infer!r}")
        self.share_infer = share_infer

    def plan(self, state: ColoState) -> SmSplit:
        share_ft = 1.0 - self.share_infer if state.finetune_ready else 0.0
        return SmSplit(self.share_infer, share_ft, math.inf, "static partition")


class SoloSmPolicy:
    """The reference: inference alone on the device, no finetuning."""

    name = "solo"

    def plan(self, state: ColoState) -> SmSplit:
        return SmSplit(1.0, 0.0, math.inf, "solo")


def make_sm_policy(name: str, latency: HarliLatencyModel | None = None, static_share_infer: float = 0.6,
                   headroom: float = 0.05, ft_shares: tuple[float, ...] | None = None):
    """ft_shares: the finetuning shares the partitions realise (default: HARLI's 10% grid)."""
    if name == "harli":
        if latency is None:
            raise PolicyInputError("the harli policy needs a fitted latency model")
        return HarliSmPolicy(latency, headroom, ft_shares=ft_shares)
    if name == "pause-only":
        return PauseOnlySmPolicy()
    if name == "static":
        return StaticSmPolicy(static_share_infer)
    if name == "solo":
        return SoloSmPolicy()
    raise PolicyInputError(f"unknown SM co-location policy {name!r}; choose harli, pause-only, static or solo")
