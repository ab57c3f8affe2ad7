"""Measures step latency on the real engine and fits a LatencyModel (ConServe §4.5 profiler).

It runs synthetic batches on the runner's own KV pool: small decode batches and prefill chunks
of growing size for the token table, decode batches at two context lengths for the per-context cost, and a
chunk at two start positions for the prefill-attention cost. The result is saved and
reloaded at start, so serving does not pay for profiling twice.
"""

from __future__ import annotations

from backfill.engine.runner import ModelRunner, SeqChunk
from backfill.policy.latency_model import LatencyModel

# Small steps at 1, 2 and 4 tokens: co-serving steps add offline tokens one at a time to a few
# online ones, and on a small machine two or three online requests often decode together. Points
# of a decode batch size the model compiles (and the 1-token point always) are timed as decodes,
# the others as prefill chunks from position 0: compiled decode takes its own, faster path (a lone
# bf16 decode 10-15 ms, two or three sequences 13-18, against the eager 21-25 on a 2-core CPU), and
# the profile must show that jump for the policy to see what an offline token added to it costs
# (and for the bench to size its online load from the real service time). Steps that small are
# nearly always decodes: a prefill chunk of two tokens is a rare tail.
DEFAULT_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Saved profiles carry this in their file name: a changed grid or method measures anew.
PROFILE_FORMAT = 4


def _best_ms(runner: ModelRunner, build, repeats: int) -> float:
    """Fastest of a few runs: a shared machine only ever adds time, and the scheduler corrects the
    profile from measured steps while it serves."""
    runner.execute(build())  # warm-up
    return min(runner.execute(build()).duration_s * 1e3 for _ in range(repeats))


def profile_latency(runner: ModelRunner, *, grid: tuple[int, ...] = DEFAULT_GRID, repeats: int = 5,
                    model_name: str = "") -> LatencyModel:
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
    compiled = runner.model.compiled_decode
    decode_points = {1, *(compiled.batch_sizes if compiled is not None else ())}
    try:
        step_ms = []
        for n in grid:
            if n in decode_points:  # n sequences decoding; their context's attention is taken out below
                tables = [table(short_ctx + 1) for _ in range(n)]
                step_ms.append(_best_ms(runner, decode(short_ctx, tables), repeats))
            else:
                t = table(max(n, short_ctx + 1))
                step_ms.append(_best_ms(runner, lambda: [SeqChunk("p", [5] * n, 0, t, want_logits=True)], repeats))
            while scratch:
                kv.free(scratch.pop())
        # Per-context cost of decode attention: 8 sequences decoding at short vs long context.
        long_ctx = min(1024, max_len - 2, kv.num_usable // (batch + 1) * kv.block_size - 1)
        tables = [table(long_ctx + 1) for _ in range(batch)]
        extra_ctx_tokens = batch * (long_ctx - short_ctx)
        d_ms = _best_ms(runner, decode(long_ctx, tables), repeats) - _best_ms(runner, decode(short_ctx, tables), repeats)
        ms_per_kctx = max(0.0, d_ms / extra_ctx_tokens * 1e3) if extra_ctx_tokens > 0 else 0.0
        for i, n in enumerate(grid):
            if n in decode_points:
                step_ms[i] = max(0.0, step_ms[i] - ms_per_kctx * n * (short_ctx + 1) / 1e3)
        # Prefill attention: the same chunk (64 tokens, less in a tiny pool) at position 0 and at the end of long_ctx.
        chunk = min(64, long_ctx // 2)
        t = tables[0]
        near = _best_ms(runner, lambda: [SeqChunk("a", [5] * chunk, 0, t)], repeats)
        far = _best_ms(runner, lambda: [SeqChunk("a", [5] * chunk, long_ctx - chunk, t)], repeats)
        extra_pairs = chunk * (long_ctx - chunk)
        ms_per_mpair = max(0.0, (far - near) / extra_pairs * 1e6) if extra_pairs > 0 else 0.0
    finally:
        for t in scratch:
            kv.free(t)
    # The table must not decrease: noise on a shared machine can make a bigger batch look faster.
    monotone = []
    for ms in step_ms:
        monotone.append(max(ms, monotone[-1]) if monotone else ms)
    return LatencyModel(grid, tuple(monotone), ms_per_kctx, ms_per_mpair, runner.device.type, model_name)
