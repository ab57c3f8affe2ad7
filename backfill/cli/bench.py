"""The benchmark and simulation commands of the serving stack: bench engine, coserve, server, node,
structured, overload, and sim coserve (the harness in backfill/bench/). Each capability's own
benchmarks are registered by its command module (cli/finetune.py, cli/offload.py, ...)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from backfill.cli.command_parser import CommandParser
from backfill.cli.engine_args import (DEFAULT_MODES, MODES_HELP, add_engine_args, add_frontier_args, add_scenario_args,
                                      scenario_from_args, serving_config)
from backfill.errors import InvalidRequestError


def add_commands(commands: CommandParser) -> None:
    commands.group("bench", "benchmarks")
    commands.defer("bench engine", "engine speed vs bandwidth floor and HF transformers", _fill_bench_engine)
    commands.defer("bench coserve", "online + offline co-serving scenario, all policies back to back",
                   _fill_bench_coserve)
    commands.defer("bench server", "the coserve scenario in-process and over HTTP (backfill serve), side by side",
                   _fill_bench_server)
    commands.defer("bench node", "Valve: online + offline engine processes under the node runtime "
                                 "(options: see python -m backfill.bench.node_bench --help)", _fill_bench_node,
                   add_help=False)
    commands.defer("bench structured", "100 JSON-schema requests on the default model: all validate? "
                                       "and the grammar's per-token cost (TPOT with vs without)", _fill_structured)
    commands.defer("bench overload", "10x the sustainable online rate against backfill serve: admitted "
                                     "P99 TTFT vs the SLO, 429s with Retry-After, latency after the burst",
                   _fill_overload)
    commands.defer("bench prefix", "prefix caching on and off: a Batch file sharing a system prompt, co-serving "
                                   "with shared prompts, offline distinct prefixes beside a steady online one",
                   _fill_prefix)
    commands.group("sim", "simulations: the real scheduler and policies, with steps costed on a virtual clock "
                          "instead of run")
    commands.defer("sim coserve", "the coserve benchmark's scenario, simulated (seconds instead of minutes; "
                                  "any machine a step-cost table describes)", _fill_sim_coserve)


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


def _fill_prefix(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--policy", default="coserve", help="scheduling policy of the in-process engine")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the in-process engine (unset: "
                                                              "torch's default, every core)")
    p.add_argument("--scenarios", nargs="+", choices=["batch", "coserve", "stream", "mixed"], default=["batch"],
                   help="batch: a Batch file sharing a system prompt; coserve: online and offline each sharing "
                        "one; stream: offline distinct prefixes beside a steady online system prompt; mixed: a "
                        "Batch file cycling through --prompts system prompts, through the Batch API in prefix "
                        "order and in file order")
    p.add_argument("--caching", nargs="+", choices=["on", "off"], default=["on", "off"],
                   help="run with the prefix cache on, off, or both (in turn)")
    p.add_argument("--lines", type=int, default=64, help="batch, mixed: lines in the file")
    p.add_argument("--prompts", type=int, default=8, help="mixed: system prompts the file's lines cycle through")
    p.add_argument("--system-tokens", type=int, default=1024, help="the offline lines' shared system prompt, tokens")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per offline line")
    p.add_argument("--concurrency", type=int, default=64, help="batch: lines in flight (the Batch worker's 64)")
    p.add_argument("--duration-s", type=float, default=60.0, help="coserve, stream: length of the online trace")
    p.add_argument("--online-rate", type=float, default=0.5, help="coserve, stream: online requests per second")
    p.add_argument("--online-system-tokens", type=int, default=512, help="the online chat's system prompt, tokens")
    p.add_argument("--online-max-tokens", type=int, default=32)
    p.add_argument("--url", default=None, help="batch: send the file's lines to this OpenAI-compatible server "
                                               "instead (e.g. vLLM's), at the same concurrency")
    p.add_argument("--served-model", default=None, help="model name to send with --url")
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", default=None, help="write the figures here")
    p.set_defaults(func=cmd_bench_prefix)


def cmd_bench_prefix(args: argparse.Namespace) -> int:
    from backfill.bench.prefix_bench import (print_summary, run_batch_scenario, run_coserve_scenario,
                                             run_mixed_batch_scenario, write_json)

    for name in ("lines", "prompts", "concurrency", "system_tokens", "max_tokens", "online_system_tokens",
                 "online_max_tokens"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be >= 1")
    if args.duration_s <= 0 or args.online_rate <= 0:
        raise InvalidRequestError("--duration-s and --online-rate must be positive")
    if args.threads is not None and args.threads < 1:
        raise InvalidRequestError("--threads must be >= 1")
    from dataclasses import replace

    cfg = replace(serving_config(args, policy=args.policy), threads=args.threads)
    caching = tuple(mode == "on" for mode in args.caching)
    results = {}
    for scenario in args.scenarios:
        if scenario == "batch":
            result = run_batch_scenario(cfg, args.lines, args.system_tokens, args.max_tokens, args.concurrency,
                                        caching, args.url, args.served_model, args.api_key)
        elif scenario == "mixed":
            result = run_mixed_batch_scenario(cfg, args.lines, args.prompts, args.system_tokens, args.max_tokens,
                                              args.concurrency)
        else:
            result = run_coserve_scenario(cfg, scenario, args.duration_s, args.online_rate,
                                          args.online_system_tokens, args.system_tokens, args.online_max_tokens,
                                          args.max_tokens, caching)
        print_summary(scenario, result)
        results[scenario] = result
    if args.json:
        write_json(args.json, results)
        print(f"wrote {args.json}")
    return 0


def cmd_bench_structured(args: argparse.Namespace) -> int:
    from backfill.progress import Heartbeat
    from backfill.bench.structured_bench import run_structured_bench
    from backfill.serving.build import build_engine
    from backfill.serving.config import ServingConfig

    # fcfs: no latency profile to measure first; the grammar's cost per token does not depend on the policy.
    print("bench structured: loading the model...", flush=True)
    with Heartbeat(print, "loading the model and its kernels"):
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


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from backfill.bench.engine_bench import run_engine_bench

    cfg = serving_config(args)
    result = run_engine_bench(cfg.model, tuple(args.dtypes), tuple(args.batches), args.prompt_tokens,
                              args.new_tokens, cfg.device, with_hf=not args.no_hf,
                              compile_decode=cfg.compile_decode,
                              decode_attention=cfg.decode_attention, cuda_graphs=cfg.cuda_graphs,
                              cuda_kernels=tuple(args.cuda_kernels_compared))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0


def cmd_bench_coserve(args: argparse.Namespace) -> int:
    from backfill.bench.coserve_bench import run_coserve_bench, run_http_bench, run_http_with_baseline, save_json
    scenario = scenario_from_args(args)
    serving = serving_config(args)
    if args.profile:
        from dataclasses import replace

        serving = replace(serving, profile_path=args.profile)
    if args.url:
        from backfill.bench.coserve_bench import load_and_profile

        if scenario.rounds > 1:
            raise InvalidRequestError("--rounds interleaves in-process modes; with --url there is one mode")
        if args.phase != "both" and not args.baseline_file:
            raise InvalidRequestError(f"--phase {args.phase} needs --baseline-file (written by the online-only phase, "
                                      "read by the coserved one)")
        if args.phase == "coserved":   # a missing or malformed file fails before the model loads
            from dataclasses import asdict

            from backfill.bench.http_baseline import read_baseline

            read_baseline(args.baseline_file, asdict(scenario))

        loaded, _, latency = load_and_profile(serving, print)
        model = args.served_model or loaded.config.name
        phase_args = dict(label=args.label, api_key=args.api_key, out_dir=args.out, offline_mark=args.offline_mark)
        if args.phase == "online-only":
            from backfill.bench.coserve_bench import run_http_online_only

            results = run_http_online_only(args.url, model, scenario, loaded.tokenizer, latency,
                                           baseline_file=args.baseline_file, **phase_args)
        elif args.phase == "coserved":
            from backfill.bench.coserve_bench import run_http_coserved

            results = run_http_coserved(args.url, model, scenario, loaded.tokenizer, latency,
                                        baseline_file=args.baseline_file, **phase_args)
        elif args.online_baseline:
            results = run_http_with_baseline(args.url, model, scenario, loaded.tokenizer, latency, label=args.label,
                                             api_key=args.api_key, out_dir=args.out, offline_mark=args.offline_mark)
        else:
            results = {args.label: run_http_bench(args.url, model, scenario, loaded.tokenizer, latency,
                                                  label=args.label, api_key=args.api_key, out_dir=args.out,
                                                  offline_mark=args.offline_mark)}
    elif args.loads or args.slos:
        from backfill.bench.coserve_bench import load_and_profile
        from backfill.bench.frontier import parse_slos, run_frontier, settings

        points = settings(scenario, args.loads, parse_slos(args.slos))
        prepared = load_and_profile(serving, print)  # one model load for every point
        run_frontier(points, lambda sc, out: run_coserve_bench(sc, serving, tuple(args.modes), out,
                                                               prepared=prepared), args.out)
        return 0
    else:
        results = run_coserve_bench(scenario, serving, tuple(args.modes), args.out)
    if args.json:
        save_json(results, args.json)
        print(f"wrote {args.json}")
    return 0


def cmd_sim_coserve(args: argparse.Namespace) -> int:
    from backfill.bench.coserve_bench import headline, save_json
    from backfill.bench.sim.coserve_sim import load_inputs, simulate_coserve

    scenario = scenario_from_args(args)
    serving = serving_config(args)
    config, latency, machine = load_inputs(serving, args.profile, args.machine, args.step_overhead_ms, args.noise_cv,
                                          args.slowdown_factor)
    if args.loads or args.slos:
        from backfill.bench.frontier import parse_slos, run_frontier, settings

        run_frontier(settings(scenario, args.loads, parse_slos(args.slos)),
                     lambda sc, out: simulate_coserve(sc, machine, latency, config, serving, tuple(args.modes), out,
                                                      log=lambda *a: None), args.out)
        return 0
    results = simulate_coserve(scenario, machine, latency, config, serving, tuple(args.modes), args.out)
    print(headline(results))
    if args.json:
        save_json(results, args.json)
        print(f"wrote {args.json}")
    return 0


def cmd_bench_server(args: argparse.Namespace) -> int:
    from backfill.bench.coserve_bench import save_json
    from backfill.bench.server_overhead import run_server_overhead_bench
    from backfill.types import SLO
    scenario = scenario_from_args(args)
    slo = SLO(scenario.ttft_slo_ms or 300.0, scenario.tpot_slo_ms or 60.0)
    results = run_server_overhead_bench(scenario, serving_config(args), slo, args.out)
    if args.json:
        save_json(results, args.json)
        print(f"wrote {args.json}")
    return 0


def _fill_bench_engine(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, several=("cuda_kernels",))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.set_defaults(func=cmd_bench_engine)


def _fill_bench_coserve(p: argparse.ArgumentParser) -> None:
    add_scenario_args(p, rounds={})
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), help=MODES_HELP)
    p.add_argument("--url", default=None, help="measure this OpenAI-compatible server instead")
    p.add_argument("--profile", default=None,
                   help="latency profile to plan with (default: the one `backfill profile` saved for these model "
                        "options, measured on first use)")
    p.add_argument("--served-model", default=None, help="model name to send with --url")
    p.add_argument("--label", default="http", help="mode name for --url results")
    p.add_argument("--api-key", default=None)
    p.add_argument("--offline-mark", choices=["flex", "priority", "both"], default="both",
                   help="with --url, how offline requests are marked: service_tier flex (backfill), "
                        "vLLM's priority field (larger is later), or both")
    p.add_argument("--online-baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="with --url, first run the same trace without the offline backlog against the "
                        "same server (ratios to it)")
    p.add_argument("--phase", choices=["both", "online-only", "coserved"], default="both",
                   help="with --url: both phases in turn (default), or one: online-only writes --baseline-file, "
                        "coserved reads it (its P99s are the SLOs; restart the server with them in between)")
    p.add_argument("--baseline-file", default=None,
                   help="with --phase: the online-only run's records and P99s (JSON)")
    p.add_argument("--out", default="runs/coserve", help="report folder (JSON, Markdown, PNG)")
    add_frontier_args(p)
    p.set_defaults(func=cmd_bench_coserve)


def _fill_bench_server(p: argparse.ArgumentParser) -> None:
    add_scenario_args(p)
    p.add_argument("--out", default="runs/server", help="report folder")
    p.set_defaults(func=cmd_bench_server)


def _fill_bench_node(p: argparse.ArgumentParser) -> None:
    p.add_argument("rest", nargs=argparse.REMAINDER)  # main() hands these to the node benchmark


def _fill_sim_coserve(p: argparse.ArgumentParser) -> None:
    add_scenario_args(p, rounds={"warmup_s": 0.0})
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), help=MODES_HELP)
    p.add_argument("--profile", default=None,
                   help="latency profile the policies plan with (default: the one `backfill profile` saved "
                        "for these model options)")
    p.add_argument("--machine", default=None,
                   help="latency-profile JSON of what steps cost on the simulated machine (default: the profile)")
    p.add_argument("--step-overhead-ms", type=float, default=0.0,
                   help="host time each step adds beyond its cost table (Python between steps)")
    p.add_argument("--noise-cv", type=float, default=0.0, help="lognormal spread of each step's time")
    p.add_argument("--slowdown-factor", type=float, default=2.0,
                   help="with --slowdown-at-s: steps cost this many times more from then on in each mode's run")
    p.add_argument("--out", default="runs/sim-coserve", help="report folder (JSON, Markdown, PNG)")
    add_frontier_args(p)
    p.set_defaults(func=cmd_sim_coserve)
