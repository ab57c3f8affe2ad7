"""The `backfill` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from backfill.errors import BackfillError, InvalidRequestError
from backfill.policy.coserve import CoServeConfig


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA and on CPUs with bf16 matmul kernels, else float32")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--compile-decode", action="store_true",
                   help="CPU: compile decode steps of a few sequences with inductor (1-8 where the CPU "
                        "has AVX-512 BF16, else 1-3; about 1.3-1.5x faster; compiled at load, the "
                        "matmul weights held twice)")
    p.add_argument("--decode-attention", default="auto", choices=["auto", "sdpa"],
                   help="auto: on CPU, read the paged KV cache in place with a C++ kernel (built on first "
                        "use, ~30 s); sdpa: gather each sequence's blocks and run SDPA")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="CUDA: launch every decode kernel from Python instead of replaying captured graphs")


def _model_options(args: argparse.Namespace) -> dict:
    """ServingConfig's fields that _add_model_args adds to a command."""
    return {"model": args.model, "dtype": args.dtype, "device": args.device, "compile_decode": args.compile_decode,
            "decode_attention": args.decode_attention, "cuda_graphs": not args.no_cuda_graphs}


def cmd_generate(args: argparse.Namespace) -> int:
    from backfill.engine.sampling_params import SamplingParams
    from backfill.serving.build import ServingConfig
    from backfill.serving.llm import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    llm = LLM(ServingConfig(**_model_options(args), policy="fcfs"))
    for delta in llm.stream(args.prompt, params, chat=not args.raw):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from backfill.bench.engine_bench import run_engine_bench

    result = run_engine_bench(args.model, tuple(args.dtypes), tuple(args.batches), args.prompt_tokens,
                              args.new_tokens, args.device, with_hf=not args.no_hf,
                              random_weights=args.random_weights, compile_decode=args.compile_decode,
                              decode_attention=args.decode_attention, cuda_graphs=not args.no_cuda_graphs)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0


DEFAULT_MODES = ("online-only", "fcfs", "priority", "coserve")
MODES_HELP = ("policies to run in turn (online-only, fcfs, priority, coserve); a variant adds knobs, e.g. "
              "coserve:rider_cost_share=1,interference_slack=0.1, and runs interleaved with the others")


def _coserve_options(args: argparse.Namespace) -> dict:
    """coserve's knobs: --interference-slack only when given, so ServingConfig's default applies
    otherwise; --no-release-suspended; --rider-cost-share."""
    out = {"release_suspended": not args.no_release_suspended, "rider_cost_share": args.rider_cost_share}
    if args.interference_slack is not None:
        out["interference_slack"] = args.interference_slack
    return out


def _scenario(args: argparse.Namespace):
    from backfill.bench.coserve import CoserveScenario

    return CoserveScenario(duration_s=args.duration, online_load=args.online_load, cv=args.cv,
                           prompt_len=args.prompt_len, output_len=args.output_len,
                           offline_prompt_len=args.offline_prompt_len, offline_output_len=args.offline_output_len,
                           offline_concurrency=args.offline_concurrency, seed=args.seed,
                           ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms,
                           rounds=getattr(args, "rounds", 1), warmup_s=getattr(args, "warmup_s", 30.0))


def cmd_bench_coserve(args: argparse.Namespace) -> int:
    from backfill.bench.coserve import run_coserve_bench, run_http_bench, save_json
    from backfill.serving.build import ServingConfig

    scenario = _scenario(args)
    serving = ServingConfig(**_model_options(args), kv_cache_gb=args.kv_cache_gb,
                            preempt_target_ms=args.preempt_target_ms, **_coserve_options(args))
    if args.url:
        from backfill.bench.coserve import load_and_profile

        if scenario.rounds > 1:
            raise InvalidRequestError("--rounds interleaves in-process modes; with --url there is one mode")

        loaded, _, latency = load_and_profile(serving)
        result = run_http_bench(args.url, args.served_model or loaded.config.name, scenario, loaded.tokenizer,
                                latency, label=args.label, api_key=args.api_key, out_dir=args.out)
        results = {args.label: result}
    else:
        results = run_coserve_bench(scenario, serving, tuple(args.modes), args.out)
    if args.json:
        save_json(results, args.json)
        print(f"wrote {args.json}")
    return 0


def cmd_sim_coserve(args: argparse.Namespace) -> int:
    from backfill.bench.coserve import headline, save_json
    from backfill.serving.build import ServingConfig
    from backfill.sim.coserve import load_inputs, simulate_coserve

    scenario = _scenario(args)
    serving = ServingConfig(**_model_options(args), kv_cache_gb=args.kv_cache_gb,
                            preempt_target_ms=args.preempt_target_ms, **_coserve_options(args))
    config, latency, machine = load_inputs(serving, args.profile, args.machine, args.step_overhead_ms, args.noise_cv)
    results = simulate_coserve(scenario, machine, latency, config, serving, tuple(args.modes), args.out)
    print(headline(results))
    if args.json:
        save_json(results, args.json)
        print(f"wrote {args.json}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """backfill's main job in one short run: online traffic alone, then with offline work harvested."""
    from backfill.bench.coserve import CoserveScenario, headline, run_coserve_bench
    from backfill.serving.build import ServingConfig

    # A shorter warm-up than the bench's: the demo is a short run (see backfill/bench/coserve.py).
    scenario = CoserveScenario(duration_s=args.duration, offline_concurrency=32, warmup_s=20.0)
    serving = ServingConfig(**_model_options(args))
    print(f"backfill demo: {args.duration:.0f} s of online traffic (gamma arrivals, 30% load) served alone, "
          "then co-served with a backlog of offline batch requests (after a 20 s warm-up).\n")
    results = run_coserve_bench(scenario, serving, ("online-only", "coserve"), args.out, log=lambda *a: None,
                                progress=not args.quiet)
    print("\n" + headline(results))
    alone, co = results["online-only"].metrics, results["coserve"].metrics
    print(f"\nOffline work harvested: {co.offline.tokens_per_s:.0f} tokens/s while online P99 TTFT went "
          f"{alone.online.ttft_ms.p99:.0f} -> {co.online.ttft_ms.p99:.0f} ms and P99 TPOT "
          f"{alone.online.tpot_ms.p99:.0f} -> {co.online.tpot_ms.p99:.0f} ms. Full report: {args.out}/report.md")
    model = results["coserve"].config["model"]  # the id the server answers to (the request must name it)
    print("\nServe it over HTTP (OpenAI-compatible; offline work via the Batch API or service_tier=flex):\n"
          "  backfill serve --port 8000\n"
          "  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'")
    return 0


def cmd_bench_server(args: argparse.Namespace) -> int:
    from backfill.bench.coserve import save_json
    from backfill.bench.server_overhead import run_server_overhead_bench
    from backfill.serving.api import SLO
    from backfill.serving.build import ServingConfig

    serving = ServingConfig(**_model_options(args), kv_cache_gb=args.kv_cache_gb,
                            preempt_target_ms=args.preempt_target_ms, **_coserve_options(args))
    slo = SLO(args.ttft_slo_ms or 300.0, args.tpot_slo_ms or 60.0)
    results = run_server_overhead_bench(_scenario(args), serving, slo, args.out)
    if args.json:
        save_json(results, args.json)
        print(f"wrote {args.json}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from backfill.engine.weights import load_model
    from backfill.serving.build import ServingConfig, build_runner, default_profile_path
    from backfill.serving.profiler import profile_latency

    cfg = ServingConfig(**_model_options(args))
    loaded = load_model(args.model)
    latency = profile_latency(build_runner(loaded.config, loaded.weights, cfg), model_name=loaded.config.name)
    path = Path(args.out) if args.out else default_profile_path(loaded.config.name, cfg)
    latency.save(path)
    for n, ms in zip(latency.token_grid, latency.step_ms):
        print(f"{n:5d} tokens: {ms:7.1f} ms")
    for n, ms in zip(latency.decode_grid, latency.decode_ms):
        print(f"{n:5d} sequences decoding: {ms:7.1f} ms")
    print(f"decode attention: {latency.ms_per_kctx:.3f} ms per 1k context tokens; "
          f"prefill attention: {latency.ms_per_mpair:.3f} ms per 1M pairs")
    print(f"saved {path}")
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from backfill.engine.hf_export import export_hf_dir
    from backfill.engine.weights import load_model

    out = export_hf_dir(load_model(args.model), Path(args.out_dir))
    print(f"exported HF directory to {out}")
    return 0


def _add_scenario_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--duration", type=float, default=90.0, help="seconds of online trace per mode")
    p.add_argument("--online-load", type=float, default=0.3, help="fraction of online capacity")
    p.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of inter-arrival times")
    p.add_argument("--prompt-len", default="uniform:64:256")
    p.add_argument("--output-len", default="uniform:16:64")
    p.add_argument("--offline-prompt-len", default="uniform:128:384")
    p.add_argument("--offline-output-len", default="uniform:64:192")
    p.add_argument("--offline-concurrency", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="default: online-only's P99 in this run")
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="default: online-only's P99 in this run")
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--preempt-target-ms", type=float, default=CoServeConfig.preempt_target_ms,
                   help="coserve: longest offline work between two safepoints (default: %(default)s ms)")
    p.add_argument("--interference-slack", type=float, default=None,
                   help="coserve: a co-serving step may take at most (1 + this) x its online work alone "
                        "(default 0.05; inf: no cap)")
    p.add_argument("--no-release-suspended", action="store_true",
                   help="coserve: co-serving steps never take requests of the offline step an arrival "
                        "suspended (by default they do where it pays for the step's lost work)")
    p.add_argument("--rider-cost-share", type=float, default=CoServeConfig.rider_cost_share,
                   help="coserve: an offline decode rides in a co-serving step only when it adds at most "
                        "this share of what an offline batch spends on a token (default: %(default)s)")
    p.add_argument("--json", default=None, help="also write all modes' metrics to this JSON file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="backfill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="stream a completion from the model")
    p.add_argument("prompt")
    _add_model_args(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with the Batch API for offline work")
    from backfill.server import add_serve_arguments, run_server

    add_serve_arguments(p)
    p.set_defaults(func=run_server)

    p = sub.add_parser("demo", help="the main job in a short run: online latency next to offline tokens harvested")
    _add_model_args(p)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of online trace per mode")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("engine", help="engine speed vs bandwidth floor and HF transformers")
    _add_model_args(p)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights of the default model's shape (speed does not depend on the values)")
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.set_defaults(func=cmd_bench_engine)

    p = bench.add_parser("coserve", help="online + offline co-serving scenario, all policies back to back")
    _add_scenario_args(p)
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), help=MODES_HELP)
    p.add_argument("--rounds", type=int, default=1,
                   help="interleave the modes in this many rounds of duration/rounds each and pool them "
                        "(ratios then compare modes run minutes apart less on a machine whose speed drifts)")
    p.add_argument("--warmup-s", type=float, default=30.0,
                   help="offline batching before the first round, not measured, so the first mode does not "
                        "run on an idle machine while the others follow a busy one (0: none)")
    p.add_argument("--url", default=None, help="measure this OpenAI-compatible server instead")
    p.add_argument("--served-model", default=None, help="model name to send with --url")
    p.add_argument("--label", default="http", help="mode name for --url results")
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", default="runs/coserve", help="report folder (JSON, Markdown, PNG)")
    p.set_defaults(func=cmd_bench_coserve)

    p = bench.add_parser("server", help="the coserve scenario in-process and over HTTP (backfill serve), side by side")
    _add_scenario_args(p)
    p.add_argument("--out", default="runs/server", help="report folder")
    p.set_defaults(func=cmd_bench_server)

    p = bench.add_parser("node", help="Valve: online + offline engine processes under the node runtime "
                                      "(options: see python -m backfill.node.bench --help)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)  # main() hands these to the node benchmark

    sim = sub.add_parser("sim", help="simulations: the real scheduler and policies, with steps costed "
                                     "on a virtual clock instead of run").add_subparsers(dest="sim", required=True)
    p = sim.add_parser("coserve", help="the coserve benchmark's scenario, simulated (seconds instead of minutes; "
                                       "any machine a step-cost table describes)")
    _add_scenario_args(p)
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), help=MODES_HELP)
    p.add_argument("--rounds", type=int, default=1, help="as bench coserve's: fresh traces, pooled")
    p.add_argument("--profile", default=None,
                   help="latency profile the policies plan with (default: the one `backfill profile` saved "
                        "for these model options)")
    p.add_argument("--machine", default=None,
                   help="latency-profile JSON of what steps cost on the simulated machine (default: the profile)")
    p.add_argument("--step-overhead-ms", type=float, default=0.0,
                   help="host time each step adds beyond its cost table (Python between steps)")
    p.add_argument("--noise-cv", type=float, default=0.0, help="lognormal spread of each step's time")
    p.add_argument("--out", default="runs/sim-coserve", help="report folder (JSON, Markdown, PNG)")
    p.set_defaults(func=cmd_sim_coserve, warmup_s=0.0)

    p = sub.add_parser("profile", help="measure and save the step-latency profile used by coserve")
    _add_model_args(p)
    p.add_argument("--out", default=None)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("export-hf", help="write the model as an HF directory (for transformers / vLLM)")
    p.add_argument("out_dir")
    p.add_argument("--model", default=None)
    p.set_defaults(func=cmd_export_hf)
    from backfill.realtime.cli import add_commands as add_realtime_commands
    add_realtime_commands(sub, bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "node"]:  # its own option parser, --help included
        from backfill.node.bench import main as node_bench_main

        try:
            node_bench_main(argv[2:])
        except BackfillError as exc:
            print(f"backfill: error: {exc}", file=sys.stderr)
            return 2
        return 0
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BackfillError as exc:
        print(f"backfill: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
