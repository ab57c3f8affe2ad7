"""HARLI's two-stage latency predictor (§5) and QoS scheduler (§6), over a state snapshot.

Portable (CPU) form: the compute share is a share of TIME between decode steps. Finetuning runs
in whole scheduling units on the engine's thread between two decode steps, so a split
(share_infer, share_ft) with share_infer + share_ft = 1 means: of each token interval, decode
has share_infer and finetune units share_ft. Stage 1 (§5.1) is the solo decode latency per share
(the token interval when the rest of the time is left idle), `bs*b0 + c0 + bs*k0*seqlen` fitted
per share; stage 2 (§5.2) the co-located interval `(share_infer*b1 + share_ft*k1) * stage1`,
whose b1, k1 absorb what finetuning does to the decode step around it (caches, memory bandwidth).
On CPU that effect depends on the kind of unit before the step (an LM-head slice streams the
whole output embedding, a layer piece one layer's weights), so stage 2 keeps HARLI's form with one
k1 per unit kind, `(share_infer*b1 + sum_kind share_kind*k1_kind) * stage1`, where share_kind is
the share of the interval that units of that kind take.
Stage 1 is evaluated at the batch the engine's weight matmuls actually run (`run_batches`: the
CUDA-graph buckets, or the rows a CPU pads a small batch to; the engine says which, see
ModelRunner.decode_run_batches): `run(bs)*b0 + c0 + bs*k0*seqlen`. HARLI's form holds inside each
such regime; a step of 17 sequences replayed as a 32-sequence graph costs what 32 cost in its
weight term, while attention still reads 17 contexts (§5.1 sees the same padding steps).
The partitioned forms (CPU cores, SM partitions via CUDA green contexts: engine/compute_partition.py)
plan with policy/harli_sm.py over the shares the partitions realise.

The policies here are plain objects: `plan(ColoState) -> ColoPlan`, so the engine's background
slot (backfill/finetune/colocate.py), tests on constructed states and the simulator drive them alike.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from backfill.errors import LatencyProfileError, PolicyInputError

# The kinds of finetuning piece a scheduling unit is made of (backfill/finetune/job.py).
UNIT_KINDS = ("forward", "head", "backward", "update")
# 2: stage 2 with one k1 per unit kind (k1_kind); 3: stage 1 at the engine's run batch (run_batches).
# Files without a format field are format 1.
PROFILE_FORMAT = 3
READABLE_FORMATS = (1, 2, 3)

# A co-located point: (bs, seqlen, share_infer, share_ft, ms) or, with the finetuning time of each
# unit kind in the interval, (bs, seqlen, share_infer, share_ft, ms, {kind: ms}).


@dataclass(frozen=True)
class SoloFit:
    """Stage 1 at one compute share: Lat_dec = run*b0 + c0 + bs*k0*seqlen (ms), where run is the
    batch the engine's weight matmuls run at (the batch itself where it pads nothing)."""

    share: float
    b0: float
    c0: float
    k0: float

    def ms(self, batch: float, seqlen: float, run_batch: float | None = None) -> float:
        run = batch if run_batch is None else run_batch
        return run * self.b0 + self.c0 + batch * self.k0 * seqlen


def run_batch(batch: float, run_batches: tuple[int, ...]) -> float:
    """The batch a decode of `batch` sequences runs its weight matmuls at: the smallest of
    run_batches that holds it (a CUDA-graph bucket, a CPU's padded rows), else the batch itself
    (the engine runs a batch above every bucket as it is: cuda_graphs.batch_bucket)."""
    return next((float(r) for r in run_batches if r >= batch), float(batch))


@dataclass
class HarliLatencyModel:
    solo: tuple[SoloFit, ...]             # ascending share
    b1: float = 1.0
    k1: float = 1.0
    model_name: str = ""
    device: str = "cpu"
    errors: dict = field(default_factory=dict)  # {"grid": {"mean": .., "max": ..}, "held_out": {...}}
    unit_ms: dict = field(default_factory=dict)  # profiled finetuning piece times by kind (for the simulator)
    # Stage 2's k1 per unit kind; k1 is their average weighted by each kind's time in a training
    # step, used when the kinds are not known (and for every kind by a format-1 profile).
    k1_kind: dict = field(default_factory=dict)
    # The batch sizes the engine runs a decode's weight matmuls at (ascending); () pads nothing.
    run_batches: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.solo = tuple(sorted(self.solo, key=lambda f: f.share))
        if not self.solo:
            raise PolicyInputError("a HARLI latency model needs at least one solo fit")
        self.run_batches = _checked_run_batches(self.run_batches)

    @property
    def per_kind(self) -> bool:
        """Whether stage 2 was fitted per unit kind (a format-2 profile)."""
        return bool(self.k1_kind)

    def solo_ms(self, batch: float, seqlen: float, share_infer: float) -> float:
        """Stage 1; between two profiled shares, interpolated in 1 / share (time slices scale so)."""
        if not 0 < share_infer <= 1:
            raise PolicyInputError(f"share_infer must be in (0, 1], got {share_infer}")
        fits, run = self.solo, run_batch(batch, self.run_batches)
        if share_infer <= fits[0].share:
            return fits[0].ms(batch, seqlen, run) * fits[0].share / share_infer
        for lo, hi in zip(fits, fits[1:]):
            if share_infer <= hi.share:
                w = (1 / share_infer - 1 / hi.share) / (1 / lo.share - 1 / hi.share)
                return w * lo.ms(batch, seqlen, run) + (1 - w) * hi.ms(batch, seqlen, run)
        return fits[-1].ms(batch, seqlen, run)

    def colo_ms(self, batch: float, seqlen: float, share_infer: float, share_ft: float, *,
                ft_mix: Mapping[str, float] | None = None) -> float:
        """Stage 2 (HARLI eq. 3). ft_mix: the finetuning time of each unit kind in the interval (any
        unit, ms or weights); share_ft is split among the kinds in that proportion. Without it, or
        for a kind the profile has no k1 of, the kind-average k1."""
        return (share_infer * self.b1 + self._ft_term(share_ft, ft_mix)) * self.solo_ms(batch, seqlen, share_infer)

    def _ft_term(self, share_ft: float, ft_mix: Mapping[str, float] | None) -> float:
        if not ft_mix:
            return share_ft * self.k1
        if any(w < 0 for w in ft_mix.values()) or not sum(ft_mix.values()) > 0:
            raise PolicyInputError(f"ft_mix must hold non-negative times with a positive sum, got {dict(ft_mix)}")
        total = sum(ft_mix.values())
        return share_ft * sum(w / total * self.k1_kind.get(kind, self.k1) for kind, w in ft_mix.items())

    # --- fitting ----------------------------------------------------------------------------------

    @staticmethod
    def fit_solo(points: list[tuple[float, float, float, float]],
                 run_batches: tuple[int, ...] = ()) -> tuple[SoloFit, ...]:
        """Least squares per share over (share, bs, seqlen, ms) points, each point's weight term
        at the batch the engine runs it at (run_batches, as the model evaluates it)."""
        run_batches = _checked_run_batches(run_batches)
        fits = []
        for share in sorted({p[0] for p in points}):
            rows = [p for p in points if p[0] == share]
            a = np.array([[run_batch(bs, run_batches), 1.0, bs * seq] for _, bs, seq, _ in rows])
            y = np.array([ms for *_, ms in rows])
            (b0, c0, k0), *_ = np.linalg.lstsq(a, y, rcond=None)
            fits.append(SoloFit(share, float(b0), float(c0), float(k0)))
        return tuple(fits)

    def fit_colo(self, points: list[tuple], kind_weights: Mapping[str, float] | None = None) -> None:
        """b1 and k1 by least squares over co-located points, in relative error. Points that carry
        their kind mix (6-tuples) give one k1 per kind present (HARLI §5.2's form, a coefficient per
        kind); k1 is then their average weighted by kind_weights (each kind's time in a training
        step; default: its time over the points). Points without a mix give one k1, as in HARLI."""
        mixes = [p[5] if len(p) > 5 else None for p in points]
        if any(m is None for m in mixes) or not points:
            kinds: list[str] = []
        else:
            kinds = sorted({k for m in mixes for k, w in m.items() if w > 0}, key=_kind_order)
        a, y = [], []
        for point, mix in zip(points, mixes):
            bs, seq, s_inf, s_ft, ms = point[:5]
            solo = self.solo_ms(bs, seq, s_inf)
            row = [s_inf * solo / ms]  # rows scaled by 1/ms: relative residuals
            if kinds:
                total = sum(mix.values())
                row += [s_ft * mix.get(k, 0.0) / total * solo / ms for k in kinds]
            else:
                row.append(s_ft * solo / ms)
            a.append(row)
            y.append(1.0)
        if len(a) < 1 + max(1, len(kinds)):
            raise PolicyInputError(f"stage 2 needs at least {1 + max(1, len(kinds))} co-located points, got {len(a)}")
        coef, *_ = np.linalg.lstsq(np.array(a), np.array(y), rcond=None)
        self.b1 = float(coef[0])
        if not kinds:
            self.k1, self.k1_kind = float(coef[1]), {}
            return
        self.k1_kind = {k: float(c) for k, c in zip(kinds, coef[1:])}
        if kind_weights is None:
            kind_weights = {k: sum(m.get(k, 0.0) / sum(m.values()) * p[3] * p[4] for p, m in zip(points, mixes))
                            for k in kinds}
        weights = {k: kind_weights.get(k, 0.0) for k in kinds}
        if not sum(weights.values()) > 0:
            weights = dict.fromkeys(kinds, 1.0)
        self.k1 = sum(weights[k] * self.k1_kind[k] for k in kinds) / sum(weights.values())

    def relative_errors(self, points: list[tuple], *, use_mix: bool = True) -> dict:
        """Stage 2's mean and max |predicted - measured| / measured over co-located points (with
        each point's kind mix where it has one, unless use_mix is False: the kind-average)."""
        errors = []
        for p in points:
            mix = p[5] if use_mix and len(p) > 5 else None
            errors.append(abs(self.colo_ms(*p[:4], ft_mix=mix) - p[4]) / p[4])
        return _summary(errors)

    def solo_errors(self, points: list[tuple[float, float, float, float]]) -> dict:
        """Stage 1's error over solo points (share, bs, seqlen, ms), as HARLI §8.4 reports it."""
        return _summary([abs(self.solo_ms(bs, seq, share) - ms) / ms for share, bs, seq, ms in points])

    # --- files ------------------------------------------------------------------------------------

    def save(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"format": PROFILE_FORMAT, "solo": [asdict(f) for f in self.solo], "b1": self.b1, "k1": self.k1,
                "k1_kind": self.k1_kind, "model_name": self.model_name, "device": self.device,
                "errors": self.errors, "unit_ms": self.unit_ms, "run_batches": list(self.run_batches)}
        path.write_text(json.dumps(data, indent=1))
        return path

    @classmethod
    def load(cls, path: Path) -> "HarliLatencyModel":
        """A saved profile. A format-1 file (no k1 per unit kind) loads with its single k1 used for
        every kind, a format-1 or -2 file (fitted at the batch itself) with no run batches; an
        unreadable one, or one of an unknown format, raises LatencyProfileError."""
        rerun = "re-run `backfill finetune profile`"
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise LatencyProfileError(f"HARLI profile {path} is unreadable ({exc}); {rerun}") from exc
        version = data.get("format", 1) if isinstance(data, dict) else None
        if version not in READABLE_FORMATS:
            raise LatencyProfileError(f"HARLI profile {path} has format {version!r}, this backfill reads "
                                      f"{', '.join(map(str, READABLE_FORMATS))}; {rerun}")
        try:
            return cls(tuple(SoloFit(**f) for f in data["solo"]), float(data["b1"]), float(data["k1"]),
                       data.get("model_name", ""), data.get("device", "cpu"), data.get("errors", {}),
                       data.get("unit_ms", {}), {str(k): float(v) for k, v in data.get("k1_kind", {}).items()},
                       tuple(int(b) for b in data.get("run_batches", ())))
        except (KeyError, TypeError, ValueError, AttributeError, PolicyInputError) as exc:
            raise LatencyProfileError(f"HARLI profile {path} is malformed ({exc!r}); {rerun}") from exc


def _checked_run_batches(run_batches) -> tuple[int, ...]:
    out = tuple(int(b) for b in run_batches)
    if any(b < 1 for b in out) or list(out) != sorted(set(out)):
        raise PolicyInputError(f"run_batches must be ascending positive batch sizes, got {run_batches!r}")
    return out


def _kind_order(kind: str) -> tuple[int, str]:
    return (UNIT_KINDS.index(kind) if kind in UNIT_KINDS else len(UNIT_KINDS), kind)


def _summary(errors: list[float]) -> dict:
    return {"mean": float(np.mean(errors)), "max": float(np.max(errors)), "points": len(errors)}


@dataclass(frozen=True)
class ColoState:
    """What a co-location policy sees at a decode step boundary or an arrival."""

    now_s: float
    decode_batch: int            # sequences decoding now
    waiting: int                 # requests admitted or queued but not decoding yet (arrivals)
    seqlen: float                # mean context length of the decoding sequences
    tpot_target_ms: float        # the decode QoS target
    finetune_ready: bool         # the job has work it can run now (memory granted, not finished)
    unit_ms: float               # the next finetune unit's expected duration
    # The job's next units in order, each as its pieces' (kind, expected ms); empty: unknown, so
    # every unit is taken to last unit_ms and stage 2 uses the kind-average.
    next_units: tuple[tuple[tuple[str, float], ...], ...] = ()


@dataclass(frozen=True)
class ColoPlan:
    units: int                   # finetune units to run before the next decode step (may be 0)
    share_ft: float              # the split chosen
    predicted_ms: float          # predicted token interval under that split (inf: no decode)
    reason: str


IDLE_UNITS = 1  # with no decode, one unit at a time: an arrival is looked at after every unit


class ColocationPolicy(Protocol):
    """What the finetuning driver (finetune/colocate.py) asks of a co-location policy; a policy
    subclasses this to inherit the defaults."""

    name: str
    # The most units one plan may run; the driver shows the policy that many of the job's next units,
    # piece by piece, so stage 2 predicts with the kinds that would run (HARLI §5.2). 0: it plans without.
    max_units_per_step: int = 0

    def plan(self, state: ColoState) -> ColoPlan:
        """How many finetune units run before the next decode step."""
        ...


class HarliPolicy(ColocationPolicy):
    """§6.2: predict, choose the split closest below the QoS target, pause before a violation,
    give inference everything when finetuning is stalled."""

    name = "harli"

    def __init__(self, latency: HarliLatencyModel, max_units_per_step: int = 8, headroom: float = 0.05) -> None:
        if not 0 <= headroom < 1:
            raise PolicyInputError(f"headroom must be in [0, 1), got {headroom}")
        self.latency = latency
        self.max_units_per_step = max_units_per_step
        # Plan against the target less this share: predictions carry a few percent of error and
        # step times noise, and the QoS is a P99 (HARLI §5 reports ~5% prediction error).
        self.headroom = headroom

    def plan(self, state: ColoState) -> ColoPlan:
        if not state.finetune_ready:
            return ColoPlan(0, 0.0, math.inf, "stalled: inference gets everything")
        batch = state.decode_batch + state.waiting
        if batch == 0:
            return ColoPlan(IDLE_UNITS, 1.0, math.inf, "no decode: finetune gets everything")
        if state.waiting:  # their prefill lands in this token interval, beyond what stage 1 models
            return ColoPlan(0, 0.0, math.inf, "pause: arrivals' prefill first")
        seqlen = max(state.seqlen, 1.0)
        target = state.tpot_target_ms * (1 - self.headroom)
        solo_step = self.latency.solo_ms(batch, seqlen, 1.0)
        best = ColoPlan(0, 0.0, self.latency.colo_ms(batch, seqlen, 1.0, 0.0), "pause: a unit would break QoS")
        if best.predicted_ms > target:
            return ColoPlan(0, 0.0, best.predicted_ms, "pause: decode alone is predicted over the target")
        unit = max(state.unit_ms, 1e-3)
        known = state.next_units[:self.max_units_per_step]
        ft_ms, mix = 0.0, {}
        # The splits whole units can realise in this token interval, fewest units first: the
        # largest whose predicted interval stays below the target is the one closest below it.
        # With the next units' kinds known, stage 2 predicts with the kinds that would run (§5.2).
        for n in range(1, (len(known) if known else self.max_units_per_step) + 1):
            if known:
                for kind, ms in known[n - 1]:
                    ft_ms += max(ms, 0.0)
                    mix[kind] = mix.get(kind, 0.0) + max(ms, 0.0)
                ft_ms = max(ft_ms, 1e-3)
            else:
                ft_ms = n * unit
            share_ft = ft_ms / (ft_ms + solo_step)
            predicted = self.latency.colo_ms(batch, seqlen, 1.0 - share_ft, share_ft,
                                             ft_mix=mix if sum(mix.values()) > 0 else None)
            if predicted > target:
                break
            best = ColoPlan(n, share_ft, predicted, "split closest below the target")
        return best


class PauseOnlyPolicy(ColocationPolicy):
    """Baseline: finetune only while no decode runs."""

    name = "pause-only"

    def plan(self, state: ColoState) -> ColoPlan:
        if state.finetune_ready and state.decode_batch + state.waiting == 0:
            return ColoPlan(IDLE_UNITS, 1.0, math.inf, "no decode")
        return ColoPlan(0, 0.0, math.inf, "decode running: paused")


class StaticSplitPolicy(ColocationPolicy):
    """Baseline (HARLI's StaticMode): a fixed time split, inference at `share_infer` whatever the
    load. Finetuning earns credit at share_ft of wall time and spends it on whole units."""

    name = "static"

    def __init__(self, share_infer: float = 0.6, max_credit_ms: float = 200.0) -> None:
        if not 0 < share_infer < 1:
            raise PolicyInputError(f"share_infer must be in (0, 1), got {share_infer}")
        self.share_ft = 1.0 - share_infer
        self.max_credit_ms = max_credit_ms
        self._credit_ms = 0.0
        self._last_s: float | None = None

    def plan(self, state: ColoState) -> ColoPlan:
        if self._last_s is not None:
            cap = max(self.max_credit_ms, 2 * state.unit_ms)  # a unit longer than the cap must still fit
            self._credit_ms = min(cap, self._credit_ms + (state.now_s - self._last_s) * 1e3 * self.share_ft)
        self._last_s = state.now_s
        if not state.finetune_ready or self._credit_ms < state.unit_ms:
            return ColoPlan(0, self.share_ft, math.inf, "static: no credit")
        units = int(self._credit_ms // max(state.unit_ms, 1e-3))
        self._credit_ms -= units * state.unit_ms
        return ColoPlan(units, self.share_ft, math.inf, "static split")


def make_colo_policy(name: str, latency: HarliLatencyModel | None = None, static_share_infer: float = 0.6):
    if name == "harli":
        if latency is None:
            raise PolicyInputError("the harli policy needs a fitted latency model (backfill profile finetune)")
        return HarliPolicy(latency)
    if name == "pause-only":
        return PauseOnlyPolicy()
    if name == "static":
        return StaticSplitPolicy(static_share_infer)
    raise PolicyInputError(f"unknown co-location policy {name!r}; choose harli, pause-only or static")
