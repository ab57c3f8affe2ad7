"""The serving commands: generate, serve, demo, profile, export-hf."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
import sys
from pathlib import Path

from backfill.cli.command_parser import CommandParser
from backfill.cli.engine_args import add_engine_args, model_serving_options, scenario_from_args, serving_config


def add_commands(commands: CommandParser) -> None:
    commands.defer("generate", "stream a completion from the model", _fill_generate)
    commands.defer("serve", "OpenAI-compatible HTTP server with the Batch API for offline work", _fill_serve)
    commands.defer("demo", "the main job in a short run: online latency next to offline tokens harvested",
                   _fill_demo)
    commands.defer("profile", "measure and save the step-latency profile used by coserve", _fill_profile)
    commands.defer("export-hf", "write the model as an HF directory (for transformers / vLLM)", _fill_export_hf)


def cmd_generate(args: argparse.Namespace) -> int:
    from backfill.sampling_params import SamplingParams
    from backfill.serving.llm import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    llm = LLM(serving_config(args, policy="fcfs"))
    for delta in llm.stream(args.prompt, params, chat=not args.raw):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """backfill's main job in one short run: online traffic alone, then with offline work harvested."""
    from backfill.bench.coserve_bench import (MIN_ONLINE_REQUESTS, headline, load_and_profile, online_rate_per_s,
                                              run_coserve_bench, size_offline_to_machine)

    # A shorter warm-up than the bench's: the demo is a short run (see backfill/bench/coserve_bench.py).
    scenario = scenario_from_args(args, offline_concurrency=32, warmup_s=20.0)
    serving = serving_config(args)
    print(f"backfill demo: {scenario.duration_s:.0f} s of online traffic (gamma arrivals, "
          f"{scenario.online_load:.0%} of this machine) served alone, then co-served with a backlog of offline "
          f"batch requests (after a {scenario.warmup_s:.0f} s warm-up).\nLoading the model and its step-latency "
          "profile (measured once per machine; its progress shows)...", flush=True)
    prepared = load_and_profile(serving, print)
    expected = online_rate_per_s(scenario, prepared[2]) * scenario.duration_s
    if expected < MIN_ONLINE_REQUESTS:
        # A slow machine (an AVX2-only CPU, say) runs the demo longer rather than not at all.
        one_s = scenario.online_load / online_rate_per_s(scenario, prepared[2])
        longer_s = math.ceil(MIN_ONLINE_REQUESTS * one_s / scenario.online_load)
        print(f"This machine's step-latency profile says one online request takes {one_s:.1f} s alone, so "
              f"{scenario.online_load:.0%} of it is {expected:.1f} online requests in {scenario.duration_s:.0f} s: "
              f"running {longer_s} s a mode instead, for {MIN_ONLINE_REQUESTS} (if the machine was busy when the "
              "profile was measured, `backfill profile` measures it again).", flush=True)
        scenario = replace(scenario, duration_s=float(longer_s))
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


def cmd_profile(args: argparse.Namespace) -> int:
    from backfill.engine.weights import load_model
    from backfill.serving.build import build_runner, default_profile_path
    from backfill.serving.profiler import profile_latency

    cfg = serving_config(args)
    loaded = load_model(cfg.model)
    runner = build_runner(loaded.config, loaded.weights, cfg)
    choice = runner.model.kernel_choice
    if choice is not None:  # which kernel multiplies each weight at each step size (engine/kernel_choice.py)
        print(f"matmul kernel per weight and step rows, measured on this machine:\n{choice.format()}")
    if runner.model.paged_decode_attention is not None:
        import torch

        from backfill.engine.paged_attention import shared_prefix_tiles_available

        tiles = cfg.compute_dtype == torch.bfloat16 and shared_prefix_tiles_available()
        print("decode attention over shared prefix blocks: " + ("AMX tiles" if tiles else "vector FMAs"))
    latency = profile_latency(runner, model_name=loaded.config.name)
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


def _run_server(args: argparse.Namespace) -> int:
    from backfill.node.config import is_node_config
    from backfill.server.serve import run_server

    if args.config and is_node_config(args.config):  # a [[models]] file: several models on one node
        from backfill.node.host import run_node

        return run_node(args.config, getattr(args, "device", None))  # a node file alone parses no engine flags
    return run_server(args)


def _fill_generate(p: argparse.ArgumentParser) -> None:
    from backfill.options import add_arguments

    p.add_argument("prompt")
    add_engine_args(p)
    add_arguments(p, model_serving_options())   # --max-model-len, as `serve` takes it
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

    add_engine_args(p)
    add_arguments(p, tuple(o for o in options_of(CoserveScenario) if o.name == "duration"), {"duration": 30.0})
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_demo)


def _fill_profile(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--out", default=None)
    p.set_defaults(func=cmd_profile)


def _fill_export_hf(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir")
    p.add_argument("--model", default=None)
    p.set_defaults(func=cmd_export_hf)
