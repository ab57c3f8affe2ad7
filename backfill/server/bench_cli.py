"""`backfill bench structured` and `backfill bench overload`: the server's structured output and its
admission under overload (backfill/bench/structured_bench.py, backfill/bench/overload_bench.py)."""

from __future__ import annotations

import argparse

from backfill.command_parser import CommandParser


def add_commands(commands: CommandParser) -> None:
    commands.defer("bench structured", "100 JSON-schema requests on the default model: all validate? "
                                       "and the grammar's per-token cost (TPOT with vs without)", _fill_structured)
    commands.defer("bench overload", "10x the sustainable online rate against backfill serve: admitted "
                                     "P99 TTFT vs the SLO, 429s with Retry-After, latency after the burst",
                   _fill_overload)


def _fill_structured(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory; unset: the embedded default model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--groups", type=int, default=4, help="alternations of the with- and without-grammar phases")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--json", default=None, help="write the figures here")
    p.set_defaults(func=cmd_bench_structured)


def _fill_overload(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-gb", type=float, default=0.5)
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=100.0)
    p.add_argument("--multiplier", type=float, default=10.0, help="burst rate / sustainable rate")
    p.add_argument("--burst-s", type=float, default=60.0)
    p.add_argument("--calm-s", type=float, default=20.0, help="length of the phases before and after the burst")
    p.add_argument("--sustainable-rps", type=float, default=None, help="unset: measured by a closed loop first")
    p.add_argument("--calibrate-s", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for backfill serve (repeatable)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.set_defaults(func=cmd_bench_overload)


def cmd_bench_structured(args: argparse.Namespace) -> int:
    from backfill.bench.structured_bench import run_structured_bench
    from backfill.serving.build import build_engine
    from backfill.serving.config import ServingConfig

    # fcfs: no latency profile to measure first; the grammar's cost per token does not depend on the policy.
    engine = build_engine(ServingConfig(model=args.model, dtype=args.dtype, policy="fcfs", kv_cache_gb=0.5))
    run_structured_bench(engine, engine.model_name, args.requests, args.groups, args.concurrency, args.max_tokens,
                         args.json)
    return 0


def cmd_bench_overload(args: argparse.Namespace) -> int:
    from backfill.bench.overload_bench import run_overload_bench

    run_overload_bench(dtype=args.dtype, kv_cache_gb=args.kv_cache_gb, ttft_slo_ms=args.ttft_slo_ms,
                       tpot_slo_ms=args.tpot_slo_ms, multiplier=args.multiplier, burst_s=args.burst_s,
                       calm_s=args.calm_s, sustainable_rps=args.sustainable_rps, max_tokens=args.max_tokens,
                       calibrate_s=args.calibrate_s, extra_server_args=tuple(args.server_arg), json_path=args.json)
    return 0
