"""AQUA's commands: `bench burst`, `bench elastic`, `offload coordinator`, `offload profile`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from backfill.cli.command_parser import CommandParser


def add_commands(commands: CommandParser) -> None:
    commands.defer("bench burst", "AQUA: a 2x burst on a memory-bound engine, FCFS vs CFS paging to host / "
                                  "lent memory", _fill_bench_burst)
    commands.defer("bench elastic", "AQUA: gathered paging vs one copy per KV block, to host and lent memory",
                   _fill_bench_elastic)
    commands.group("offload", "AQUA memory lending")
    commands.defer("offload coordinator", "run the offload coordinator (HTTP, state in SQLite)",
                   _fill_offload_coordinator)
    commands.defer("offload profile", "AQUA §4: highest rate within the SLA, memory free there, swap for bursts",
                   _fill_offload_profile)


def _fill_bench_burst(p: argparse.ArgumentParser) -> None:
    from backfill.bench.burst_bench import MODES, BurstScenario

    d = BurstScenario()
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--rate", type=float, default=None,
                   help="steady requests per second (default: --steady-load of this machine's measured capacity)")
    p.add_argument("--steady-load", type=float, default=d.steady_load,
                   help="the steady rate as a share of what this machine serves (measured first)")
    p.add_argument("--burst-factor", type=float, default=d.burst_factor)
    p.add_argument("--steady-s", type=float, default=d.steady_s, help="seconds of steady load before the burst")
    p.add_argument("--burst-s", type=float, default=d.burst_s, help="burst window (AQUA: 60 s)")
    p.add_argument("--after-s", type=float, default=d.after_s, help="seconds of steady load after the burst")
    p.add_argument("--prompt-len", default=d.prompt_len)
    p.add_argument("--output-len", default=d.output_len)
    p.add_argument("--kv-cache-gb", type=float, default=d.kv_cache_gb, help="the consumer's KV memory")
    p.add_argument("--slice-iterations", type=int, default=d.slice_iterations, help="CFS time slice k")
    p.add_argument("--rounds", type=int, default=d.rounds, help="modes interleaved in this many rounds")
    p.add_argument("--lend-mb", type=float, default=d.lend_mb, help="memory the producer engine lends")
    p.add_argument("--no-producer", action="store_true", help="no producer engine process (no cfs-lent)")
    p.add_argument("--producer-tiny", action="store_true", help="the producer on a tiny random model")
    p.add_argument("--warmup-s", type=float, default=d.warmup_s)
    p.add_argument("--decode-attention", default=d.decode_attention, choices=("auto", "sdpa"))
    p.add_argument("--threads", type=int, default=None, help="consumer torch threads (1 on a crowded machine)")
    p.add_argument("--producer-idle-s", type=float, default=d.producer_idle_s,
                   help="the producer alone (the consumer's core busy with a loop that touches no memory) "
                        "before the first mode and after each one")
    p.add_argument("--no-pin", action="store_true", help="let the producer share cores with the consumer")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--pool", nargs="+", metavar="JSON", help="report runs made apart as one (no new run)")
    p.add_argument("--json", default="runs/burst.json")
    p.set_defaults(func=cmd_bench_burst)


def _fill_bench_elastic(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", nargs="+", type=int, default=[4, 16, 64])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", default="runs/elastic.json")
    p.set_defaults(func=cmd_bench_elastic)


def _fill_offload_coordinator(p: argparse.ArgumentParser) -> None:
    from backfill.offload.coordinator import add_arguments, serve

    add_arguments(p)
    p.set_defaults(func=serve)


def _fill_offload_profile(p: argparse.ArgumentParser) -> None:
    from backfill.bench.offload_profiler import add_profile_arguments

    add_profile_arguments(p)
    p.set_defaults(func=cmd_offload_profile)


def cmd_bench_burst(args: argparse.Namespace) -> None:
    from backfill.bench.burst_bench import BurstScenario, format_table, pool, run_burst_bench, save
    from backfill.bench.server_process import sigterm_as_interrupt

    if args.pool:
        result = pool([json.loads(Path(path).read_text()) for path in args.pool])
        print(format_table(result))
        save(result, args.json)
        print(f"wrote {args.json}")
        return
    scenario = BurstScenario(args.rate, args.burst_factor, args.steady_s, args.burst_s, args.after_s, args.prompt_len,
                             args.output_len, args.kv_cache_gb, args.slice_iterations, args.rounds, args.seed,
                             args.lend_mb, not args.no_producer, args.producer_tiny, args.warmup_s,
                             args.decode_attention, args.threads, args.producer_idle_s, not args.no_pin,
                             args.steady_load)
    with sigterm_as_interrupt():   # a SIGTERM still stops the coordinator and producer processes
        result = run_burst_bench(scenario, tuple(args.modes), checkpoint=lambda partial: save(partial, args.json))
    print(format_table(result))
    save(result, args.json)
    print(f"wrote {args.json}")


def cmd_bench_elastic(args: argparse.Namespace) -> None:
    from backfill.engine.weights import read_model_config
    from backfill.bench.transfer_bench import figures_json, measure_transfers, speedups

    config = read_model_config(None)
    figures = measure_transfers(config, blocks=tuple(args.blocks), repeats=args.repeats)
    print("dest  method     dir  blocks    MB  copies  median ms   GB/s")
    for f in figures:
        print(f"{f.destination:<5} {f.method:<10} {f.direction:<4} {f.blocks:>6} {f.bytes / 2**20:>5.1f} "
              f"{f.copies:>7} {f.median_ms:>10.2f} {f.gb_per_s:>6.2f}")
    ratio = speedups(figures)
    print("gathered / per-block transfer rate: " + ", ".join(f"{k} {v:.1f}x" for k, v in ratio.items()))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"model": config.name, "figures": figures_json(figures),
                                           "gathered_over_per_block": ratio}, indent=1))
    print(f"wrote {args.json}")


def cmd_offload_profile(args: argparse.Namespace) -> None:
    from backfill.bench.offload_profiler import run_profile_command

    run_profile_command(args)
