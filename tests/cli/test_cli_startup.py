"""`backfill --help` and a command's --help build only the parser they show: no torch, numpy, server
framework or capability implementation is imported to list the commands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from backfill.cli import build_parser

HEAVY = ("torch", "numpy", "fastapi", "httpx", "pydantic", "uvicorn", "ray")
# Listing the commands imports the command modules (backfill/cli/) and nothing of the capabilities.
CAPABILITIES = ("backfill.cluster", "backfill.finetune", "backfill.offload", "backfill.realtime", "backfill.server",
                "backfill.node", "backfill.memory", "backfill.bench", "backfill.engine", "backfill.serving",
                "backfill.policy")
REGISTRIES = {"backfill.policy", "backfill.policy.registry"}  # the policy names the flags offer

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
    assert not {m for m in loaded if m.startswith(CAPABILITIES) and m not in REGISTRIES}


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


# A GPU machine may run the benchmarks without the server's and the cluster's libraries installed.
SERVER_AND_CLUSTER_LIBRARIES = ("fastapi", "uvicorn", "pydantic", "ray", "llguidance", "gguf")

BENCH_PROBE = """
import json, sys
from backfill.cli import build_parser
args = build_parser(sys.argv[1:]).parse_args(sys.argv[1:])
import backfill.bench.engine_bench  # what the command runs
print(json.dumps(sorted(sys.modules)))
"""


def test_bench_engine_needs_neither_the_server_nor_the_cluster_libraries():
    done = subprocess.run([sys.executable, "-c", BENCH_PROBE, "bench", "engine", "--random-weights", "--no-hf"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = {m.split(".")[0] for m in json.loads(done.stdout.strip().splitlines()[-1])}
    assert "torch" in loaded  # the probe did import what the benchmark runs
    assert not loaded & set(SERVER_AND_CLUSTER_LIBRARIES)
