"""`backfill bench disb` and `backfill bench preempt` (REEF §6), and `backfill realtime idempotence`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from backfill.cli.command_parser import CommandParser


def _scales(args: argparse.Namespace) -> dict[str, float]:
    from backfill.realtime.config import ALL_MODELS, DISB_SCALES, TINY_SCALES

    if args.size == "full":
        return {name: 1.0 for name in ALL_MODELS}
    return dict(TINY_SCALES if args.size == "tiny" else DISB_SCALES)


def _renice(args: argparse.Namespace) -> None:
    if args.nice:
        os.nice(args.nice)  # workers forked later inherit it


def cmd_disb(args: argparse.Namespace) -> int:
    from backfill.bench.realtime_bench import ALL_MODELS, run_disb, write_json

    from backfill.realtime.config import MODE_CONFIGS

    _renice(args)
    all_models = tuple(m for m in ALL_MODELS if m not in args.exclude)
    modes = args.modes
    if args.device == "cuda" and modes == list(MODE_CONFIGS):  # the default list: the modes CUDA has
        from backfill.realtime.cuda_scheduler import CUDA_MODES

        modes = list(CUDA_MODES)
    report = run_disb([w.upper() for w in args.workload], modes, args.duration, args.rounds, args.seed,
                      _scales(args), all_models, args.file, Path(args.metadata_dir) if args.metadata_dir else None,
                      rt_load_scale=args.rt_load_scale, device=args.device)
    report["size"] = args.size
    write_json(report, args.json)
    return 0


def cmd_preempt(args: argparse.Namespace) -> int:
    from backfill.bench.realtime_bench import bench_preemption, write_json

    _renice(args)
    out = bench_preemption(args.models, args.paths, args.trials, _scales(args), args.seed,
                           Path(args.metadata_dir) if args.metadata_dir else None)
    write_json({"size": args.size, "trials": args.trials, "models": out}, args.json)
    return 0


def cmd_idempotence(args: argparse.Namespace) -> int:
    from backfill.progress import Heartbeat
    from backfill.bench.realtime_bench import load_models, write_json
    from backfill.realtime.idempotence import format_table

    scales = _scales(args)
    maps = []
    for k, name in enumerate(args.models):
        print(f"{name} ({k + 1}/{len(args.models)}): building it and analysing its ops (a saved map is reused)",
              flush=True)
        with Heartbeat(lambda line: print(line, flush=True), name):
            served = load_models({name}, scales, Path(args.metadata_dir))[name]
        maps.append(served.imap)
    print(format_table(maps))
    write_json({"models": [m.summary() for m in maps], "size": args.size}, args.json)
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=["disb", "full", "tiny"], default="disb",
                   help="model widths: disb (ms to tens of ms per inference on a CPU core: ResNet/VGG at half "
                        "width, BERT/GPT-2 at quarter width), full (the real widths) or tiny (tests)")
    p.add_argument("--metadata-dir", default="runs/realtime/idempotence",
                   help="where idempotence maps are saved and reused (one JSON per model and size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.add_argument("--nice", type=int, default=0,
                   help="renice the benchmark (and its workers) by this much, e.g. -10 on a machine shared with "
                        "other jobs (needs privilege); all modes get the same")


def add_commands(commands: CommandParser) -> None:
    commands.defer("bench disb", "REEF's DISB A-E: RT latency and throughput of seq / concurrent / rt-only / reef",
                   _fill_disb)
    commands.defer("bench preempt", "REEF preemption latency (RT arrival to BE stopped) per path and model",
                   _fill_preempt)
    commands.defer("idempotence", "REEF §4.4 idempotence table of the DNN models (saves the maps)",
                   _fill_idempotence)


def _fill_disb(p: argparse.ArgumentParser) -> None:
    from backfill.realtime.config import ALL_MODELS, MODE_CONFIGS

    p.add_argument("--workload", nargs="+", default=["A", "B", "C", "D", "E"], help="DISB letters")
    p.add_argument("--file", default=None, help="a DISB JSON file instead of the presets")
    p.add_argument("--modes", nargs="+", default=list(MODE_CONFIGS),
                   help=f"of {', '.join(MODE_CONFIGS)}; reef modes take @CAPACITY (in-flight ops), e.g. reef@16")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per mode and workload (split over rounds)")
    p.add_argument("--rounds", type=int, default=2, help="modes interleaved in this many rounds")
    p.add_argument("--rt-load-scale", type=float, default=1.0,
                   help="multiply every preset's RT rate (a share of the RT model's solo maximum) by this, for "
                        "all modes alike, e.g. 0.8 where B's 100%% saturates RT-only on this machine")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: RT and BE on CUDA streams with priorities, BE launches in an in-flight window of "
                        "events (modes rt-only, seq, concurrent, reef)")
    p.add_argument("--exclude", nargs="*", default=[], choices=list(ALL_MODELS),
                   help="models left out of the 5-model (\"ALL\") clients of C-E")
    _common(p)
    p.set_defaults(func=cmd_disb)


def _fill_preempt(p: argparse.ArgumentParser) -> None:
    from backfill.realtime.config import ALL_MODELS

    p.add_argument("--models", nargs="+", default=["resnet152", "vgg19", "bert", "gpt2"], choices=list(ALL_MODELS))
    p.add_argument("--paths", nargs="+", default=["evict", "kill"], choices=["evict", "kill", "auto"])
    p.add_argument("--trials", type=int, default=40)
    _common(p)
    p.set_defaults(func=cmd_preempt)


def _fill_idempotence(p: argparse.ArgumentParser) -> None:
    from backfill.realtime.config import ALL_MODELS

    p.add_argument("--models", nargs="+", default=["resnet152", "vgg19", "bert", "gpt2"], choices=list(ALL_MODELS))
    _common(p)
    p.set_defaults(func=cmd_idempotence)
