"""Compute partitions: a unit of work (decode, finetuning) given a share of the device's compute,
and that unit's work run inside its share (HARLI §5-§6's mechanism; the policy that plans the
shares is backfill/policy/harli_sm.py).

A mechanism of the engine, below every policy: it never decides a share. A caller asks for a split
(`apply(share_infer, share_ft)`); the partitions round each share to what the device allows (whole
cores on a CPU, the driver's SM granularity on a GPU) and return the split they realised, and
`ft_shares()` lists every finetuning share they can realise, so a plan is made among those and
knows the rounding before it asks. Work is placed by `enter(unit)` on the calling thread: what that
thread runs next runs in the unit's partition.

Three forms, one interface:
  cores          CPU: each unit's thread pinned to cores of its own (sched_setaffinity on the
                 calling thread), with as many torch intra-op threads as it has cores (one: ops run
                 inline in the calling thread, so no OpenMP worker strays off its cores)
  green-context  CUDA: SM partitions made up front for every realisable split (torch's
                 green-context API where the installed torch has one, else the driver's
                 cuGreenCtx* through cuda.bindings; engine/green_context.py), each unit's kernels
                 issued on its partition's stream
  time-sliced    neither exists: the units share every core or SM in turn, the portable form;
                 choosing it is logged, since the gain of HARLI §5 needs the other two
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Protocol

from backfill.errors import PolicyInputError


UNITS = ("decode", "finetune")
# The longest decode waits for a finetuning unit in flight on every core (a unit takes tens of ms).
UNIT_WAIT_S = 1.0
FORMS = ("cores", "green-context", "time-sliced")
EPS = 1e-9


@dataclass(frozen=True)
class RealisedSplit:
    """The shares a partitioning gave, after rounding (each in [0, 1], summing to at most 1)."""

    share_infer: float
    share_ft: float
    form: str
    detail: str = ""   # e.g. "decode cores [0], finetune cores [1]" or "decode 116 SMs, finetune 16 SMs"


class ComputePartitions(Protocol):
    form: str

    def ft_shares(self) -> tuple[float, ...]:
        """Every finetuning share strictly between 0 and 1 these partitions realise, ascending,
        decode holding the rest (a plan's candidates)."""
        ...

    def round_split(self, share_infer: float, share_ft: float) -> RealisedSplit:
        """The split `apply` would realise for these shares, without applying it."""
        ...

    def apply(self, share_infer: float, share_ft: float) -> RealisedSplit:
        """Make this split current; work entered afterwards runs in it. A unit's work already
        running finishes where it started (a kernel or unit in flight is not moved)."""
        ...

    def enter(self, unit: str) -> None:
        """Run the calling thread's next work in the unit's current partition."""
        ...

    def leave(self, unit: str) -> None:
        """The calling thread's work for the unit has ended (a finetuning unit in flight is done):
        what it held is free for the other unit's next `enter`."""
        ...

    def close(self) -> None:
        ...


def _check_unit(unit: str) -> None:
    if unit not in UNITS:
        raise PolicyInputError(f"unknown compute unit {unit!r}; choose {', '.join(UNITS)}")


def _check_shares(share_infer: float, share_ft: float) -> None:
    for name, value in (("share_infer", share_infer), ("share_ft", share_ft)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1 + EPS:
            raise PolicyInputError(f"{name} must be in [0, 1], got {value!r}")
    if share_infer + share_ft > 1 + EPS:
        raise PolicyInputError(f"shares {share_infer} + {share_ft} exceed the device")


def round_to_units(share_infer: float, share_ft: float, total: int, step: int = 1) -> tuple[int, int]:
    """Whole units (cores, SMs in groups of `step`) for a split of `total`: each share to the
    nearest multiple of step, a positive share never to nothing while the other share leaves room,
    and the two together never more than total (decode keeps its rounding; finetuning gets at most
    the rest). Returns (units for decode, units for finetuning)."""
    _check_shares(share_infer, share_ft)
    if total < 1 or step < 1:
        raise PolicyInputError(f"a partition needs total >= 1 and step >= 1, got {total}, {step}")
    groups = total // step
    remainder = total - groups * step  # SMs below one group: to decode, or to finetuning alone

    def nearest(share: float) -> int:
        g = int(share * groups + 0.5)
        return max(g, 1) if share > EPS else 0

    g_inf, g_ft = nearest(share_infer), nearest(share_ft)
    if g_inf + g_ft > groups:
        g_ft = max(groups - g_inf, 0)
    infer = g_inf * step + (remainder if g_inf else 0)
    ft = g_ft * step + (remainder if g_ft and not g_inf else 0)
    return infer, ft


# --- CPU: core partitions -------------------------------------------------------------------------


class CorePartitions:
    """Decode and finetuning threads on cores of their own (HARLI's SM partitions, CPU form).

    A unit with k cores runs k torch intra-op threads. Linux only (sched_setaffinity with pid 0
    sets the calling thread). Before a thread is first pinned its OpenMP pool is started on every
    core, so a pool worker (which inherits its creator's mask) may later serve that thread on
    whichever cores it is given."""

    form = "cores"

    def __init__(self, cores: list[int] | None = None, max_threads: int | None = None) -> None:
        """max_threads caps a unit's intra-op threads (a tiny model gains nothing from a second
        one, and on a loaded machine OpenMP's barriers cost it seconds)."""
        if max_threads is not None and max_threads < 1:
            raise PolicyInputError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        if not hasattr(os, "sched_setaffinity"):
            raise PolicyInputError("core partitions need sched_setaffinity (Linux)")
        self.cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
        if len(self.cores) < 2:
            raise PolicyInputError(f"core partitions need at least 2 cores, have {self.cores}")
        self._lock = threading.Lock()
        self._unit_ended = threading.Condition(self._lock)
        self._assigned = {"decode": list(self.cores), "finetune": list(self.cores)}
        self._finetuning_on: list[int] | None = None  # the cores a finetuning unit in flight holds
        self._warmed: set[int] = set()
        self.current = RealisedSplit(1.0, 0.0, self.form, self._detail())

    def ft_shares(self) -> tuple[float, ...]:
        n = len(self.cores)
        return tuple(k / n for k in range(1, n))

    def round_split(self, share_infer: float, share_ft: float) -> RealisedSplit:
        infer, ft = round_to_units(share_infer, share_ft, len(self.cores))
        n = len(self.cores)
        return RealisedSplit(infer / n, ft / n, self.form,
                             f"decode cores {self.cores[:infer]}, finetune cores {self.cores[n - ft:] if ft else []}")

    def apply(self, share_infer: float, share_ft: float) -> RealisedSplit:
        infer, ft = round_to_units(share_infer, share_ft, len(self.cores))
        n = len(self.cores)
        with self._lock:
            # A unit with no share keeps every core: it runs nothing the plan counts (decode while
            # none runs; finetuning is paused by its driver), and an arrival's prefill that comes
            # before the next plan must not be squeezed onto one core.
            self._assigned = {"decode": self.cores[:infer] or list(self.cores),
                              "finetune": self.cores[n - ft:] if ft else list(self.cores)}
            self.current = RealisedSplit(infer / n, ft / n, self.form, self._detail())
            return self.current

    def cores_of(self, unit: str) -> list[int]:
        _check_unit(unit)
        with self._lock:
            return list(self._assigned[unit])

    def enter(self, unit: str) -> None:
        import torch

        _check_unit(unit)
        with self._lock:
            if unit == "decode":
                # A unit in flight on every core decode is given: wait for it to end, as
                # pause-only's decode waits for the unit on its own thread (one unit's time at
                # most). A unit on some of them only is not waited for: decode takes the others,
                # since plans switch at every step and a wait at each switch costs more.
                self._unit_ended.wait_for(lambda: not self._finetuning_holds_all_decode_cores(), timeout=UNIT_WAIT_S)
            cores = self._placement(unit)
            if unit == "finetune":
                self._finetuning_on = cores
        ident = threading.get_ident()
        if ident not in self._warmed:
            self._warm_pool()
            self._warmed.add(ident)
        os.sched_setaffinity(0, cores)
        threads = min(len(cores), self.max_threads or len(cores))
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def leave(self, unit: str) -> None:
        _check_unit(unit)
        with self._lock:
            if unit == "finetune":
                self._finetuning_on = None
                self._unit_ended.notify_all()

    def _finetuning_holds_all_decode_cores(self) -> bool:
        held = self._finetuning_on
        return held is not None and set(self._assigned["decode"]) <= set(held)

    def _placement(self, unit: str) -> list[int]:
        """The unit's cores less those a finetuning unit in flight still holds: a split that gives
        decode every core takes effect once that unit ends. Until then decode's OpenMP threads
        would share a core with it, and every parallel region would wait at its barrier for the
        thread the scheduler left out (steps several times as long). Never empty: decode
        keeps its first core if the unit still holds all of them past the wait in enter."""
        cores = list(self._assigned[unit])
        if unit == "decode" and self._finetuning_on is not None:
            free = [c for c in cores if c not in self._finetuning_on]
            cores = free or cores[:1]
        return cores

    def _warm_pool(self) -> None:
        """Start this thread's OpenMP pool while it may run anywhere (its workers inherit that)."""
        import torch

        os.sched_setaffinity(0, self.cores)
        torch.set_num_threads(min(len(self.cores), self.max_threads or len(self.cores)))
        torch.ones(1 << 18).mul_(2.0).sum()  # above ATen's grain size: a parallel region runs

    def release(self) -> None:
        """The calling thread back on every core (the partitions' own)."""
        os.sched_setaffinity(0, self.cores)

    def _detail(self) -> str:
        return f"decode cores {self._assigned['decode']}, finetune cores {self._assigned['finetune']}"

    def close(self) -> None:
        pass


class TimeSliced:
    """No partitions: both units on every core or SM, in turn (the portable form)."""

    form = "time-sliced"

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.current = RealisedSplit(1.0, 0.0, self.form, reason)

    def ft_shares(self) -> tuple[float, ...]:
        return ()

    def round_split(self, share_infer: float, share_ft: float) -> RealisedSplit:
        _check_shares(share_infer, share_ft)
        # Nothing to split: a unit either runs (on everything) or waits.
        return RealisedSplit(1.0 if share_infer > EPS else 0.0, 1.0 if share_infer <= EPS and share_ft > EPS else 0.0,
                             self.form, self.reason)

    def apply(self, share_infer: float, share_ft: float) -> RealisedSplit:
        self.current = self.round_split(share_infer, share_ft)
        return self.current

    def enter(self, unit: str) -> None:
        _check_unit(unit)

    def leave(self, unit: str) -> None:
        _check_unit(unit)

    def close(self) -> None:
        pass


__all__ = ["FORMS", "UNITS", "ComputePartitions", "CorePartitions", "RealisedSplit", "TimeSliced",
           "round_to_units"]
