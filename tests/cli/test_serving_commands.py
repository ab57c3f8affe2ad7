"""The CLI's commands take the options their docs give them."""

from backfill.cli import build_parser
from backfill.cli.engine_args import serving_config
from backfill.cli.serve import demo_summary


def test_generate_takes_the_model_flags_serve_takes():
    argv = ["generate", "hi", "--max-model-len", "64", "--kv-cache-gb", "0.1"]
    config = serving_config(build_parser(argv).parse_args(argv), policy="fcfs")
    assert config.max_model_len == 64 and config.kv_cache_gb == 0.1


def test_the_demo_summary_names_the_harvest_and_online_only_latency():
    from types import SimpleNamespace as NS

    def metrics(offline_tokens, ttft, tpot):
        return NS(duration_s=20.0, offline=NS(output_tokens=offline_tokens, tokens_per_s=offline_tokens / 20.0),
                  online=NS(ttft_ms=NS(p99=ttft), tpot_ms=NS(p99=tpot)))

    line = demo_summary(metrics(0, 300.0, 40.0), metrics(1234, 330.0, 45.0), "runs/demo")
    assert line.startswith("Harvested 1,234 offline tokens (61.7 tokens/s) in 20 s")
    assert "P99 TTFT 330 ms (online-only: 300 ms)" in line and "P99 TPOT 45 ms (online-only: 40 ms)" in line
    assert "no offline token" in demo_summary(metrics(0, 1.0, 1.0), metrics(0, 1.0, 1.0), "x")


def test_a_command_announces_what_it_does_before_its_options_load_but_not_for_help():
    lines = []
    for argv in (["sim", "fleet"], ["sim", "fleet", "--help"]):
        from backfill.cli.command_parser import CommandParser

        commands = CommandParser("backfill", None, argv, announce=lines.append)
        commands.group("sim", "simulations")
        commands.defer("sim fleet", "the fleet, simulated", lambda p: lines.append("filled"))
        commands.defer("sim other", "another", lambda p: lines.append("other filled"))
    assert lines == ["backfill sim fleet: the fleet, simulated", "filled", "filled"]
