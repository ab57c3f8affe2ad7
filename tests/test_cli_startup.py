"""`backfill --help` and a command's --help build only the parser they show: no torch, numpy, server
framework or capability implementation is imported to list the commands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from backfill.cli import build_parser

HEAVY = ("torch", "numpy", "fastapi", "httpx", "pydantic", "uvicorn", "ray")
# What listing the commands may import of the capabilities: their command registrations only.
REGISTRATIONS = {"backfill.cluster", "backfill.cluster.cli", "backfill.finetune", "backfill.finetune.cli",
                 "backfill.offload", "backfill.offload.cli", "backfill.realtime", "backfill.realtime.cli",
                 "backfill.server", "backfill.server.finetune_cli", "backfill.server.bench_cli"}
CAPABILITIES = ("backfill.cluster", "backfill.finetune", "backfill.offload", "backfill.realtime", "backfill.server",
                "backfill.node", "backfill.engine.model", "backfill.serving.scheduler")

PROBE = """
import json, sys
from backfill.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""


def modules_after_help(*command: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *command, "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: backfill" in done.stdout
    return set(json.loads(done.stderr.strip().splitlines()[-1]))


@pytest.mark.parametrize("command", [(), ("bench",), ("sim",), ("finetune",), ("offload",)])
def test_listing_commands_imports_no_framework_and_no_capability(command):
    loaded = modules_after_help(*command)
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}
    assert not {m for m in loaded if m.startswith(CAPABILITIES) and m not in REGISTRATIONS}


@pytest.mark.parametrize("command", [("bench", "coserve"), ("sim", "coserve"), ("sim", "finetune"), ("demo",), ("serve",),
                                     ("finetune", "run"), ("finetune", "create"), ("bench", "disb"),
                                     ("bench", "preempt"), ("idempotence",)])
def test_a_commands_help_imports_its_options_without_torch_or_the_server(command):
    loaded = modules_after_help(*command)
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}
    assert "backfill.server.app" not in loaded and "backfill.engine.model" not in loaded


def test_a_command_not_named_is_listed_but_not_built():
    only_sim = build_parser(["sim", "coserve"])
    sub = next(a for a in only_sim._actions if a.dest == "command")
    assert {"generate", "serve", "bench", "sim", "finetune", "offload"} <= set(sub.choices)
    assert not any(a.option_strings for a in sub.choices["generate"]._actions)  # listed, no options
    sims = next(a for a in sub.choices["sim"]._actions if a.dest == "sim")
    assert not any(a.option_strings for a in sims.choices["fleet"]._actions)
    args = only_sim.parse_args(["sim", "coserve", "--duration", "5"])
    assert args.duration == 5.0 and args.func.__name__ == "cmd_sim_coserve"


def test_the_whole_tree_parses_every_command():
    parser = build_parser()
    assert parser.parse_args(["finetune", "get", "ftjob-1"]).job_id == "ftjob-1"
    assert parser.parse_args(["sim", "fleet", "--devices", "8"]).devices == 8
    assert parser.parse_args(["generate", "hi"]).prompt == "hi"


def test_python_dash_m_backfill_is_the_backfill_command():
    done = subprocess.run([sys.executable, "-m", "backfill", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: backfill" in done.stdout and "serve" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "backfill", "no-such-command"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
