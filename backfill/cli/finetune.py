"""`backfill finetune run` (a standalone LoRA job), `backfill finetune profile` (HARLI §5's latency
predictor) and `backfill bench finetune`; the server's jobs are `backfill finetune create` and its
siblings (backfill/cli/fine_tuning_client.py)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from backfill.cli.command_parser import CommandParser
from backfill.cli.engine_args import add_engine_args, serving_config

if TYPE_CHECKING:
    from backfill.finetune.config import FinetuneConfig


def add_commands(commands: CommandParser) -> None:
    commands.group("finetune", "LoRA finetuning: a job on this machine, HARLI's latency profile, or jobs on a "
                               "running server's fine-tuning API")
    commands.defer("finetune run", "LoRA-finetune the model on a chat JSONL file (OpenAI format), standalone; "
                                   "resumes from --out", _fill_run)
    commands.defer("finetune profile", "fit HARLI's co-location latency predictor (HARLI §5) on this machine "
                                       "and save it", _fill_profile)
    commands.defer("bench finetune", "HARLI: finetuning beside the decode trace: a solo reference, then "
                                     "separate / static / pause-only / harli (and partitioned, not in --sim)", _fill_bench)
    commands.defer("sim finetune", "HARLI's device form simulated: SM partitions between decode and LoRA "
                                   "finetuning on the H200 shape, four modes and a sensitivity table", _fill_sim)


def _fill_run(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--training-file", type=Path, required=True, help="JSONL, one {\"messages\": [...]} per line")
    p.add_argument("--out", type=Path, required=True,
                   help="job directory: checkpoints, events.jsonl, adapter/ (resumes from it)")
    _add_config_args(p)
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU share of this process)")
    p.set_defaults(func=cmd_finetune_run)


def _fill_profile(p: argparse.ArgumentParser) -> None:
    from backfill.finetune.config import FinetuneConfig

    add_engine_args(p)
    d = FinetuneConfig()
    p.add_argument("--rank", type=int, default=d.rank)
    p.add_argument("--alpha", type=float, default=d.alpha)
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len, help="capped at 128 for the profile")
    p.add_argument("--layers-per-unit", type=int, default=d.layers_per_unit)
    p.add_argument("--loss-rows-per-unit", type=int, default=d.loss_rows_per_unit)
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU share of this process)")
    p.add_argument("--repeats", type=int, default=11, help="token intervals per grid point")
    p.add_argument("--json", default=None, help="also write the points and errors here")
    p.set_defaults(func=cmd_finetune_profile)


def _fill_bench(p: argparse.ArgumentParser) -> None:
    from backfill.bench.finetune_bench import MODES

    add_engine_args(p)
    p.add_argument("--duration", type=float, default=40.0, help="seconds of trace per mode per round")
    p.add_argument("--rounds", type=int, default=2, help="modes interleaved in this many rounds (fresh trace each)")
    p.add_argument("--online-load", type=float, default=0.4, help="online trace load (fraction of capacity)")
    p.add_argument("--tpot-target-ms", type=float, default=None,
                   help="decode QoS target (P99 TPOT); unset: --tpot-target-x-solo x the solo P99 TPOT")
    p.add_argument("--tpot-target-x-solo", type=float, default=1.5,
                   help="the target as a multiple of the first round's solo P99 TPOT")
    p.add_argument("--static-share-infer", type=float, default=0.6)
    p.add_argument("--ft-threads", type=int, default=1, help="separate: the finetuning process's threads")
    p.add_argument("--modes", default=None, help=f"comma-separated, from {', '.join(MODES)} (default: all; with "
                   "--sim all but partitioned, which needs real cores)")
    p.add_argument("--out", default="runs/bench-finetune", help="folder for the JSON result")
    p.add_argument("--sim", action="store_true", help="run the modes in the simulator (bench/sim/finetune_sim.py) on the "
                                                      "fitted predictor instead of the real engine")
    p.add_argument("--sim-noise-cv", type=float, default=0.05)
    p.set_defaults(func=cmd_bench_finetune)
    _add_config_args(p)


def cmd_bench_finetune(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from backfill.bench.finetune_bench import run_bench_finetune

    # One job runs through every mode: it must not end (or checkpoint) within one.
    config = replace(config_from_args(args), max_steps=100_000, checkpoint_every_steps=100_000)
    return run_bench_finetune(args, serving_config(args, policy="fcfs"), config)


def _fill_sim(p: argparse.ArgumentParser) -> None:
    from backfill.bench.sim.sm_config import SmDeviceConfig, SmSimScenario
    from backfill.options import add_arguments, options_of

    add_arguments(p, options_of(SmDeviceConfig))
    add_arguments(p, options_of(SmSimScenario))
    p.add_argument("--loads", type=float, nargs="+", default=[0.3, 0.6],
                   help="online loads to run (each overrides --online-load)")
    p.add_argument("--modes", nargs="+", default=["separate", "static", "pause-only", "harli"],
                   help="modes besides solo: separate, static, pause-only, harli")
    p.add_argument("--sensitivity", action=argparse.BooleanOptionalAction, default=True,
                   help="also rerun harli, static and pause-only with each stated parameter varied")
    p.add_argument("--json", default="runs/sim-finetune.json", help="where the result JSON goes")
    p.set_defaults(func=cmd_sim_finetune)


def cmd_sim_finetune(args: argparse.Namespace) -> int:
    from backfill.errors import SimDeviceError
    from backfill.bench.sim import finetune_sm_sim as sim_sm
    from backfill.bench.sim.sm_config import SmDeviceConfig, SmSimScenario
    from backfill.options import build, given, options_of

    config = build(SmDeviceConfig, given(args, options_of(SmDeviceConfig)))
    scenario = build(SmSimScenario, given(args, options_of(SmSimScenario)))
    if unknown := [m for m in args.modes if m not in sim_sm.MODES]:
        raise SimDeviceError(f"unknown modes {unknown}; choose among {', '.join(sim_sm.MODES)}")
    for load in args.loads:
        SmSimScenario(online_load=load)  # the scenario's own check, for each load
    result = sim_sm.run(config, scenario, tuple(args.loads), args.sensitivity, modes=tuple(args.modes),
                        log=lambda m: print(m, flush=True))
    print("simulated (stated device parameters, not a GPU measurement):")
    print(sim_sm.markdown(result))
    if "sensitivity" in result:
        print(sim_sm.sensitivity_markdown(result["sensitivity"]))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


def _add_config_args(p: argparse.ArgumentParser) -> None:
    from backfill.finetune.config import ALL_TARGETS, FinetuneConfig

    d = FinetuneConfig()
    p.add_argument("--rank", type=int, default=d.rank)
    p.add_argument("--alpha", type=float, default=d.alpha)
    p.add_argument("--targets", default=",".join(d.target_modules), help=f"comma list among {','.join(ALL_TARGETS)}")
    p.add_argument("--learning-rate", type=float, default=d.learning_rate)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: --epochs over the file)")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every_steps)
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len)
    p.add_argument("--layers-per-unit", type=int, default=d.layers_per_unit)
    p.add_argument("--loss-rows-per-unit", type=int, default=d.loss_rows_per_unit,
                   help="target tokens per LM-head/loss unit (HARLI §6.1)")


def config_from_args(args: argparse.Namespace, base_model: str = "") -> FinetuneConfig:
    from backfill.finetune.config import FinetuneConfig

    return FinetuneConfig(rank=args.rank, alpha=args.alpha, target_modules=tuple(t for t in args.targets.split(",") if t),
                          learning_rate=args.learning_rate, max_steps=args.steps, epochs=args.epochs,
                          batch_size=args.batch_size, micro_batch_size=args.micro_batch_size, seed=args.seed,
                          checkpoint_every_steps=args.checkpoint_every, max_seq_len=args.max_seq_len,
                          layers_per_unit=args.layers_per_unit, loss_rows_per_unit=args.loss_rows_per_unit,
                          base_model=base_model)


def _load_model(args: argparse.Namespace, **serving_changes):
    """The serving config and the model the engine serves (its kernels and layout), with a small KV pool."""
    import torch

    from backfill.engine.weights import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    serving = serving_config(args, **({"kv_cache_gb": 0.25} | serving_changes))
    loaded = load_model(serving.model)
    return serving, loaded


PROGRESS_EVERY_S = 5.0
# samples/s is the pace of the last few steps: a rate over the whole run would lag a change of pace
# (another process taking a core) by as long as the run has lasted.
RATE_WINDOW_STEPS = 5


def time_left(job, first_step: float, elapsed_s: float) -> str:
    """The estimate from the pace of this run so far (steps done, a step in flight counted by its pieces)."""
    done = job.progress_steps - first_step
    if done <= 0:
        return "time left: measuring"
    left_s = (job.total_steps - job.progress_steps) * elapsed_s / done
    return f"about {left_s / 60:.1f} min left" if left_s >= 90 else f"about {left_s:.0f} s left"


def recent_samples_per_s(events: list[dict], run_started_unix_s: float,
                         window_steps: int = RATE_WINDOW_STEPS) -> float | None:
    """Samples per second over the last `window_steps` steps of this run (events: the job's step
    events, each with its wall-clock `time` and `samples`); steps before this run started (a resumed
    job's) are not counted, and the first step of a run is timed from the run's start."""
    mine = [e for e in events if e["time"] >= run_started_unix_s]
    if not mine:
        return None
    recent = mine[-window_steps:]
    earlier = mine[-window_steps - 1]["time"] if len(mine) > window_steps else run_started_unix_s
    span_s = recent[-1]["time"] - earlier
    return sum(e["samples"] for e in recent) / span_s if span_s > 0 else None


def resume_command(argv: list[str]) -> str:
    """The command line that resumes this job: the same one (it resumes from --out)."""
    import shlex

    return "backfill " + shlex.join(argv)


def cmd_finetune_run(args: argparse.Namespace) -> int:
    import signal
    import sys

    from backfill.finetune.data import load_training_file
    from backfill.finetune.job import FinetuneJob
    from backfill.serving.build import build_runner

    # Training never decodes nor reads the paged KV cache: no compiled steps, no paged-attention
    # kernel to build.
    serving, loaded = _load_model(args, decode_attention="sdpa", prompt_attention="sdpa", compile_decode=False)
    config = config_from_args(args, base_model=loaded.config.name)  # bad values fail before the model is built
    samples = load_training_file(args.training_file, loaded.tokenizer, config.max_seq_len)  # and a bad file
    runner = build_runner(loaded.config, loaded.weights, serving)
    job = FinetuneJob(runner.model, loaded.tokenizer, args.training_file, config, args.out, samples=samples)
    print(f"finetuning {loaded.config.name}: {len(job.samples)} examples, {job.total_steps} steps "
          f"(from step {job.steps_done}), rank {config.rank}, targets {','.join(config.target_modules)}", flush=True)
    started, started_unix_s, printed = time.perf_counter(), time.time(), len(job.events)
    first_step, shown = job.progress_steps, time.perf_counter()

    def on_sigterm(signum, frame) -> None:   # SIGTERM ends the run as Ctrl-C does: with how to resume
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        while job.run_unit():
            now = time.perf_counter()
            for event in job.events[printed:]:
                rate = recent_samples_per_s(job.events[:job.events.index(event) + 1], started_unix_s)
                print(f"step {event['step']:5d}/{job.total_steps}  loss {event['loss']:.4f}  "
                      f"{'-' if rate is None else f'{rate:.2f}'} samples/s  "
                      f"{time_left(job, first_step, now - started)}", flush=True)
                shown = now
            printed = max(printed, len(job.events)) if job.events else printed
            if now - shown >= PROGRESS_EVERY_S:  # a step takes minutes on a slow CPU: show it moving
                print(f"step {job.steps_done + 1:5d}/{job.total_steps}  {100 * (job.progress_steps % 1):.0f}% of "
                      f"its layer pieces done  {time_left(job, first_step, now - started)}", flush=True)
                shown = now
    except KeyboardInterrupt:
        saved = job.checkpoints()
        at = f"step {saved[-1][0]}" if saved else "the start (no checkpoint yet)"
        print(f"\ninterrupted at step {job.steps_done}/{job.total_steps}; the newest checkpoint is at {at} "
              f"(one every {config.checkpoint_every_steps} steps). Resume with:\n  {resume_command(getattr(args, 'argv', None) or sys.argv[1:])}",
              flush=True)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"adapter: {args.out / 'adapter'}")
    return 0


def cmd_finetune_profile(args: argparse.Namespace) -> int:
    from backfill.finetune.colocate import harli_profile_path
    from backfill.finetune.config import FinetuneConfig
    from backfill.finetune.profile import profile_finetune
    from backfill.serving.build import build_runner

    serving, loaded = _load_model(args, kv_cache_gb=0.5)  # every profiled decode batch at once
    runner = build_runner(loaded.config, loaded.weights, serving)
    config = FinetuneConfig(rank=args.rank, alpha=args.alpha, batch_size=1, micro_batch_size=1,
                            max_seq_len=min(args.max_seq_len, 128), max_steps=10_000, checkpoint_every_steps=10_000,
                            layers_per_unit=args.layers_per_unit, loss_rows_per_unit=args.loss_rows_per_unit)
    result = profile_finetune(runner, loaded.tokenizer, repeats=args.repeats, model_name=loaded.config.name,
                              config=config, log=lambda m: print(m, flush=True))
    lat = result.latency
    run = "run(bs)" if lat.run_batches else "bs"
    for f in lat.solo:
        print(f"stage 1, share {f.share:.2f}: Lat_dec = {run}*{f.b0:.3f} + {f.c0:.3f} + bs*{f.k0 * 1e3:.4f}e-3*seqlen ms")
    if lat.run_batches:
        print(f"  run(bs): the batch the engine's weight matmuls run at, the smallest of {lat.run_batches} that holds bs")
    kinds = " + ".join(f"share_{k}*{v:.3f}" for k, v in lat.k1_kind.items())
    print(f"stage 2: Lat_colo = (share_infer*{lat.b1:.3f} + {kinds}) * Lat_dec(share_infer); "
          f"kind-average k1 {lat.k1:.3f}")
    for name, e in lat.errors.items():
        print(f"error {name:21s}: mean {e['mean'] * 100:5.2f}%  max {e['max'] * 100:5.2f}%  ({e['points']} points)")
    print(f"decode step (bs 1): {result.decode_ms:.1f} ms; finetune pieces: "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in result.unit_ms.items()))
    path = lat.save(harli_profile_path(loaded.config.name))
    print(f"saved {path}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "latency": json.loads(path.read_text()), "solo_points": result.solo_points,
            "colo_points": result.colo_points, "held_out": result.held_out, "decode_ms": result.decode_ms,
            "unit_ms": result.unit_ms, "colo_samples": result.colo_samples,
            "solo_samples": result.solo_samples, "remeasured": result.remeasured, "rejected": result.rejected,
            "threads": __import__("torch").get_num_threads()}, indent=1))
        print(f"wrote {args.json}")
    return 0
