"""Each knob is declared once: the CLI flags, the server's config file and the --modes knobs are
the config dataclasses' fields, nothing more and nothing less."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from backfill.bench.modes import KNOBS
from backfill.bench.scenario import CoserveScenario
from backfill.cli import build_parser
from backfill.errors import InvalidRequestError
from backfill.options import build, options_of
from backfill.policy.config import CoServeConfig
from backfill.server.config import ServerConfig, add_serve_arguments, load_config_file
from backfill.types import SLO
from backfill.serving.config import ServingConfig


def documented(cls) -> set[str]:
    """Option names of cls's fields with help text, nested configs included, found by walking the fields."""
    names = set()
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            names |= documented(type(default))
        elif f.metadata.get("help"):
            names.add(f.metadata.get("option") or f.name)
    return names


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    dests = {a.dest for a in parser._actions if a.option_strings}
    return dests - {"help"}


def subparser(*path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def test_the_dataclasses_declare_every_knob_once():
    assert documented(CoServeConfig) == {o.name for o in options_of(CoServeConfig)}
    assert documented(SLO) == {"ttft_slo_ms", "tpot_slo_ms"}
    serving = {o.name for o in options_of(ServingConfig)}
    assert serving == documented(ServingConfig) and documented(CoServeConfig) <= serving


def test_mode_knobs_are_the_coserve_fields():
    assert set(KNOBS) == documented(CoServeConfig) - documented(SLO)
    assert all(KNOBS[o.name] is o.type for o in options_of(CoServeConfig, "coserve"))


def test_server_flags_and_config_file_keys_are_the_server_and_serving_fields(tmp_path):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    expected = documented(ServerConfig) | documented(ServingConfig)
    assert flags_of(parser) - {"config"} == expected
    for name in expected:  # every field is a config-file key of its type
        option = next(o for o in options_of(ServerConfig) + options_of(ServingConfig) if o.name == name)
        value = {bool: "true", int: "3", float: "0.5", str: '"x"'}[option.type]
        path = tmp_path / "c.toml"
        path.write_text(f"{name} = {value}\n")
        assert name in load_config_file(path)


# Flags that name the model another way (engine/shapes.py): they resolve to ServingConfig.model.
SHAPE_FLAGS = {"random_weights", "shape"}


@pytest.mark.parametrize("command, extra", [
    (("bench", "coserve"), {"modes", "url", "served_model", "label", "api_key", "offline_mark", "online_baseline", "phase", "baseline_file",
                            "out", "json", "loads", "slos", "profile"}),
    (("sim", "coserve"), {"modes", "profile", "machine", "step_overhead_ms", "noise_cv", "slowdown_factor", "out",
                          "json", "loads", "slos"}),
    (("bench", "server"), {"out", "json"}),
])
def test_scenario_commands_take_the_engine_scenario_and_coserve_fields(command, extra):
    engine = {o.name for o in options_of(ServingConfig, "engine")} | SHAPE_FLAGS
    scenario = {o.name for o in options_of(CoserveScenario)}
    if command == ("bench", "server"):
        scenario -= {o.name for o in options_of(CoserveScenario, "rounds")}
    coserve = documented(CoServeConfig) - documented(SLO)  # the scenario sets the SLO
    assert flags_of(subparser(*command)) == engine | scenario | coserve | extra


def test_model_commands_take_the_engine_fields():
    engine = {o.name for o in options_of(ServingConfig, "engine")} | SHAPE_FLAGS
    assert flags_of(subparser("profile")) == engine | {"out"}
    assert flags_of(subparser("demo")) == engine | {"duration", "out", "quiet"}


def test_flags_build_the_config_tree_and_the_dataclass_validates():
    args = subparser("sim", "coserve").parse_args(["--kv-cache-gb", "2", "--no-release-suspended",
                                                   "--interference-slack", "inf"])
    values = {k: v for k, v in vars(args).items() if k in {o.name for o in options_of(ServingConfig)}}
    cfg = build(ServingConfig, values)
    assert cfg.kv_cache_gb == 2.0 and cfg.dtype == "auto"
    assert cfg.coserve.release_suspended is False and cfg.coserve.interference_slack == float("inf")
    assert cfg.coserve == CoServeConfig(release_suspended=False, interference_slack=float("inf"))
    with pytest.raises(InvalidRequestError, match="rider_cost_share"):
        build(ServingConfig, {"rider_cost_share": -1.0})


def test_serving_and_coserve_defaults_agree():
    assert ServingConfig().coserve == CoServeConfig() and CoServeConfig().interference_slack == 0.05


def test_sim_finetune_takes_the_simulated_device_and_scenario_fields():
    from backfill.bench.sim.sm_config import SmDeviceConfig, SmSimScenario

    assert documented(SmDeviceConfig) == {o.name for o in options_of(SmDeviceConfig)}
    expected = documented(SmDeviceConfig) | documented(SmSimScenario) | {"loads", "modes", "sensitivity", "json"}
    assert flags_of(subparser("sim", "finetune")) == expected
    args = subparser("sim", "finetune").parse_args(["--saturation-share", "0.3", "--duration", "10"])
    assert build(SmDeviceConfig, {"saturation_share": args.saturation_share}).saturation_share == 0.3
    assert build(SmSimScenario, {"duration": args.duration}).duration_s == 10.0
