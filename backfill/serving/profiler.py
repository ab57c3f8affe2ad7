"""Measures step latency on the real engine and fits a LatencyModel (ConServe §4.5 profiler).

It runs synthetic batches on the runner's own KV pool: prefill chunks of growing size for the
token table, batches of decoding sequences for the decode table, decode batches at two context
lengths for the per-context cost, and a chunk at two start positions for the prefill-attention
cost. Where the runner replays steps with prompt chunks from CUDA graphs (engine/cuda_graphs.py,
mixed steps), the token table is measured with them off (eager steps, as past the graphs' last
bucket) and the same chunks up to that bucket again with them on, for the mixed table. The result
is saved and reloaded at start, so serving does not pay for profiling twice.
"""

from __future__ import annotations

import logging
import statistics

from backfill.engine.runner import ModelRunner
from backfill.engine.step import SeqChunk
from backfill.policy.latency_model import LatencyModel
from backfill.progress import Heartbeat

log = logging.getLogger(__name__)

# The token table: prefill chunks from position 0, for steps with prompt tokens in them.
DEFAULT_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# The decode table: batches of sequences decoding alone. Co-serving steps are online decodes plus a
# few offline ones, and they may run another path than any step with a prompt chunk: compiled
# decode on a CPU, CUDA graphs on a GPU, each well below an eager step of the same batch
# (docs/benchmarks.md). The policy must see what an offline token added to such a step costs,
# and the bench sizes its online load from it.
DEFAULT_DECODE_GRID = (1, 2, 3, 4, 8, 16, 32, 64)
# Saved profiles carry this in their file name: a changed grid or method, or steps that now run
# other kernels (large steps taking the kernel choice), measures anew.
PROFILE_FORMAT = 7
# A measurement further than this many median absolute deviations above the median is a stall
# (another process, a first call's allocation or kernel pick), not the step's cost.
OUTLIER_MADS = 3.0
# A table point this much slower than a bigger shape's is measured again before the monotone pass.
INVERSION_TOLERANCE = 1.25


def robust_ms(samples: list[float]) -> float:
    """The median of the samples left once outliers are dropped.

    A minimum takes the luckiest run and a mean takes the stalls; a median of the runs that agree
    is what the step costs. Only slow outliers exist on a shared machine, but a symmetric rule is
    no worse: it keeps at least half the samples."""
    if not samples:
        raise ValueError("robust_ms needs at least one sample")
    ordered = sorted(samples)
    median = statistics.median(ordered)
    mad = statistics.median(abs(x - median) for x in ordered)
    kept = [x for x in ordered if abs(x - median) <= OUTLIER_MADS * max(mad, 0.01 * median)]
    return statistics.median(kept)


def remeasure_inversions(values: list[float], measure_point, tolerance: float = INVERSION_TOLERANCE,
                         tries: int = 2) -> list[float]:
    """Measure again each point of a table that a bigger shape beats by more than `tolerance`: a
    point slowed as a whole (every repeat in a stall) would otherwise raise its neighbours in the
    monotone pass. The faster of the two measurements is kept."""
    out = list(values)
    for _ in range(tries):
        suspects = [i for i in range(len(out) - 1) if out[i] > tolerance * min(out[i + 1:])]
        if not suspects:
            break
        for i in suspects:
            out[i] = min(out[i], measure_point(i))
    return out


def _measured_ms(runner: ModelRunner, build, repeats: int, warmups: int) -> float:
    """A step shape's cost: warm-up runs first (a new shape's first runs pay for allocation, kernel
    selection or a graph capture), then the robust median of the repeats."""
    for _ in range(warmups):
        runner.execute(build())
    return robust_ms([runner.execute(build()).duration_s * 1e3 for _ in range(repeats)])


def profile_latency(runner: ModelRunner, *, grid: tuple[int, ...] = DEFAULT_GRID,
                    decode_grid: tuple[int, ...] = DEFAULT_DECODE_GRID, repeats: int = 7, warmups: int = 2,
                    model_name: str = "") -> LatencyModel:
    if repeats < 1 or warmups < 0:
        raise ValueError(f"profiling needs repeats >= 1 and warmups >= 0, got {repeats} and {warmups}")
    # A point (a 1,024-token chunk on a slow CPU) can take longer than a user waits for a line.
    with Heartbeat(log.info, "profiling step latency"):
        return _profile_latency(runner, grid, decode_grid, repeats, warmups, model_name)


def _profile_latency(runner: ModelRunner, grid: tuple[int, ...], decode_grid: tuple[int, ...], repeats: int,
                     warmups: int, model_name: str) -> LatencyModel:

    # Steps measured while compiled decode's buckets still compile on the same cores would cost
    # more than they will, and the buckets' sizes would be measured eager.
    runner.wait_until_warm()

    def measure(build) -> float:
        return _measured_ms(runner, build, repeats, warmups)

    kv = runner.kv
    max_len = runner.config.max_position_embeddings
    grid = tuple(n for n in grid if kv.blocks_needed(n) <= kv.num_usable and n < max_len)
    scratch: list[list[int]] = []

    def table(tokens: int) -> list[int]:
        t = kv.allocate(kv.blocks_needed(tokens))
        scratch.append(t)
        return t

    def decode(ctx: int, tables: list[list[int]]):
        return lambda: [SeqChunk(i, [5], ctx, t, want_logits=True) for i, t in enumerate(tables)]

    short_ctx, batch = 32, 8
    decode_grid = tuple(n for n in decode_grid if n * kv.blocks_needed(short_ctx + 1) <= kv.num_usable)
    try:
        steps = len(grid) + len(decode_grid) + 1

        def chunk_point(i: int) -> float:
            n = grid[i]
            log.info("profiling step latency %d/%d: a prefill chunk of %d tokens", i + 1, steps, n)
            t = table(max(n, short_ctx + 1))
            try:
                return measure(lambda: [SeqChunk("p", [5] * n, 0, t, want_logits=True)])
            finally:
                kv.free(scratch.pop())

        def decode_point(i: int) -> float:  # n sequences decoding; their context's attention is taken out below
            n = decode_grid[i]
            log.info("profiling step latency %d/%d: %d sequences decoding", len(grid) + i + 1, steps, n)
            tables = [table(short_ctx + 1) for _ in range(n)]
            try:
                return measure(decode(short_ctx, tables))
            finally:
                while scratch:
                    kv.free(scratch.pop())

        graphs = runner.decode_graphs
        mixed = graphs is not None and graphs.mixed
        if mixed:
            graphs.mixed = False  # the token table is eager steps
        try:
            step_ms = remeasure_inversions([chunk_point(i) for i in range(len(grid))], chunk_point)
        finally:
            if mixed:
                graphs.mixed = True
        decode_ms = remeasure_inversions([decode_point(i) for i in range(len(decode_grid))], decode_point)
        # Per-context cost of decode attention: 8 sequences decoding at short vs long context.
        log.info("profiling step latency %d/%d: attention cost per context token", steps, steps)
        long_ctx = min(1024, max_len - 2, kv.num_usable // (batch + 1) * kv.block_size - 1)
        tables = [table(long_ctx + 1) for _ in range(batch)]
        extra_ctx_tokens = batch * (long_ctx - short_ctx)
        d_ms = measure(decode(long_ctx, tables)) - measure(decode(short_ctx, tables))
        ms_per_kctx = max(0.0, d_ms / extra_ctx_tokens * 1e3) if extra_ctx_tokens > 0 else 0.0
        decode_ms = [max(0.0, ms - ms_per_kctx * n * (short_ctx + 1) / 1e3) for n, ms in zip(decode_grid, decode_ms)]
        # Prefill attention: the same chunk (64 tokens, less in a tiny pool) at position 0 and at the end of long_ctx.
        chunk = min(64, long_ctx // 2)
        t = tables[0]
        near = measure(lambda: [SeqChunk("a", [5] * chunk, 0, t)])
        far = measure(lambda: [SeqChunk("a", [5] * chunk, long_ctx - chunk, t)])
        extra_pairs = chunk * (long_ctx - chunk)
        ms_per_mpair = max(0.0, (far - near) / extra_pairs * 1e6) if extra_pairs > 0 else 0.0
        mixed_grid, mixed_ms = (), []
        if mixed:
            from backfill.engine.cuda_graphs import BATCH_BUCKETS

            # Graphed, a chunk's tokens are decode rows: their attention (n (n + 1) / 2 pairs from
            # position 0) is priced at ms_per_kctx by the model and taken out here.
            mixed_grid = tuple(n for n in grid if n <= BATCH_BUCKETS[-1])
            measured = remeasure_inversions([chunk_point(grid.index(n)) for n in mixed_grid],
                                            lambda i: chunk_point(grid.index(mixed_grid[i])))
            mixed_ms = [max(0.0, ms - ms_per_kctx * n * (n + 1) / 2 / 1e3) for n, ms in zip(mixed_grid, measured)]
    finally:
        for t in scratch:
            kv.free(t)
    if len(decode_grid) < 2:  # a pool too small for two decoding sequences: the token table alone
        decode_grid, decode_ms = (), []
    if len(mixed_grid) < 2:
        mixed_grid, mixed_ms = (), []
    return LatencyModel(grid, _monotone(step_ms), ms_per_kctx, ms_per_mpair, runner.device.type, model_name,
                        decode_grid, _monotone(decode_ms), mixed_grid, _monotone(mixed_ms))


def _monotone(step_ms: list[float]) -> tuple[float, ...]:
    """The closest non-decreasing table (least squares, pool-adjacent-violators): a bigger batch does
    not run faster, but a running maximum would carry one slow point across every larger size,
    where pooling averages it with its neighbours."""
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for ms in step_ms:
        blocks.append([ms, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    out: list[float] = []
    for total, count in blocks:
        out += [total / count] * int(count)
    return tuple(out)
