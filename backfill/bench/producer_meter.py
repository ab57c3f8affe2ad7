"""The producer's throughput, measured as AQUA §9.3 does (the producer with a consumer beside it
against the producer alone), from many short windows rather than one mean per mode: the
producer engine prints cumulative counters every half second, and a mode's rate is the median
over its one-second windows, so a few seconds of a neighbour's burst of work on the machine
move it little.

Each window also says where the producer's time went (the producer's report rows and the
producer core's /proc/stat line): milliseconds per engine step, the engine thread's own
compute per step (slower when the consumer contends for caches and memory bandwidth), the
share of the window it was runnable but waiting for its core (something else ran there), and
the core's time taken by other work, by nice-19 jobs and by the hypervisor (steal), and the
nice-19 jobs' share of the consumer's core (other people's work beside the producer).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from backfill.errors import WorkloadError

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

# Figures of a window, each a median over a mode's windows in `summarize`.
FIELDS = ("tokens_per_s", "step_ms", "run_ms_per_step", "wait_share", "core_other_share", "nice_share",
          "steal_share", "neighbour_nice_share")


def core_times(core: int, stat_path: str = "/proc/stat") -> dict[str, float] | None:
    """Seconds core has spent busy (not idle, iowait or stolen), on nice > 0 work, and stolen
    by the hypervisor; None where /proc/stat cannot be read."""
    try:
        with open(stat_path) as f:
            for line in f:
                name, *ticks = line.split()
                if name == f"cpu{core}":
                    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in ticks[:8])
                    return {"busy_s": (user + nice + system + irq + softirq) * _TICK_S, "nice_s": nice * _TICK_S,
                            "steal_s": steal * _TICK_S}
    except (OSError, ValueError):
        return None
    return None


@dataclass(frozen=True)
class Window:
    t: float                  # start, monotonic s
    wall_s: float
    tokens_per_s: float
    step_ms: float | None
    run_ms_per_step: float | None
    wait_share: float | None
    core_other_share: float | None
    nice_share: float | None
    steal_share: float | None
    neighbour_nice_share: float | None = None

    def compact(self) -> list:
        """[t, tokens/s, compute ms per step, wait share, neighbour's nice share] for a report."""
        return [round(x, 4) if x is not None else None
                for x in (self.t, self.tokens_per_s, self.run_ms_per_step, self.wait_share,
                          self.neighbour_nice_share)]


def windows(rows: list[dict], start: float, end: float, width_s: float = 1.0) -> list[Window]:
    """Consecutive, non-overlapping windows of about width_s inside [start, end], from the
    producer's cumulative report rows ({"t", "tokens"} and, where present, "steps", "run_s",
    "wait_s", "core": core_times of the producer's core at that moment and "neighbour": of the
    consumer's)."""
    if width_s <= 0:
        raise WorkloadError(f"window width must be positive, got {width_s}")
    inside = sorted((r for r in rows if start <= r["t"] <= end), key=lambda r: r["t"])
    out: list[Window] = []
    i = 0
    for j in range(1, len(inside)):
        a, b = inside[i], inside[j]
        wall = b["t"] - a["t"]
        if wall < width_s * 0.9:   # report times jitter around their period
            continue
        out.append(_window(a, b, wall))
        i = j
    return out


def _window(a: dict, b: dict, wall: float) -> Window:
    def delta(key: str) -> float | None:
        return b[key] - a[key] if key in a and key in b else None

    steps, run, wait = delta("steps"), delta("run_s"), delta("wait_s")
    ca, cb = a.get("core"), b.get("core")
    core = {k: cb[k] - ca[k] for k in ca} if ca and cb else None
    na, nb = a.get("neighbour"), b.get("neighbour")
    per_step = steps if steps else None
    return Window(
        t=a["t"], wall_s=wall, tokens_per_s=(b["tokens"] - a["tokens"]) / wall,
        step_ms=1e3 * wall / per_step if per_step else None,
        run_ms_per_step=1e3 * run / per_step if per_step and run is not None else None,
        wait_share=wait / wall if wait is not None else None,
        core_other_share=max(0.0, core["busy_s"] - run) / wall if core and run is not None else None,
        nice_share=core["nice_s"] / wall if core else None,
        steal_share=core["steal_s"] / wall if core else None,
        neighbour_nice_share=(nb["nice_s"] - na["nice_s"]) / wall if na and nb else None)


def summarize(ws: list[Window]) -> dict:
    """Medians over windows of every figure, with the window count and the rate's quartiles."""
    out: dict = {"windows": len(ws)}
    for name in FIELDS:
        values = [getattr(w, name) for w in ws if getattr(w, name) is not None]
        out[name] = float(np.median(values)) if values else None
    rates = [w.tokens_per_s for w in ws]
    out["tokens_per_s_q1_q3"] = [float(np.percentile(rates, 25)), float(np.percentile(rates, 75))] if rates else None
    return out


def loss(rate: float | None, baseline: float | None) -> float | None:
    """1 - rate / baseline (None when either is missing)."""
    return 1.0 - rate / baseline if rate and baseline else None
