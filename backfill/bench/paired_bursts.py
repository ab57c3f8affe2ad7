"""Paired, interleaved bursts: the server over HTTP and the engine in-process, from one process.

    python -m backfill.bench.paired_bursts --url http://127.0.0.1:8000 --server-pid PID --pairs 8 \\
        --dtype bfloat16 --compile-decode --json paired.json

Measuring two targets one after the other, minutes apart, compares two states of a shared
machine as much as two targets. Here one process holds the engine in-process (the same build and
flags as the server) and drives the server over HTTP too, and at each level alternates single
bursts between them: pair i runs A then B when i is even, B then A when it is odd (ABBA), so a
drift within a level lands on both arms alike, with `settle_s` of idle between bursts (an idle
engine's OpenMP threads spin for a while after the last step, on the cores the next burst needs).
Per level the figure is the median over pairs of each pair's ratio (A's tok/s over B's, A's P50
TPOT over B's), with a distribution-free interval for that median from order statistics.

CPU is counted per burst and pooled per arm: this process's main thread (with --url: the load
generator's event loop, which shares the cores with the server), the whole process, and, given
--server-pid, the server's process and its main thread (its event loop). --arms in-process
in-process runs both arms on the one in-process engine: what the design gives when the two arms
are the same (about 1.00, within the interval).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from backfill.bench.concurrency_burst import (DEFAULT_LEVELS, BurstShape, LevelResult, burst_workload, level_result,
                                              process_cpu_s)
from backfill.bench.driver import run_workload
from backfill.bench.prompts import PromptSource
from backfill.bench.target import Target
from backfill.errors import WorkloadError

ARMS = ("http", "in-process")
CLIENT_LOOPS = ("auto", "uvloop", "asyncio")


@dataclass(frozen=True)
class MedianInterval:
    median: float
    low: float
    high: float
    coverage: float   # the interval's exact confidence (order statistics of n values)
    n: int


def median_interval(values: Sequence[float], level: float = 0.95) -> MedianInterval:
    """The median with the distribution-free interval [x(k), x(n+1-k)] (sorted values, 1-based):
    the widest k whose coverage 1 - 2 P(Binomial(n, 1/2) < k) is still >= level. Too few values for
    `level` (under 6 for 95%): the full range, with the coverage it has."""
    xs = sorted(float(v) for v in values)
    n = len(xs)
    if n < 1 or any(math.isnan(v) for v in xs):
        raise WorkloadError(f"need at least one value and no NaN for a median interval, got {values!r}")
    if not 0.0 < level < 1.0:
        raise WorkloadError(f"level must be in (0, 1), got {level}")

    def coverage(k: int) -> float:
        return 1.0 - 2.0 * sum(math.comb(n, j) for j in range(k)) / 2.0**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return MedianInterval(statistics.median(xs), xs[k - 1], xs[n - k], coverage(k), n)


def pair_order(index: int) -> tuple[str, str]:
    """ABBA: pair 0 runs A first, pair 1 B first, and so on."""
    return ("a", "b") if index % 2 == 0 else ("b", "a")


@dataclass(frozen=True)
class Pair:
    first: str        # "a" or "b": which arm ran first in this pair
    a: LevelResult    # one burst of each arm
    b: LevelResult


def _ratio(x: float, y: float) -> float:
    return x / y if y > 0 and not math.isnan(x) and not math.isnan(y) else float("nan")


def _per_token_ms(results: Sequence[LevelResult], field: str) -> float | None:
    values = [getattr(r, field) for r in results]
    tokens = sum(r.output_tokens for r in results)
    if any(v is None for v in values) or tokens == 0:
        return None
    return 1e3 * sum(values) / tokens


def summarize(concurrency: int, pairs: Sequence[Pair], level: float = 0.95) -> dict:
    """A level's pairs: per-pair ratios A/B of tok/s and of P50 TPOT, their medians with intervals,
    each arm's median figures, and CPU ms per output token pooled over each arm's bursts."""
    if not pairs:
        raise WorkloadError(f"no pairs measured at concurrency {concurrency}")
    tok = [_ratio(p.a.tokens_per_s, p.b.tokens_per_s) for p in pairs]
    tpot = [_ratio(p.a.p50_tpot_ms, p.b.p50_tpot_ms) for p in pairs]
    if any(math.isnan(r) for r in tok + tpot):
        raise WorkloadError(f"a burst at concurrency {concurrency} delivered no tokens: no ratio")
    t, p = median_interval(tok, level), median_interval(tpot, level)
    a, b = [q.a for q in pairs], [q.b for q in pairs]
    return {
        "concurrency": concurrency, "pairs": len(pairs), "orders": [q.first + ("b" if q.first == "a" else "a")
                                                                     for q in pairs],
        "tok_s_ratio": t.median, "tok_s_ratio_low": t.low, "tok_s_ratio_high": t.high,
        "tpot_ratio": p.median, "tpot_ratio_low": p.low, "tpot_ratio_high": p.high,
        "interval_coverage": t.coverage,
        # The overhead of A over B, as the target states it: tok/s lost and P50 TPOT added.
        "throughput_overhead_pct": 100 * (1 - t.median),
        "throughput_overhead_pct_interval": [100 * (1 - t.high), 100 * (1 - t.low)],
        "tpot_overhead_pct": 100 * (p.median - 1),
        "tpot_overhead_pct_interval": [100 * (p.low - 1), 100 * (p.high - 1)],
        "tok_s_ratios": tok, "tpot_ratios": tpot,
        "a_tok_s": statistics.median(r.tokens_per_s for r in a), "b_tok_s": statistics.median(r.tokens_per_s for r in b),
        "a_p50_tpot_ms": statistics.median(r.p50_tpot_ms for r in a),
        "b_p50_tpot_ms": statistics.median(r.p50_tpot_ms for r in b),
        "a_mean_ttft_ms": statistics.median(r.mean_ttft_ms for r in a),
        "b_mean_ttft_ms": statistics.median(r.mean_ttft_ms for r in b),
        "failed": sum(r.failed for r in a + b),
        "a_loop_ms_per_token": _per_token_ms(a, "loop_cpu_s"), "a_process_ms_per_token": _per_token_ms(a, "cpu_s"),
        "a_server_ms_per_token": _per_token_ms(a, "server_cpu_s"),
        "a_server_loop_ms_per_token": _per_token_ms(a, "server_loop_cpu_s"),
        "b_loop_ms_per_token": _per_token_ms(b, "loop_cpu_s"), "b_process_ms_per_token": _per_token_ms(b, "cpu_s"),
    }


async def _burst(target: Target, prompts: PromptSource, shape: BurstShape, concurrency: int, index: int,
                 server_pid: int | None) -> LevelResult:
    """One measured burst with the CPU this process, its main thread and the server used over it."""
    me, loop_thread = os.getpid(), threading.get_native_id()
    cpu0, loop0 = time.process_time(), process_cpu_s(me, loop_thread)
    server0 = (process_cpu_s(server_pid), process_cpu_s(server_pid, server_pid)) if server_pid else None
    run = await run_workload(target, burst_workload(prompts, shape, concurrency, index), progress=False,
                             sample_interval_s=None, start_delay_s=0.0)
    server = ((process_cpu_s(server_pid) - server0[0], process_cpu_s(server_pid, server_pid) - server0[1])
              if server0 else (None, None))
    return level_result(concurrency, [run.records], time.process_time() - cpu0, server[0],
                        process_cpu_s(me, loop_thread) - loop0, server[1])


async def run_paired(a: Target, b: Target, tokenizer, levels: Sequence[int] = DEFAULT_LEVELS, pairs: int = 8,
                     shape: BurstShape = BurstShape(), settle_s: float = 1.0, a_server_pid: int | None = None,
                     log: Callable[[str], None] = print, level: float = 0.95) -> list[dict]:
    """Every level in turn, `pairs` ABBA-ordered pairs of one burst on each arm, `settle_s` idle
    before each burst; after one unmeasured warm-up burst per arm. a_server_pid: the process
    behind A (its CPU is counted over A's bursts only)."""
    if not levels or any(c < 1 for c in levels):
        raise WorkloadError(f"concurrency levels must be positive, got {levels!r}")
    if pairs < 1 or settle_s < 0:
        raise WorkloadError(f"need pairs >= 1 and settle_s >= 0, got {pairs} and {settle_s}")
    prompts = PromptSource(tokenizer, seed=0)
    index = 0
    warmup = max(levels) if shape.warmup_requests is None else shape.warmup_requests
    for target in (a, b) if warmup else ():
        await run_workload(target, burst_workload(prompts, replace(shape, output_tokens=shape.warmup_tokens), warmup,
                                                  index),
                           progress=False, sample_interval_s=None, start_delay_s=0.0)
    arms = {"a": (a, a_server_pid), "b": (b, None)}
    out = []
    for concurrency in levels:
        measured = []
        for i in range(pairs):
            got = {}
            for arm in pair_order(i):
                await asyncio.sleep(settle_s)
                index += 1   # each burst its own prompts, the same for either arm at that position
                target, pid = arms[arm]
                got[arm] = await _burst(target, prompts, shape, concurrency, index, pid)
            measured.append(Pair(pair_order(i)[0], got["a"], got["b"]))
        row = summarize(concurrency, measured, level)
        row["bursts"] = [{"first": q.first, "a": asdict(q.a), "b": asdict(q.b)} for q in measured]
        log(f"concurrency {concurrency:>3}: {len(measured)} pairs, tok/s A/B {row['tok_s_ratio']:.3f} "
            f"[{row['tok_s_ratio_low']:.3f}, {row['tok_s_ratio_high']:.3f}], P50 TPOT A/B {row['tpot_ratio']:.3f} "
            f"[{row['tpot_ratio_low']:.3f}, {row['tpot_ratio_high']:.3f}] ({100 * row['interval_coverage']:.1f}%); "
            f"tok/s {row['a_tok_s']:.1f} / {row['b_tok_s']:.1f}"
            + (f", {row['failed']} failed" if row["failed"] else ""))
        out.append(row)
    return out


def run_loop(coro, client_loop: str = "auto"):
    """Run the bursts on uvloop where it is installed (auto) or asked for: the load generator's
    event loop costs CPU on the cores the engine steps on, and uvloop's costs less a token."""
    if client_loop not in CLIENT_LOOPS:
        coro.close()   # never run: close it, or it warns that it was never awaited
        raise WorkloadError(f"client_loop must be one of {', '.join(CLIENT_LOOPS)}, got {client_loop!r}")
    if client_loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if client_loop == "uvloop":
                coro.close()
                raise WorkloadError("client_loop 'uvloop' asked for, but uvloop is not installed") from None
        else:
            return uvloop.run(coro), "uvloop"
    return asyncio.run(coro), "asyncio"


def main(argv: list[str] | None = None) -> int:
    from backfill.options import add_arguments, build, given, options_of
    from backfill.serving.config import ServingConfig

    parser = argparse.ArgumentParser(prog="python -m backfill.bench.paired_bursts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="the server (arm A over HTTP); needed unless --arms in-process in-process")
    parser.add_argument("--server-pid", type=int, default=None, help="the server's pid: its CPU over A's bursts")
    parser.add_argument("--arms", nargs=2, choices=ARMS, default=list(ARMS), metavar="ARM",
                        help="A and B: http in-process (default), or in-process in-process (the design's own A/A)")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--settle-s", type=float, default=1.0, help="idle before each burst")
    parser.add_argument("--client-loop", choices=CLIENT_LOOPS, default="auto")
    parser.add_argument("--concurrency", nargs="+", type=int, default=list(DEFAULT_LEVELS))
    parser.add_argument("--prompt-tokens", type=int, default=BurstShape.prompt_tokens)
    parser.add_argument("--output-tokens", type=int, default=BurstShape.output_tokens)
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)   # the tests' random-weight model
    parser.add_argument("--json", default=None, help="write the results to this file")
    engine_options = options_of(ServingConfig, "engine") + options_of(ServingConfig, "serving")
    add_arguments(parser, engine_options)
    args = parser.parse_args(argv)
    if "http" in args.arms and not args.url:
        parser.error("--url is needed for an http arm")
    if args.arms == ["in-process", "http"]:
        parser.error("the HTTP arm is A: --arms http in-process")
    shape = BurstShape(args.prompt_tokens, args.output_tokens, bursts=1)
    serving = build(ServingConfig, given(args, engine_options))
    if args.server_pid is not None:
        process_cpu_s(args.server_pid)   # fail before the bursts, not after
    from backfill.bench.inprocess_target import InProcessTarget
    from backfill.serving.build import build_engine, build_tiny_engine

    engine = build_tiny_engine(serving) if args.tiny else build_engine(serving)
    engine.wait_until_warm()   # as the server's /ready waits for it

    async def go() -> list[dict]:
        await engine.start()
        local = InProcessTarget(engine)
        try:
            if args.arms[0] == "http":
                from backfill.bench.http_target import HttpTarget, served_model

                async with HttpTarget(args.url, served_model(args.url), prompt_as="token_ids") as remote:
                    return await run_paired(remote, local, engine.tokenizer, args.concurrency, args.pairs, shape,
                                            args.settle_s, args.server_pid)
            return await run_paired(local, local, engine.tokenizer, args.concurrency, args.pairs, shape, args.settle_s)
        finally:
            await engine.stop()
    rows, loop_name = run_loop(go(), args.client_loop)
    if args.json:
        doc = {"arms": {"a": args.arms[0], "b": args.arms[1]}, "url": args.url, "model": engine.model_name,
               "dtype": serving.resolved_dtype, "compile_decode": serving.compile_decode, "policy": serving.policy,
               "client_loop": loop_name, "pairs": args.pairs, "settle_s": args.settle_s, "shape": asdict(shape),
               "levels": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
