"""The cluster layer's commands, registered into `backfill` by its build_parser:

    backfill bench placer [--servers 16 --gpus 8 --time-limit-s 5 --json F]   AQUA-PLACER on 128 devices
    backfill sim fleet [--devices 8054 --duration-s 3600 --placers valve most-idle --json F]
    backfill bench cluster [--model tiny|default --json F]          the 3-node Ray cluster scenario
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from backfill.cli.command_parser import CommandParser


def _write(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1, default=float))


def cmd_bench_placer(args: argparse.Namespace) -> int:
    import numpy as np

    from backfill.cluster.placer import random_problem, solve

    rows = []
    for seed in range(args.instances):
        problem = random_problem(np.random.default_rng(seed), args.servers, args.gpus, args.models,
                                 n_kinds=args.kinds)
        result = solve(problem, time_limit_s=args.time_limit_s)
        rows.append({"seed": seed, "models": len(problem.models), "shards": sum(m.shards for m in problem.models),
                     "objective": result.objective, "proven_optimal": result.proven_optimal, "gap": result.gap,
                     "solve_s": result.solve_s, "pairings": len(result.pairings)})
        print(f"seed {seed}: {rows[-1]['shards']} shards of {len(problem.models)} models on {args.servers}x{args.gpus} "
              f"GPUs: objective {result.objective:.1f}, {'optimal' if result.proven_optimal else f'gap {result.gap:.1%}'}"
              f", {result.solve_s:.2f} s, {len(result.pairings)} producer-consumer pairs")
    _write(args.json, {"servers": args.servers, "gpus_per_server": args.gpus, "kinds": args.kinds,
                       "time_limit_s": args.time_limit_s, "rows": rows})
    return 0


def cmd_sim_fleet(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from backfill.bench.sim.fleet_sim import FleetConfig, simulate

    cfg = FleetConfig(devices=args.devices, duration_s=args.duration_s, seed=args.seed)
    reports = []
    print(f"{'placer':>10} {'util gain pp':>12} {'online busy':>11} {'delivered/SLA':>13} {'checks>=SLA':>11} "
          f"{'evictions':>9} {'rejected':>8} {'devices saved':>13} {'wall s':>7}")
    for placer in args.placers:
        r = simulate(cfg, placer)
        reports.append(asdict(r))
        print(f"{placer:>10} {r.utilisation_gain_pct:12.1f} {r.online_busy_share:11.3f} {r.delivered_vs_sla:13.3f} "
              f"{r.checks_meeting_sla:11.3f} {r.evictions:9d} {r.jobs_rejected:8d} {r.devices_saved:13.0f} {r.wall_s:7.1f}")
    _write(args.json, {"config": asdict(cfg), "reports": reports})
    return 0


def cmd_bench_cluster(args: argparse.Namespace) -> int:
    from backfill.bench.cluster_scenario import ScenarioConfig, run_scenario

    started = time.perf_counter()
    result = run_scenario(ScenarioConfig.for_model(args.model),
                          log=lambda line: print(f"[{time.perf_counter() - started:4.0f} s] {line}", flush=True))
    prediction = result["prediction"]
    shares = ", ".join(f"{x:.2f}" for x in result["cpu_contention"])
    print(f"model {result['model']}: ready in {result['ready_s']:.0f} s; T_mono {result['t_mono_tokens_per_s']:.1f} "
          f"tokens/s alone, shares with 1..{len(result['cpu_contention'])} nodes busy: {shares}")
    for event in result["events"]:
        print("  " + ", ".join(f"{k} {v}" for k, v in event.items() if k not in ("busy",)))
    print(f"raised {result['raised_node']} (round {result['raised_round']}), killed {result['killed_node']} "
          f"(round {result['killed_round']}); finished {result['finished']} in {result['jobs_s']:.0f} s "
          f"({result['rounds']} rounds); every custom_id exactly once: {result['exactly_once']}")
    for st in prediction["stays"]:
        print(f"  {st['job_id']} on {st['node']}: {st['rounds']} rounds, predicted {st['predicted']:.2f}, "
              f"measured {st['measured']:.2f} tokens/s, error {st['error']:+.0%}")
    for node, row in sorted(prediction["per_node"].items()):
        print(f"  {node}: predicted {row['predicted']:.2f}, measured {row['measured']:.2f} tokens/s, "
              f"error {row['error']:+.0%}")
    median = prediction["median_abs_error"]
    print(f"throughput prediction: median |error| {'-' if median is None else f'{median:.1%}'} over "
          f"{len(prediction['errors'])} stays; {time.perf_counter() - started:.0f} s")
    _write(args.json, result)
    return 0


def add_commands(commands: CommandParser) -> None:
    commands.defer("bench placer", "AQUA-PLACER (AQUA §5): the integer program on a cluster of servers",
                   _fill_bench_placer)
    commands.defer("sim fleet", "Valve §6: the cluster scheduler on a simulated fleet, against naive placers",
                   _fill_sim_fleet)
    commands.defer("bench cluster", "3 Ray nodes on 127.0.0.1: online traffic, 3 batch jobs, an SLA eviction "
                                    "and a killed node", _fill_bench_cluster)


def _fill_bench_placer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--servers", type=int, default=16)
    p.add_argument("--gpus", type=int, default=8, help="GPUs per server")
    p.add_argument("--models", type=int, default=100, help="models drawn (until the GPUs are full)")
    p.add_argument("--kinds", type=int, default=8, help="distinct model kinds the models are replicas of")
    p.add_argument("--instances", type=int, default=5)
    p.add_argument("--time-limit-s", type=float, default=5.0)
    p.add_argument("--json", default=None)
    p.set_defaults(func=cmd_bench_placer)


def _fill_sim_fleet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=8054)
    p.add_argument("--duration-s", type=int, default=3600)
    p.add_argument("--placers", nargs="+", default=["valve", "most-idle"], choices=["valve", "most-idle", "random"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.set_defaults(func=cmd_sim_fleet)


def _fill_bench_cluster(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", choices=["tiny", "default"])
    p.add_argument("--json", default=None)
    p.set_defaults(func=cmd_bench_cluster)
