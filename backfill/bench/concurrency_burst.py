"""Bursts: N completions sent at once, at each of several concurrency levels, to any server.

    python -m backfill.bench.concurrency_burst --url http://127.0.0.1:8000 --json burst-http.json
    python -m backfill.bench.concurrency_burst --in-process --dtype bfloat16 --json burst-engine.json

Each level sends `concurrency` requests of the same shape (prompt_tokens in, output_tokens out
with ignore_eos) at one instant and waits for all of them; that repeats `bursts` times. A level's
tokens/s is its output tokens over the summed wall time of its bursts (first send to last token),
as vLLM's `bench serve` reports for a burst; TTFT and TPOT are per request. --url measures an
OpenAI-compatible server over HTTP (backfill serve, vLLM, ...); --in-process drives the same
AsyncEngine `backfill serve` runs, without HTTP, so the two side by side are the server's own cost.
Each level also records the CPU seconds this process and its main thread (the event loop) used
over its bursts (with --url: the load generator's own share of the machine, which it takes from
the server) and, given --server-pid, the server's and its main thread's (uvicorn's event loop,
where all HTTP and streaming work runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from backfill.bench.driver import run_workload
from backfill.bench.metrics import RequestRecord
from backfill.bench.prompts import PromptSource
from backfill.bench.target import Target
from backfill.bench.workload import Workload, make_requests
from backfill.errors import WorkloadError
from backfill.progress import PROGRESS_EVERY_S, Heartbeat

if TYPE_CHECKING:
    from backfill.serving.config import ServingConfig

DEFAULT_LEVELS = (1, 8, 32, 64)


@dataclass(frozen=True)
class BurstShape:
    prompt_tokens: int = 128
    output_tokens: int = 64
    bursts: int = 2            # measured bursts per level, pooled
    # One unmeasured burst first, as large as the largest level (first shapes pay one-off costs:
    # kernel primitives, allocator growth), of warmup_tokens each; 0 requests: none.
    warmup_requests: int | None = None   # None: the largest level
    warmup_tokens: int = 8

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.bursts < 1 or self.warmup_tokens < 1:
            raise WorkloadError("need prompt_tokens, output_tokens, bursts and warmup_tokens >= 1")
        if self.warmup_requests is not None and self.warmup_requests < 0:
            raise WorkloadError(f"warmup_requests must be >= 0, got {self.warmup_requests}")


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    requests: int
    failed: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    mean_ttft_ms: float
    p50_ttft_ms: float
    p50_tpot_ms: float
    mean_tpot_ms: float
    cpu_s: float | None = None          # CPU seconds of this process (all threads) over the level's bursts
    server_cpu_s: float | None = None   # the same for --server-pid's process
    loop_cpu_s: float | None = None          # of this process's main thread (its event loop) alone
    server_loop_cpu_s: float | None = None   # of the server's main thread (uvicorn's event loop) alone


def process_cpu_s(pid: int, thread: int | None = None) -> float:
    """User + system CPU seconds a process (all its threads) or one of its threads has used, from
    /proc/PID/stat or /proc/PID/task/TID/stat."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        stat = Path(path).read_text()
    except OSError:
        raise WorkloadError(f"no process {pid} to measure (is the server running?)") from None
    # Fields after the command name, which is in parentheses and may hold spaces: utime and stime
    # are the 14th and 15th fields of the whole line, i.e. the 12th and 13th after it.
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def burst_workload(prompts: PromptSource, shape: BurstShape, concurrency: int, index: int) -> Workload:
    """concurrency requests all arriving at t=0, with prompts no other burst uses."""
    requests = make_requests(prompts, [0.0] * concurrency, prompt_lengths=[shape.prompt_tokens] * concurrency,
                             output_lengths=[shape.output_tokens] * concurrency, request_class="online",
                             first_index=index * 1000, id_prefix=f"b{index}-")
    return Workload(requests, name=f"burst of {concurrency}")


def level_result(concurrency: int, bursts: list[list[RequestRecord]], cpu_s: float | None = None,
                 server_cpu_s: float | None = None, loop_cpu_s: float | None = None,
                 server_loop_cpu_s: float | None = None) -> LevelResult:
    records = [r for burst in bursts for r in burst]
    done = [r for r in records if r.ok and r.first_token_s is not None]
    tokens = sum(r.output_tokens for r in done)
    wall_s = sum(max(r.end_s for r in burst if r.end_s is not None) - min(r.send_s for r in burst)
                 for burst in bursts if any(r.end_s is not None for r in burst))
    ttft_ms = [(r.first_token_s - r.send_s) * 1e3 for r in done]
    tpot_ms = [(r.end_s - r.first_token_s) * 1e3 / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return LevelResult(concurrency, len(records), len(records) - len(done), tokens, wall_s,
                       tokens / wall_s if wall_s > 0 else 0.0,
                       statistics.fmean(ttft_ms) if ttft_ms else float("nan"),
                       statistics.median(ttft_ms) if ttft_ms else float("nan"),
                       statistics.median(tpot_ms) if tpot_ms else float("nan"),
                       statistics.fmean(tpot_ms) if tpot_ms else float("nan"), cpu_s, server_cpu_s,
                       loop_cpu_s, server_loop_cpu_s)


async def run_bursts(target: Target, tokenizer, levels: tuple[int, ...] = DEFAULT_LEVELS,
                     shape: BurstShape = BurstShape(), log=print, server_pid: int | None = None,
                     progress_every_s: float = PROGRESS_EVERY_S) -> list[LevelResult]:
    """Every level in turn against one target (after one unmeasured warm-up burst); server_pid:
    also the CPU time of that process per level. A level or warm-up running longer than
    progress_every_s logs a line that often."""
    if not levels or any(c < 1 for c in levels):
        raise WorkloadError(f"concurrency levels must be positive, got {levels!r}")
    prompts = PromptSource(tokenizer, seed=0)
    index = 0
    warmup = max(levels) if shape.warmup_requests is None else shape.warmup_requests
    if warmup:
        # A slow server takes minutes over a burst: a line every few seconds says it is still running.
        with Heartbeat(log, f"warm-up burst of {warmup}", every_s=progress_every_s):
            await run_workload(target, burst_workload(prompts, replace(shape, output_tokens=shape.warmup_tokens),
                                                      warmup, index),
                               progress=False, sample_interval_s=None, start_delay_s=0.0)
    results = []
    for concurrency in levels:
        bursts = []
        cpu0 = time.process_time()
        loop0 = process_cpu_s(os.getpid(), threading.get_native_id())
        server0 = process_cpu_s(server_pid) if server_pid is not None else None
        server_loop0 = process_cpu_s(server_pid, server_pid) if server_pid is not None else None
        with Heartbeat(log, f"concurrency {concurrency}", lambda: f"{len(bursts)}/{shape.bursts} bursts done",
                       every_s=progress_every_s):
            for _ in range(shape.bursts):
                index += 1
                run = await run_workload(target, burst_workload(prompts, shape, concurrency, index), progress=False,
                                         sample_interval_s=None, start_delay_s=0.0)
                bursts.append(run.records)
        result = level_result(concurrency, bursts, time.process_time() - cpu0,
                              process_cpu_s(server_pid) - server0 if server0 is not None else None,
                              process_cpu_s(os.getpid(), threading.get_native_id()) - loop0,
                              process_cpu_s(server_pid, server_pid) - server_loop0 if server_pid is not None else None)
        wall_s = max(result.wall_s, 1e-9)
        log(f"concurrency {concurrency:>3}: {result.tokens_per_s:7.1f} tok/s, mean TTFT {result.mean_ttft_ms:6.0f} ms, "
            f"P50 TPOT {result.p50_tpot_ms:5.1f} ms, CPU {result.cpu_s / wall_s:.2f} cores here"
            + (f", {result.server_cpu_s / wall_s:.2f} in the server ({result.server_loop_cpu_s / wall_s:.2f} its event "
               "loop)" if result.server_cpu_s is not None else f" ({result.loop_cpu_s / wall_s:.2f} its event loop)")
            + (f", {result.failed} failed" if result.failed else ""))
        results.append(result)
    return results


def _tokenizer(model: str | None):
    from backfill.engine.weights import load_model

    return load_model(model).tokenizer


def parse_command(argv: list[str] | None = None) -> tuple[argparse.Namespace, BurstShape, tuple[int, ...],
                                                          ServingConfig]:
    """The command line: its flags, the burst shape, the levels and the engine config --in-process
    builds (`backfill serve`'s defaults where no flag says otherwise)."""
    from backfill.options import add_arguments, build, given, options_of
    from backfill.serving.config import COMMAND_DEFAULTS, ServingConfig

    parser = argparse.ArgumentParser(prog="python -m backfill.bench.concurrency_burst", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="an OpenAI-compatible server")
    where.add_argument("--in-process", action="store_true", help="the engine `backfill serve` runs, without HTTP")
    parser.add_argument("--served-model", default=None, help="model name to send with --url (default: the server's)")
    parser.add_argument("--concurrency", nargs="+", type=int, default=list(DEFAULT_LEVELS))
    parser.add_argument("--prompt-tokens", type=int, default=BurstShape.prompt_tokens)
    parser.add_argument("--output-tokens", type=int, default=BurstShape.output_tokens)
    parser.add_argument("--bursts", type=int, default=BurstShape.bursts, help="measured bursts per level")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="with --url: also record this process's CPU time per level (the server's pid)")
    parser.add_argument("--label", default=None, help="name of this run in the JSON")
    parser.add_argument("--json", default=None, help="write the results to this file")
    engine_options = options_of(ServingConfig, "engine") + options_of(ServingConfig, "serving")
    add_arguments(parser, engine_options, COMMAND_DEFAULTS)  # --in-process runs what `backfill serve` runs
    args = parser.parse_args(argv)
    shape = BurstShape(args.prompt_tokens, args.output_tokens, args.bursts)
    levels = tuple(args.concurrency)
    serving = build(ServingConfig, given(args, engine_options))
    return args, shape, levels, serving


def main(argv: list[str] | None = None) -> int:
    args, shape, levels, serving = parse_command(argv)
    if args.url:
        from backfill.bench.http_target import HttpTarget, served_model

        tokenizer = _tokenizer(serving.model)
        model = args.served_model or served_model(args.url)

        async def go() -> list[LevelResult]:
            async with HttpTarget(args.url, model, prompt_as="token_ids") as target:
                return await run_bursts(target, tokenizer, levels, shape, server_pid=args.server_pid)
        if args.server_pid is not None:
            process_cpu_s(args.server_pid)   # fail before the bursts, not after
        results = asyncio.run(go())
        where_run = {"url": args.url, "model": model}
    else:
        from backfill.bench.inprocess_target import InProcessTarget
        from backfill.serving.build import build_engine

        engine = build_engine(serving)
        engine.wait_until_warm()   # as the server's /ready waits for it

        async def go() -> list[LevelResult]:
            await engine.start()
            try:
                return await run_bursts(InProcessTarget(engine), engine.tokenizer, levels, shape)
            finally:
                await engine.stop()
        results = asyncio.run(go())
        where_run = {"in_process": True, "model": engine.model_name, "dtype": serving.resolved_dtype,
                     "compile_decode": serving.compile_decode, "policy": serving.policy}
    if args.json:
        doc = {"label": args.label, **where_run, "shape": asdict(shape), "levels": [asdict(r) for r in results]}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
