"""Step latency as a function of batch shape, fitted from profiled runs (ConServe §4.5).

estimate_ms = interp(token_grid -> step_ms, tokens)
            + ms_per_kctx * (context tokens read by decode attention) / 1000
            + ms_per_mpair * (query x key pairs of prompt chunks against their earlier context) / 1e6

The token table is measured on chunks from position 0, so a chunk's attention within itself is in
the table already; only what a later chunk reads of the context before it is added (the profiler
measures ms_per_mpair as exactly that: a chunk far into a context against the same chunk at 0).

A table, not a formula: on a CPU the step time is flat while weight reads dominate and
linear once compute does, and a piecewise-linear table follows both without a model.

Steps of decodes alone (no prompt token) may run another path than steps with a prompt chunk:
CUDA graphs on a GPU (a graphed decode of a few sequences costs a fraction of any eager step), a
compiled decode on a CPU. When the profile has a decode table (decode_grid -> decode_ms, in
sequences), such steps up to its last point are read from it instead of the token table. Without
it, a GPU profile saw a second sequence turn a graphed decode into an eager step, and no offline
token could ever ride along an online decode there (docs/benchmarks.md, co-serving on the H100).

Steps with prompt tokens may replay graphs too (engine/cuda_graphs.py, mixed steps): every token of
such a step is a row of the decode attention, with its own context. When the profile has a mixed
table (mixed_grid -> mixed_ms, in tokens), steps with a prompt chunk up to its last point are read
from it, and all their attention, the chunks' within themselves included, is priced per (query,
key) pair at ms_per_kctx: the decode kernel's measured cost per row and context token.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from backfill.errors import BackfillError


@dataclass(frozen=True)
class BatchShape:
    num_tokens: int = 0
    decode_context_tokens: int = 0
    prefill_attention_pairs: int = 0   # all query x key pairs of prompt chunks (> 0: the step has one)
    prefill_context_pairs: int = 0     # those against context before the chunk (what the table lacks)

    def plus(self, num_new: int, start_pos: int) -> "BatchShape":
        """This shape with one more chunk of num_new tokens starting at start_pos."""
        if num_new == 1 and start_pos > 0:
            return BatchShape(self.num_tokens + 1, self.decode_context_tokens + start_pos + 1,
                              self.prefill_attention_pairs, self.prefill_context_pairs)
        pairs = num_new * start_pos + num_new * (num_new + 1) // 2
        return BatchShape(self.num_tokens + num_new, self.decode_context_tokens,
                          self.prefill_attention_pairs + pairs, self.prefill_context_pairs + num_new * start_pos)


def largest_chunk(estimate_ms: Callable[[BatchShape], float], base: BatchShape, budget_ms: float, start_pos: int,
                  limit: int) -> int:
    """Largest n <= limit such that base plus an n-token chunk at start_pos is estimated within
    budget_ms (a step's time grows with its tokens, so a binary search finds it)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate_ms(base.plus(mid, start_pos)) <= budget_ms:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class LatencyModel:
    token_grid: tuple[int, ...]
    step_ms: tuple[float, ...]
    ms_per_kctx: float = 0.0
    ms_per_mpair: float = 0.0
    device: str = "cpu"
    model_name: str = ""
    decode_grid: tuple[int, ...] = ()    # sequences decoding, alone in a step
    decode_ms: tuple[float, ...] = ()
    mixed_grid: tuple[int, ...] = ()     # tokens of a step with a prompt chunk, replayed from CUDA graphs
    mixed_ms: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.token_grid) != len(self.step_ms) or len(self.token_grid) < 2:
            raise BackfillError("latency model needs at least two (tokens, ms) points of equal count")
        if list(self.token_grid) != sorted(set(self.token_grid)):
            raise BackfillError("latency model token grid must be strictly increasing")
        if len(self.decode_grid) != len(self.decode_ms) or len(self.decode_grid) == 1:
            raise BackfillError("a latency model's decode table needs none or at least two (sequences, ms) points")
        if list(self.decode_grid) != sorted(set(self.decode_grid)):
            raise BackfillError("latency model decode grid must be strictly increasing")
        if len(self.mixed_grid) != len(self.mixed_ms) or len(self.mixed_grid) == 1:
            raise BackfillError("a latency model's mixed table needs none or at least two (tokens, ms) points")
        if list(self.mixed_grid) != sorted(set(self.mixed_grid)):
            raise BackfillError("latency model mixed grid must be strictly increasing")

    def without_mixed_graphs(self) -> "LatencyModel":
        """This profile for an engine whose steps with prompt chunks all run eagerly."""
        return replace(self, mixed_grid=(), mixed_ms=())

    def graphs_mixed(self, shape: BatchShape) -> bool:
        """Whether a step of this shape with prompt tokens replays the mixed-step graphs."""
        return bool(self.mixed_grid) and shape.prefill_attention_pairs > 0 and shape.num_tokens <= self.mixed_grid[-1]

    @staticmethod
    def _interp(grid: tuple[int, ...], ms: tuple[float, ...], tokens: int) -> float:
        if tokens <= grid[0]:
            return ms[0]
        i = min(bisect.bisect_left(grid, tokens), len(grid) - 1)
        x0, x1, y0, y1 = grid[i - 1], grid[i], ms[i - 1], ms[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)  # extrapolates past the last point

    def _base_ms(self, shape: BatchShape) -> float:
        if self.decode_grid and shape.prefill_attention_pairs == 0 and shape.num_tokens <= self.decode_grid[-1]:
            return self._interp(self.decode_grid, self.decode_ms, shape.num_tokens)
        return self._interp(self.token_grid, self.step_ms, shape.num_tokens)

    def estimate_ms(self, shape: BatchShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        if self.graphs_mixed(shape):
            # Every prompt token attends as a decode row does: its pairs cost what context does.
            context = shape.decode_context_tokens + shape.prefill_attention_pairs
            return self._interp(self.mixed_grid, self.mixed_ms, shape.num_tokens) + self.ms_per_kctx * context / 1e3
        return (self._base_ms(shape) + self.ms_per_kctx * shape.decode_context_tokens / 1e3
                + self.ms_per_mpair * shape.prefill_context_pairs / 1e6)

    def max_new_tokens(self, base: BatchShape, budget_ms: float, start_pos: int, limit: int) -> int:
        """Largest n <= limit such that adding an n-token chunk at start_pos keeps the step within budget."""
        return largest_chunk(self.estimate_ms, base, budget_ms, start_pos, limit)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(path) + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "LatencyModel":
        try:
            raw = json.loads(Path(path).read_text())
            return cls(token_grid=tuple(int(x) for x in raw["token_grid"]),
                       step_ms=tuple(float(x) for x in raw["step_ms"]),
                       ms_per_kctx=float(raw.get("ms_per_kctx", 0.0)),
                       ms_per_mpair=float(raw.get("ms_per_mpair", 0.0)),
                       device=str(raw.get("device", "cpu")), model_name=str(raw.get("model_name", "")),
                       decode_grid=tuple(int(x) for x in raw.get("decode_grid", ())),
                       decode_ms=tuple(float(x) for x in raw.get("decode_ms", ())),
                       mixed_grid=tuple(int(x) for x in raw.get("mixed_grid", ())),
                       mixed_ms=tuple(float(x) for x in raw.get("mixed_ms", ())))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BackfillError(f"cannot read latency profile {path}: {exc}") from exc
