"""The `backfill` command line."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from backfill.command_parser import CommandParser
from backfill.errors import BackfillError, InvalidRequestError

# The commands here run the fastest sound dtype by default; `backfill serve` keeps ServingConfig's
# float32 unless asked, so a server's outputs do not change with the CPU it lands on.
CLI_DEFAULTS = {"dtype": "auto"}


def _engine_options():
    from backfill.options import options_of
    from backfill.serving.config import ServingConfig

    return options_of(ServingConfig, "engine")


def _coserve_options():
    from backfill.options import options_of
    from backfill.policy.coserve import CoServeConfig

    return options_of(CoServeConfig, "coserve")


def _add_model_args(p: argparse.ArgumentParser, several: tuple[str, ...] = ()) -> None:
    """The engine's options; those named in `several` take one or more values (a benchmark compares
    them) and land in args.<name>_compared, so they never reach the config directly."""
    from backfill.engine.shapes import add_shape_args
    from backfill.options import add_arguments

    add_arguments(p, tuple(o for o in _engine_options() if o.name not in several), CLI_DEFAULTS)
    for o in _engine_options():
        if o.name in several:
            p.add_argument(o.flag, dest=f"{o.name}_compared", nargs="+", choices=o.choices, default=[o.default],
                           help=f"{o.help}; several are measured in turn (default: {o.default})")
    add_shape_args(p)


# The serving options a one-off command takes beside the engine's, as `serve` does.
MODEL_SERVING_OPTIONS = ("max_model_len",)


def _model_serving_options():
    from backfill.options import options_of
    from backfill.serving.config import ServingConfig

    return tuple(o for o in options_of(ServingConfig, "serving") if o.name in MODEL_SERVING_OPTIONS)


def _serving(args: argparse.Namespace, **changes):
    """The ServingConfig of the engine (and, where the command has them, coserve) flags given."""
    from backfill.engine.shapes import model_from_args
    from backfill.options import build, given
    from backfill.serving.config import ServingConfig

    values = given(args, _engine_options() + _coserve_options() + _model_serving_options()) | changes
    if getattr(args, "random_weights", False) or getattr(args, "shape", None) is not None:
        values["model"] = model_from_args(args)
    return build(ServingConfig, values)


def cmd_generate(args: argparse.Namespace) -> int:
    from backfill.engine.sampling_params import SamplingParams
    from backfill.serving.config import ServingConfig
    from backfill.serving.llm import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    llm = LLM(_serving(args, policy="fcfs"))
    for delta in llm.stream(args.prompt, params, chat=not args.raw):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from backfill.bench.engine_bench import run_engine_bench

    cfg = _serving(args)
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


DEFAULT_MODES = ("online-only", "fcfs", "priority", "coserve")
MODES_HELP = ("policies to run in turn (online-only, fcfs, priority, coserve); a variant adds knobs, e.g. "
              "coserve:rider_cost_share=1,interference_slack=0.1, and runs interleaved with the others")


def _scenario(args: argparse.Namespace, **changes):
    from backfill.bench.scenario import CoserveScenario
    from backfill.options import build, given, options_of

    return build(CoserveScenario, given(args, options_of(CoserveScenario)) | changes)


def cmd_bench_coserve(args: argparse.Namespace) -> int:
    from backfill.bench.coserve_bench import run_coserve_bench, run_http_bench, run_http_with_baseline, save_json
    scenario = _scenario(args)
    serving = _serving(args)
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

        loaded, _, latency = load_and_profile(serving)
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
        prepared = load_and_profile(serving)  # one model load for every point
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
    from backfill.sim.coserve_sim import load_inputs, simulate_coserve

    scenario = _scenario(args)
    serving = _serving(args)
    config, latency, machine = load_inputs(serving, args.profile, args.machine, args.step_overhead_ms, args.noise_cv)
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


def cmd_demo(args: argparse.Namespace) -> int:
    """backfill's main job in one short run: online traffic alone, then with offline work harvested."""
    from backfill.bench.coserve_bench import (MIN_ONLINE_REQUESTS, headline, load_and_profile, online_rate_per_s,
                                              run_coserve_bench, size_offline_to_machine)

    # A shorter warm-up than the bench's: the demo is a short run (see backfill/bench/coserve_bench.py).
    scenario = _scenario(args, offline_concurrency=32, warmup_s=20.0)
    serving = _serving(args)
    print(f"backfill demo: {scenario.duration_s:.0f} s of online traffic (gamma arrivals, "
          f"{scenario.online_load:.0%} of this machine) served alone, then co-served with a backlog of offline "
          f"batch requests (after a {scenario.warmup_s:.0f} s warm-up).\nLoading the model and its step-latency "
          "profile (measured once per machine; its progress shows)...", flush=True)
    prepared = load_and_profile(serving)
    expected = online_rate_per_s(scenario, prepared[2]) * scenario.duration_s
    if expected < MIN_ONLINE_REQUESTS:
        one_s = scenario.online_load / online_rate_per_s(scenario, prepared[2])
        raise InvalidRequestError(
            f"this machine's step-latency profile says one online request takes {one_s:.1f} s alone, so "
            f"{scenario.online_load:.0%} of it is {expected:.1f} online requests in {scenario.duration_s:.0f} s "
            f"(the demo needs {MIN_ONLINE_REQUESTS}): give --duration "
            f"{math.ceil(MIN_ONLINE_REQUESTS * one_s / scenario.online_load)} or more, or, if the machine was busy "
            "when the profile was measured, measure it again on a quiet one (`backfill profile`)")
    sized = size_offline_to_machine(scenario, prepared[2])
    if sized != scenario:
        print(f"Offline requests sized to this machine's measured speed: prompts {sized.offline_prompt_len}, "
              f"outputs {sized.offline_output_len} tokens (so that they finish within the window).", flush=True)
    # The bench's stage lines (warm-up, each mode) show where the run is, as its progress bars do.
    results = run_coserve_bench(sized, serving, ("online-only", "coserve"), args.out, log=print,
                                progress=not args.quiet, prepared=prepared)
    print("\n" + headline(results))
    print("\n" + demo_summary(results["online-only"].metrics, results["coserve"].metrics, args.out))
    model = results["coserve"].config["model"]  # the id the server answers to (the request must name it)
    print("\nServe it over HTTP (OpenAI-compatible; offline work via the Batch API or service_tier=flex):\n"
          "  backfill serve --port 8000\n"
          "  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'")
    return 0


def demo_summary(alone, co, out_dir: str) -> str:
    """The demo's result in one line: offline tokens harvested, online latency next to online-only's."""
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f} ms"

    harvested = (f"Harvested {co.offline.output_tokens:,} offline tokens ({co.offline.tokens_per_s:,.1f} tokens/s) "
                 f"in {co.duration_s:.0f} s" if co.offline.output_tokens else
                 f"Harvested no offline token in {co.duration_s:.0f} s (give a longer --duration)")
    return (f"{harvested}; online P99 TTFT {ms(co.online.ttft_ms.p99)} (online-only: {ms(alone.online.ttft_ms.p99)}), "
            f"P99 TPOT {ms(co.online.tpot_ms.p99)} (online-only: {ms(alone.online.tpot_ms.p99)}). "
            f"Full report: {out_dir}/report.md")


def cmd_bench_server(args: argparse.Namespace) -> int:
    from backfill.bench.coserve_bench import save_json
    from backfill.bench.server_overhead import run_server_overhead_bench
    from backfill.serving.api import SLO
    scenario = _scenario(args)
    slo = SLO(scenario.ttft_slo_ms or 300.0, scenario.tpot_slo_ms or 60.0)
    results = run_server_overhead_bench(scenario, _serving(args), slo, args.out)
    if args.json:
        save_json(results, args.json)
        print(f"wrote {args.json}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from backfill.engine.weights import load_model
    from backfill.serving.build import build_runner, default_profile_path
    from backfill.serving.profiler import profile_latency

    cfg = _serving(args)
    loaded = load_model(cfg.model)
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


def _add_scenario_args(p: argparse.ArgumentParser, rounds: dict | None = None) -> None:
    """The scenario's, the engine's and coserve's options; with rounds (the command's defaults),
    also --rounds and --warmup-s."""
    from backfill.bench.scenario import CoserveScenario
    from backfill.options import add_arguments, options_of

    _add_model_args(p)
    add_arguments(p, options_of(CoserveScenario, "scenario"))
    if rounds is not None:
        add_arguments(p, options_of(CoserveScenario, "rounds"), rounds)
    add_arguments(p, _coserve_options())
    p.add_argument("--json", default=None, help="also write all modes' metrics to this JSON file")


def _add_frontier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--loads", nargs="+", type=float, default=None,
                   help="run once per online load and print the frontier (SLO attainment, offline tok/s per mode)")
    p.add_argument("--slos", nargs="+", default=None, metavar="TTFT_MS/TPOT_MS",
                   help="run once per SLO setting, e.g. 200/15 100/10 (alone: online-only's own P99s), and "
                        "print the frontier")


def _run_server(args: argparse.Namespace) -> int:
    from backfill.node.config import is_node_config
    from backfill.server.serve import run_server

    if args.config and is_node_config(args.config):  # a [[models]] file: several models on one node
        from backfill.node.host import run_node

        return run_node(args.config)
    return run_server(args)


def _fill_generate(p: argparse.ArgumentParser) -> None:
    from backfill.options import add_arguments

    p.add_argument("prompt")
    _add_model_args(p)
    add_arguments(p, _model_serving_options())   # --max-model-len, as `serve` takes it
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.set_defaults(func=cmd_generate)


def _fill_serve(p: argparse.ArgumentParser) -> None:
    from backfill.server.config import add_serve_arguments

    add_serve_arguments(p)
    p.set_defaults(func=_run_server)


def _fill_demo(p: argparse.ArgumentParser) -> None:
    from backfill.bench.scenario import CoserveScenario
    from backfill.options import add_arguments, options_of

    _add_model_args(p)
    add_arguments(p, tuple(o for o in options_of(CoserveScenario) if o.name == "duration"), {"duration": 30.0})
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_demo)


def _fill_bench_engine(p: argparse.ArgumentParser) -> None:
    _add_model_args(p, several=("cuda_kernels",))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.set_defaults(func=cmd_bench_engine)


def _fill_bench_coserve(p: argparse.ArgumentParser) -> None:
    _add_scenario_args(p, rounds={})
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), help=MODES_HELP)
    p.add_argument("--url", default=None, help="measure this OpenAI-compatible server instead")
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
    _add_frontier_args(p)
    p.set_defaults(func=cmd_bench_coserve)


def _fill_bench_server(p: argparse.ArgumentParser) -> None:
    _add_scenario_args(p)
    p.add_argument("--out", default="runs/server", help="report folder")
    p.set_defaults(func=cmd_bench_server)


def _fill_bench_node(p: argparse.ArgumentParser) -> None:
    p.add_argument("rest", nargs=argparse.REMAINDER)  # main() hands these to the node benchmark


def _fill_sim_coserve(p: argparse.ArgumentParser) -> None:
    _add_scenario_args(p, rounds={"warmup_s": 0.0})
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), help=MODES_HELP)
    p.add_argument("--profile", default=None,
                   help="latency profile the policies plan with (default: the one `backfill profile` saved "
                        "for these model options)")
    p.add_argument("--machine", default=None,
                   help="latency-profile JSON of what steps cost on the simulated machine (default: the profile)")
    p.add_argument("--step-overhead-ms", type=float, default=0.0,
                   help="host time each step adds beyond its cost table (Python between steps)")
    p.add_argument("--noise-cv", type=float, default=0.0, help="lognormal spread of each step's time")
    p.add_argument("--out", default="runs/sim-coserve", help="report folder (JSON, Markdown, PNG)")
    _add_frontier_args(p)
    p.set_defaults(func=cmd_sim_coserve)


def _fill_profile(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--out", default=None)
    p.set_defaults(func=cmd_profile)


def _fill_export_hf(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir")
    p.add_argument("--model", default=None)
    p.set_defaults(func=cmd_export_hf)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `backfill` parser. With argv, only the command it names gets its options, so that
    `backfill --help` imports no config dataclass, torch or server; None builds every command."""
    from backfill.cluster.cli import add_commands as add_cluster_commands
    from backfill.finetune.cli import add_commands as add_finetune_commands
    from backfill.offload.cli import add_commands as add_offload_commands
    from backfill.realtime.cli import add_commands as add_realtime_commands
    from backfill.server.bench_cli import add_commands as add_server_bench_commands
    from backfill.server.finetune_cli import add_commands as add_fine_tuning_api_commands

    commands = CommandParser("backfill", __doc__, argv, announce=lambda line: print(line, file=sys.stderr, flush=True))
    commands.defer("generate", "stream a completion from the model", _fill_generate)
    commands.defer("serve", "OpenAI-compatible HTTP server with the Batch API for offline work", _fill_serve)
    commands.defer("demo", "the main job in a short run: online latency next to offline tokens harvested",
                   _fill_demo)
    commands.group("bench", "benchmarks")
    commands.defer("bench engine", "engine speed vs bandwidth floor and HF transformers", _fill_bench_engine)
    commands.defer("bench coserve", "online + offline co-serving scenario, all policies back to back",
                   _fill_bench_coserve)
    commands.defer("bench server", "the coserve scenario in-process and over HTTP (backfill serve), side by side",
                   _fill_bench_server)
    commands.defer("bench node", "Valve: online + offline engine processes under the node runtime "
                                 "(options: see python -m backfill.node.bench --help)", _fill_bench_node,
                   add_help=False)
    commands.group("sim", "simulations: the real scheduler and policies, with steps costed on a virtual clock "
                          "instead of run")
    commands.defer("sim coserve", "the coserve benchmark's scenario, simulated (seconds instead of minutes; "
                                  "any machine a step-cost table describes)", _fill_sim_coserve)
    commands.defer("profile", "measure and save the step-latency profile used by coserve", _fill_profile)
    commands.defer("export-hf", "write the model as an HF directory (for transformers / vLLM)", _fill_export_hf)
    # Each capability registers its commands from its own layer.
    add_finetune_commands(commands)
    add_fine_tuning_api_commands(commands)
    add_offload_commands(commands)
    add_cluster_commands(commands)
    add_realtime_commands(commands)
    add_server_bench_commands(commands)
    return commands.parser


# Steps that take minutes on a slow machine log their progress at INFO from these modules.
PROGRESS_LOGGERS = ("backfill.serving.profiler", "backfill.serving.build", "backfill.engine.native_build")


def show_progress_logs() -> None:
    """Print the progress lines of PROGRESS_LOGGERS on stderr, so that a command measuring a profile
    (minutes on a slow CPU) never looks hung; `serve` configures its own logging."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in PROGRESS_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
            logger.addHandler(handler)
            logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["serve"]:
        show_progress_logs()
    if argv[:2] == ["bench", "node"]:  # its own option parser, --help included
        from backfill.node.bench import main as node_bench_main

        try:
            node_bench_main(argv[2:])
        except BackfillError as exc:
            print(f"backfill: error: {exc}", file=sys.stderr)
            return 2
        return 0
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except BackfillError as exc:
        print(f"backfill: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
