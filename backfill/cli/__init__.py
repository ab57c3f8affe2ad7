"""The `backfill` command line."""

from __future__ import annotations

import argparse
import importlib
import sys

from backfill.cli.command_parser import CommandParser
from backfill.errors import BackfillError

# The one registry of command modules: each backfill.cli.<name> registers its commands with
# add_commands(commands), in this order (a group such as `bench` before the modules adding to it).
COMMAND_MODULES = ("serve", "bench", "finetune", "fine_tuning_client", "offload", "cluster", "realtime")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `backfill` parser. With argv, only the command it names gets its options, so that
    `backfill --help` imports no config dataclass, torch or server; None builds every command."""
    commands = CommandParser("backfill", __doc__, argv, announce=lambda line: print(line, file=sys.stderr, flush=True))
    for name in COMMAND_MODULES:
        importlib.import_module(f"backfill.cli.{name}").add_commands(commands)
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
        from backfill.bench.node_bench import main as node_bench_main

        try:
            node_bench_main(argv[2:])
        except BackfillError as exc:
            print(f"backfill: error: {exc}", file=sys.stderr)
            return 2
        return 0
    args = build_parser(argv).parse_args(argv)
    args.argv = list(argv)   # the command line as given (a command that can be resumed prints it)
    try:
        return args.func(args)
    except BackfillError as exc:
        print(f"backfill: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
