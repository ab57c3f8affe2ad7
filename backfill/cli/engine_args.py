"""The engine's flags, shared by every command that loads a model, and the co-serving scenario's flags,
shared by the commands that run it (bench coserve, bench server, sim coserve, demo).

Flags come from the knobs of the config dataclasses (backfill/options.py), so a knob is declared once.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from backfill.policy.registry import BENCH_ORDER

if TYPE_CHECKING:
    from backfill.bench.scenario import CoserveScenario
    from backfill.options import Option
    from backfill.serving.config import ServingConfig


DEFAULT_MODES = BENCH_ORDER
MODES_HELP = (f"policies to run in turn ({', '.join(BENCH_ORDER)}); a variant adds knobs, e.g. "
              "coserve:rider_cost_share=1,interference_slack=0.1, and runs interleaved with the others")


def engine_options() -> tuple[Option, ...]:
    from backfill.options import options_of
    from backfill.serving.config import ServingConfig

    return options_of(ServingConfig, "engine")


def coserve_options() -> tuple[Option, ...]:
    from backfill.options import options_of
    from backfill.policy.config import CoServeConfig

    return options_of(CoServeConfig, "coserve")


# The serving options a one-off command takes beside the engine's, as `serve` does.
MODEL_SERVING_OPTIONS = ("max_model_len",)


def model_serving_options() -> tuple[Option, ...]:
    from backfill.options import options_of
    from backfill.serving.config import ServingConfig

    return tuple(o for o in options_of(ServingConfig, "serving") if o.name in MODEL_SERVING_OPTIONS)


def add_engine_args(p: argparse.ArgumentParser, several: tuple[str, ...] = ()) -> None:
    """The engine's options; those named in `several` take one or more values (a benchmark compares
    them) and land in args.<name>_compared, so they never reach the config directly."""
    from backfill.engine.shapes import add_shape_args
    from backfill.options import add_arguments

    from backfill.serving.config import COMMAND_DEFAULTS

    add_arguments(p, tuple(o for o in engine_options() if o.name not in several), COMMAND_DEFAULTS)
    for o in engine_options():
        if o.name in several:
            p.add_argument(o.flag, dest=f"{o.name}_compared", nargs="+", choices=o.choices, default=[o.default],
                           help=f"{o.help}; several are measured in turn (default: {o.default})")
    add_shape_args(p)


def serving_config(args: argparse.Namespace, **changes) -> ServingConfig:
    """The ServingConfig of the engine (and, where the command has them, coserve) flags given."""
    from backfill.engine.shapes import model_from_args
    from backfill.options import build, given
    from backfill.serving.config import ServingConfig

    values = given(args, engine_options() + coserve_options() + model_serving_options()) | changes
    if getattr(args, "random_weights", False) or getattr(args, "shape", None) is not None:
        values["model"] = model_from_args(args)
    return build(ServingConfig, values)


def add_scenario_args(p: argparse.ArgumentParser, rounds: dict | None = None) -> None:
    """The scenario's, the engine's and coserve's options; with rounds (the command's defaults),
    also --rounds and --warmup-s."""
    from backfill.bench.scenario import CoserveScenario
    from backfill.options import add_arguments, options_of

    add_engine_args(p)
    add_arguments(p, options_of(CoserveScenario, "scenario"))
    if rounds is not None:
        add_arguments(p, options_of(CoserveScenario, "rounds"), rounds)
    add_arguments(p, coserve_options())
    p.add_argument("--json", default=None, help="also write all modes' metrics to this JSON file")


def scenario_from_args(args: argparse.Namespace, **changes) -> CoserveScenario:
    from backfill.bench.scenario import CoserveScenario
    from backfill.options import build, given, options_of

    return build(CoserveScenario, given(args, options_of(CoserveScenario)) | changes)


def add_frontier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--loads", nargs="+", type=float, default=None,
                   help="run once per online load and print the frontier (SLO attainment, offline tok/s per mode)")
    p.add_argument("--slos", nargs="+", default=None, metavar="TTFT_MS/TPOT_MS",
                   help="run once per SLO setting, e.g. 200/15 100/10 (alone: online-only's own P99s), and "
                        "print the frontier")
