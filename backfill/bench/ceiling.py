"""The most offline throughput co-serving could have reached in a run, from the run's own figures.

Co-serving runs offline batches only while no online request is present (ConServe §4.2); while
online work is present, offline tokens only ride in its steps where the SLO budget leaves room.
The least engine time the online work can take is what it took alone: online-only's busy time.
The rest of the run is the most time offline batching can have, at the rate its batches ran. So,
riders aside, co-serving's offline tokens/s is at most

    (duration - online-only busy time) x offline-batching rate / duration.

Riders lift the bound only where an offline token costs a co-serving step less than it costs a
batch: on a GPU, where a decode step is bound by reading the weights, but not on a CPU, where a
rider costs more than a batch spends on a token (docs/coserving.md). Set against priority's offline tokens/s, the bound says whether a ratio target
is reachable on this machine at all, whatever the policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backfill.bench.report import ModeResult

ONLINE_STEP_MODE = "online"
BATCHING_STEP_MODE = "offline-batching"


@dataclass(frozen=True)
class OfflineCeiling:
    online_busy_s: float              # online-only's engine busy time
    duration_s: float                 # the co-serving run's length
    batching_tokens_per_s: float      # offline tokens per second of the co-serving run's batching steps
    ceiling_tokens_per_s: float       # the bound, riders aside
    measured_tokens_per_s: float      # what the co-serving run reached
    priority_tokens_per_s: float | None = None

    @property
    def ceiling_vs_priority(self) -> float | None:
        return self.ceiling_tokens_per_s / self.priority_tokens_per_s if self.priority_tokens_per_s else None

    @property
    def measured_vs_priority(self) -> float | None:
        return self.measured_tokens_per_s / self.priority_tokens_per_s if self.priority_tokens_per_s else None

    def to_dict(self) -> dict[str, float | None]:
        return {"online_busy_s": self.online_busy_s, "duration_s": self.duration_s,
                "batching_tokens_per_s": self.batching_tokens_per_s,
                "ceiling_tokens_per_s": self.ceiling_tokens_per_s,
                "measured_tokens_per_s": self.measured_tokens_per_s,
                "priority_tokens_per_s": self.priority_tokens_per_s,
                "ceiling_vs_priority": self.ceiling_vs_priority, "measured_vs_priority": self.measured_vs_priority}


def offline_ceilings(results: Mapping[str, ModeResult], *, alone: str = "online-only",
                     reference: str = "priority") -> dict[str, OfflineCeiling]:
    """The bound for every mode that ran offline batches (coserve and its variants)."""
    found = {mode: offline_ceiling(results, alone=alone, mode=mode, reference=reference)
             for mode in results if mode not in (alone, reference)}
    return {mode: c for mode, c in found.items() if c is not None}


def _busy(result: ModeResult) -> tuple[Mapping[str, float], Mapping[str, int]]:
    engine = result.config.get("engine") or {}
    return engine.get("mode_busy_s") or {}, engine.get("mode_offline_tokens") or {}


def offline_ceiling(results: Mapping[str, ModeResult], *, alone: str = "online-only", mode: str = "coserve",
                    reference: str = "priority") -> OfflineCeiling | None:
    """The bound for `mode`, from `alone`'s busy time and `mode`'s batching rate; None unless both
    runs are there with engine counters and `mode` ran offline batches."""
    if alone not in results or mode not in results:
        return None
    online_busy_s = _busy(results[alone])[0].get(ONLINE_STEP_MODE)
    busy_s, tokens = _busy(results[mode])
    batching_s = busy_s.get(BATCHING_STEP_MODE, 0.0)
    duration_s = results[mode].metrics.duration_s
    if online_busy_s is None or batching_s <= 0 or duration_s <= 0:
        return None
    rate = tokens.get(BATCHING_STEP_MODE, 0) / batching_s
    ceiling = max(duration_s - online_busy_s, 0.0) * rate / duration_s
    priority = results[reference].metrics.offline.tokens_per_s if reference in results else None
    return OfflineCeiling(online_busy_s, duration_s, rate, ceiling, results[mode].metrics.offline.tokens_per_s,
                          priority or None)
