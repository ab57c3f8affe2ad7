"""Which kernel multiplies each weight at each step size, chosen by timing both on this machine.

A CPU step's weight matmuls can run through three kernels: the small-batch kernel
(engine/small_batch_matmul.py) and, on a CPU with AMX tiles, its tile version, both fused inside
the compiled pieces; or the model's own `Linear` (engine/linear.py: oneDNN with a pre-packed
weight, which runs bf16 on AMX tiles where the CPU has them) called before a compiled piece that
does the rest. Which is faster depends on the CPU, not on a rule: on AVX-512 BF16 without AMX the
kernel matches oneDNN at every size, on AVX2 the kernel wins at a few rows, and on AMX the tiles
read a decode step's weights faster than oneDNN from a handful of rows up. So the first load on a
machine times each path at each step size the compiled pieces run (1 to the largest bucket) and
keeps the fastest; the table is cached per machine, model shape, dtype, thread count and kernel
source, and `backfill bench engine` and `backfill profile` print it.

Each path is timed as a step runs it: a pass over every layer's matmuls in order, then the LM
head, so each weight comes from memory as it does in a step. Timed on one weight again and again,
the weight sits in the core's cache, and the ranking is not a step's (docs/models.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from backfill.engine.native_build import cpu_key
from backfill.paths import cache_root

log = logging.getLogger(__name__)

SMALL_BATCH = "small-batch"
TILES = "tiles"
LINEAR = "linear"
PATHS = (SMALL_BATCH, TILES, LINEAR)
# The paths that run inside the compiled pieces, on the weights packed for them.
FUSED_PATHS = (SMALL_BATCH, TILES)
# A fused path saves a dispatch and a pass over the product; the Linear must be this much faster
# to be taken, so that timing noise between two equal kernels does not flip the choice.
LINEAR_MARGIN = 1.1
CHOICE_FORMAT = 3
# Steps past the compiled buckets (a burst's prompts, the next lines' questions beside decodes) run
# their matmuls at any row count. Where a count 8 past a multiple of 16 runs slower than the next
# multiple (oneDNN's AMX kernels take rows in 16-row tiles: on an Intel Xeon, 632 rows of a layer's
# matmuls took 1.35x the time of 640), such steps are padded to the multiple. Timed in these pairs.
LARGE_STEP_ROW_PAIRS = ((136, 144), (264, 272), (632, 640))
LARGE_STEP_ROW_MULTIPLE = 16
# How much faster the padded counts must be, by the geometric mean of the pairs' ratios: the
# penalty differs between counts (1.05x to 1.3x here), and the margin keeps noise from padding.
LARGE_STEP_MARGIN = 1.05


@dataclass
class KernelChoice:
    """Per weight name and step rows: each path's best time (µs) and the path taken."""

    times_us: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    linear_name: str = "linear"   # what the model's Linear runs (e.g. onednn-packed)
    # A layer's matmuls through the Linear at each of LARGE_STEP_ROW_PAIRS' row counts (µs).
    large_rows_us: dict[int, float] = field(default_factory=dict)

    @property
    def large_step_row_multiple(self) -> int:
        """What a large step's rows are padded to a multiple of: LARGE_STEP_ROW_MULTIPLE where the
        padded counts ran faster than the counts 8 below them by LARGE_STEP_MARGIN (the geometric
        mean over the pairs measured), else 1 (no padding)."""
        times = self.large_rows_us
        pairs = [(times.get(odd), times.get(padded)) for odd, padded in LARGE_STEP_ROW_PAIRS]
        if not times or any(odd is None or padded is None or padded <= 0 for odd, padded in pairs):
            return 1
        mean_ratio = math.prod(odd / padded for odd, padded in pairs) ** (1 / len(pairs))
        return LARGE_STEP_ROW_MULTIPLE if mean_ratio > LARGE_STEP_MARGIN else 1

    def path(self, name: str, rows: int) -> str:
        """The path for `name` at `rows`: the faster fused path, or the Linear where it beats that
        by LINEAR_MARGIN; small-batch where nothing was measured."""
        cell = self.times_us.get(name, {}).get(rows, {})
        fused = [path for path in FUSED_PATHS if path in cell]
        if not fused:
            return SMALL_BATCH
        best = min(fused, key=lambda path: cell[path])
        return LINEAR if LINEAR in cell and cell[LINEAR] * LINEAR_MARGIN < cell[best] else best

    def linear_names(self, rows: int) -> frozenset[str]:
        """The weights that run through the model's Linear at `rows`."""
        return frozenset(name for name in self.times_us if self.path(name, rows) == LINEAR)

    @property
    def digest(self) -> str:
        """Short key of the choices made (latency profiles depend on them)."""
        picks = sorted((name, rows, self.path(name, rows)) for name, cells in self.times_us.items() for rows in cells)
        return hashlib.sha256(json.dumps(picks).encode()).hexdigest()[:8]

    def step_matmul_ms(self, rows: int, layers: int) -> float | None:
        """A step's weight matmuls at `rows` through the chosen paths: every layer's four weights
        and the LM head, from the times measured (None where `rows` was not measured)."""
        total = 0.0
        for name, cells in self.times_us.items():
            cell = cells.get(rows)
            if cell is None:
                return None
            total += cell[self.path(name, rows)] * (1 if name == "lm_head" else layers)
        return total / 1e3 if self.times_us else None

    def table(self) -> list[dict]:
        """Rows for a report: weight, rows, each path's µs, the choice."""
        return [{"weight": name, "rows": rows, **{f"{p}_us": round(cell[p], 1) for p in PATHS if p in cell},
                 "choice": self.path(name, rows)}
                for name, cells in self.times_us.items() for rows, cell in sorted(cells.items())]

    def format(self) -> str:
        tiles = any(TILES in cell for cells in self.times_us.values() for cell in cells.values())
        lines = [f"{'weight':8s} {'rows':>5s} {'small-batch µs':>15s}" + (f" {'tiles µs':>10s}" if tiles else "")
                 + f" {self.linear_name + ' µs':>20s}  choice"]
        for row in self.table():
            lines.append(f"{row['weight']:8s} {row['rows']:5d} {row.get('small-batch_us', float('nan')):15.1f}"
                         + (f" {row.get('tiles_us', float('nan')):10.1f}" if tiles else "")
                         + f" {row.get('linear_us', float('nan')):20.1f}  {row['choice']}")
        if self.large_rows_us:
            pairs = ", ".join(f"{odd}: {self.large_rows_us.get(odd, float('nan')):.0f} / {padded}: "
                              f"{self.large_rows_us.get(padded, float('nan')):.0f}" for odd, padded in LARGE_STEP_ROW_PAIRS)
            multiple = self.large_step_row_multiple
            lines.append(f"a layer's matmuls at rows past the buckets, µs ({pairs}): "
                         + (f"rows padded to a multiple of {multiple}" if multiple > 1 else "rows as they come"))
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"format": CHOICE_FORMAT, "linear_name": self.linear_name,
                "times_us": {name: {str(rows): cell for rows, cell in cells.items()}
                             for name, cells in self.times_us.items()},
                "large_rows_us": {str(rows): t for rows, t in self.large_rows_us.items()}}

    @classmethod
    def from_json(cls, data: dict) -> KernelChoice:
        if data.get("format") != CHOICE_FORMAT:
            raise ValueError(f"kernel choice format {data.get('format')!r}, expected {CHOICE_FORMAT}")
        return cls({name: {int(rows): {p: float(t) for p, t in cell.items()} for rows, cell in cells.items()}
                    for name, cells in data["times_us"].items()}, data.get("linear_name", "linear"),
                   {int(rows): float(t) for rows, t in data.get("large_rows_us", {}).items()})


def _best_times_us(calls: dict[str, Callable[[], object]], budget_s: float) -> dict[str, float]:
    """Each call's fastest time over rounds that alternate between them (µs): _best_passes_us
    with a pass of one call."""
    best = _best_passes_us({name: [(name, call)] for name, call in calls.items()}, budget_s,
                           max_rounds=40, settled_rounds=4)
    return {name: times[name] for name, times in best.items()}


StepCalls = Callable[[str, int], list[tuple[str, Callable[[], object]]]]


def measure(step_calls: StepCalls, paths: tuple[str, ...], rows: tuple[int, ...], linear_name: str,
            one_thread: bool = True, budget_s: float = 1.5) -> KernelChoice:
    """Time each path at each step size as a step runs it.

    step_calls(path, rows) returns a step's matmuls through `path` on inputs of `rows` rows, in the
    order a step runs them (every layer's weights, then the LM head), as (weight name, call); a
    path leaves out the weights it does not take. Each weight's time is its mean over the layers
    in a pass, the fastest pass kept (µs). one_thread: time on one thread (the choice); else on
    the process's threads (a benchmark's matmul time on a quiet machine).
    """
    choice = KernelChoice({}, linear_name)
    # Timed on one thread: a shared machine stalls a multi-threaded call whenever any of its threads
    # is descheduled, but rarely a one-thread call from start to end; the kernels split the output
    # columns over threads alike, so the faster one on one thread is the faster one on all.
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if one_thread else threads)
    try:
        with torch.inference_mode():
            for n in rows:
                passes = {path: step_calls(path, n) for path in paths}
                for path, cells in _best_passes_us(passes, budget_s).items():
                    for name, t in cells.items():
                        choice.times_us.setdefault(name, {}).setdefault(n, {})[path] = t
    finally:
        torch.set_num_threads(threads)
    return choice


def _best_passes_us(passes: dict[str, list[tuple[str, Callable[[], object]]]], budget_s: float,
                    max_rounds: int = 12, settled_rounds: int = 3) -> dict[str, dict[str, float]]:
    """Per path, each weight's mean time over its calls in one pass, from the fastest of the passes
    that alternate between the paths (µs).

    The fastest, not the median: on a shared machine a pass is only ever slowed (an intra-op thread
    descheduled stalls the whole call), so the fastest is the kernels' own time. Rounds go on until
    no path's pass has got faster for `settled_rounds` rounds, or the budget is spent.
    """
    def one_pass(calls) -> dict[str, float]:
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for name, call in calls:
            started = time.perf_counter_ns()
            call()
            sums[name] = sums.get(name, 0.0) + (time.perf_counter_ns() - started) / 1e3
            counts[name] = counts.get(name, 0) + 1
        return {name: sums[name] / counts[name] for name in sums}

    for calls in passes.values():  # warm-up: first-touch of the inputs and the kernels' buffers
        one_pass(calls)
    best: dict[str, dict[str, float]] = {}
    best_total = {path: float("inf") for path in passes}
    deadline = time.perf_counter() + budget_s
    unchanged = 0
    for _ in range(max_rounds):
        improved = False
        for path, calls in passes.items():
            times = one_pass(calls)
            if sum(times.values()) < best_total[path]:
                improved = improved or best_total[path] != float("inf")
                best_total[path], best[path] = sum(times.values()), times
        unchanged = 0 if improved else unchanged + 1
        if unchanged >= settled_rounds or time.perf_counter() > deadline:
            break
    return best


def measure_large_rows(layer_at: Callable[[int], Callable[[], object]], one_thread: bool = True) -> dict[int, float]:
    """A layer's matmuls (layer_at(rows) returns the call) at each of LARGE_STEP_ROW_PAIRS' row
    counts, in alternating rounds, on one thread as the choice is (µs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if one_thread else threads)
    try:
        with torch.inference_mode():
            calls = {str(rows): layer_at(rows) for pair in LARGE_STEP_ROW_PAIRS for rows in pair}
            best = _best_times_us(calls, budget_s=3.0)
    finally:
        torch.set_num_threads(threads)
    return {int(rows): t for rows, t in best.items()}


def cache_path(signature: dict) -> Path:
    """Where the choice for this machine, model shape, dtype and kernels is kept."""
    key = dict(signature, cpu=cpu_key(), torch=torch.__version__, isa=torch.backends.cpu.get_cpu_capability())
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "kernel-choice" / f"{digest}.json"


def load_or_measure(signature: dict, measure_now: Callable[[], KernelChoice]) -> KernelChoice:
    """The cached choice for this signature, else one measured now and saved."""
    path = cache_path(signature)
    if path.exists():
        try:
            return KernelChoice.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:  # stale or damaged: measure again
            log.warning("kernel choice at %s unreadable (%s); measuring again", path, exc)
    log.info("timing the small-batch kernel against the model's matmuls at each step size (once per machine)")
    started = time.perf_counter()
    choice = measure_now()
    log.info("kernel choice measured in %.1f s; saved to %s", time.perf_counter() - started, path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(choice.to_json(), indent=1))
        tmp.replace(path)
    except OSError as exc:  # a read-only cache still serves: the choice holds for this process
        log.warning("cannot save the kernel choice to %s: %s", path, exc)
    return choice
