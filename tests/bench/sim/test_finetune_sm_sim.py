"""The modes on the simulated SM-partitioned device, the predictor profiled on it, and the command."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from backfill.cli import build_parser, main
from backfill.errors import SimDeviceError
from backfill.bench.sim.sm_config import SmDeviceConfig, SmSimScenario
from backfill.bench.sim.sm_device import SimulatedDevice
from backfill.bench.sim.sm_device_profile import profile_device
from backfill.bench.sim.finetune_sm_sim import run_load

QUIET = dict(log=lambda *a: None)


@pytest.fixture(scope="module")
def device() -> SimulatedDevice:
    return SimulatedDevice.load(SmDeviceConfig())


@pytest.fixture(scope="module")
def latency(device):
    return profile_device(device)


def test_the_predictor_is_fitted_on_the_simulated_device_with_its_error_reported(device, latency):
    assert [f.share for f in latency.solo] == pytest.approx([k / 10 for k in range(1, 11)])
    for name in ("stage1_grid", "stage2_grid", "stage1_held_out", "stage2_held_out"):
        assert latency.errors[name]["points"] > 0
        assert 0 < latency.errors[name]["mean"] < 0.05  # HARLI §8.4's bound; noise and buckets keep it above 0
    assert latency.b1 == pytest.approx(1.0, abs=0.05)
    assert latency.k1 > latency.b1  # finetuning's share costs decode more than its own share does
    # the fit, not the ground truth: it misses the device by the profiling noise at least somewhere
    assert latency.colo_ms(16, 300.0, 0.5, 0.5) != device.decode_ms(16, 300.0, 0.5, 0.5)


def test_harli_beats_pause_only_and_static_while_decode_leaves_the_sms_idle(device, latency):
    result = run_load(device, latency, SmSimScenario(duration_s=60.0, online_load=0.9, rounds=1), **QUIET)
    t = result["table"]
    assert t["solo"]["busy_share"] > 0.4  # decode runs most of the time: pause-only has little to take
    assert t["harli"]["meets_qos"]
    assert t["harli"]["samples_per_s"] > 1.3 * t["pause-only"]["samples_per_s"]
    assert t["harli"]["samples_per_s"] > t["static"]["samples_per_s"]
    assert t["harli"]["ft_share_while_busy"] > 0.3  # the gain comes from finetuning beside decode
    assert t["pause-only"]["ft_share_while_busy"] == 0.0
    assert t["separate"]["samples_per_s"] == pytest.approx(device.samples_per_s(1.0) / 2)
    rounds = result["rounds"]
    # a fixed partition never takes SMs back; pause-only waits for a kernel when a request ends an
    # idle spell, at most once per request
    assert rounds["static"][0]["drains"] == 0
    assert 0 < rounds["pause-only"][0]["drains"] <= rounds["solo"][0]["completed"]
    assert rounds["harli"][0]["drains"] > 0


def test_the_gain_shrinks_when_decode_needs_every_sm(latency):
    compute_bound = SimulatedDevice.load(replace(SmDeviceConfig(), saturation_share=1.0))
    memory_bound = SimulatedDevice.load(SmDeviceConfig())
    scenario = SmSimScenario(duration_s=60.0, online_load=0.9, rounds=1)
    ratios = []
    for dev in (memory_bound, compute_bound):
        t = run_load(dev, profile_device(dev), scenario, modes=("pause-only", "harli"), **QUIET)["table"]
        ratios.append(t["harli"]["x_pause-only"])
    assert ratios[0] > ratios[1]


def test_the_command_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["sim", "finetune", "--duration", "20", "--rounds", "1", "--loads", "0.6", "--no-sensitivity",
                 "--json", str(out), "--interference", "0.3"]) == 0
    printed = capsys.readouterr().out
    assert "| 0.6 | harli |" in printed and "not a GPU measurement" in printed
    result = json.loads(out.read_text())
    assert result["config"]["interference"] == 0.3
    assert set(result["loads"][0]["table"]) == {"solo", "separate", "static", "pause-only", "harli"}
    assert result["predictor"]["errors"]["stage2_grid"]["mean"] > 0


@pytest.mark.parametrize("argv, match", [
    (["--modes", "greedy"], "unknown modes"), (["--profile", "/nonexistent/p.json"], "no latency profile"),
    (["--saturation-share", "1.5"], "saturation_share"), (["--loads", "0"], "online_load")])
def test_the_command_rejects_bad_input_with_typed_errors(tmp_path, capsys, argv, match):
    argv = ["sim", "finetune", "--duration", "5", "--rounds", "1", "--no-sensitivity", "--json",
            str(tmp_path / "r.json"), *argv]
    assert main(argv) == 2 and match in capsys.readouterr().err
    args = build_parser(argv).parse_args(argv)
    with pytest.raises(SimDeviceError, match=match):
        args.func(args)
    assert not (tmp_path / "r.json").exists()


def test_the_online_trace_is_the_coserve_generator_scaled_to_the_load():
    from backfill.bench.sim.finetune_sim import online_requests

    def prefill(n):
        return 10.0

    def decode(ctx):
        return 5.0

    light = online_requests(200.0, 0.2, 3, prefill, decode)
    heavy = online_requests(200.0, 0.8, 3, prefill, decode)
    assert light == online_requests(200.0, 0.2, 3, prefill, decode)  # a seed gives one trace
    assert all(0 <= r.arrival_s < 200.0 and 64 <= r.prompt_tokens <= 256 and 16 <= r.output_tokens <= 64
               for r in light + heavy)
    # ~40 output tokens x 5 ms + 10 ms a request: 0.21 s alone, so about load / 0.21 s arrivals a second
    assert 2.5 < len(heavy) / len(light) < 6
    assert 0.5 < len(heavy) / 200.0 * 0.21 / 0.8 < 1.5


def test_a_qos_verdict_needs_enough_online_requests_in_every_round():
    from backfill.bench.sim.finetune_sm_sim import table

    rounds = {"harli": [{"samples_per_s": 1.0, "p99_tpot_ms": 10.0, "ft_share_while_busy": 0.5, "busy_share": 0.5,
                         "completed": 40},
                        {"samples_per_s": 1.0, "p99_tpot_ms": 10.0, "ft_share_while_busy": 0.5, "busy_share": 0.5,
                         "completed": 3}]}
    row = table(rounds, target_ms=20.0)["harli"]
    assert row["meets_qos"] is None and row["qos"]["met_text"] == "n/a (too few samples: 3)"
    rounds["harli"][1]["completed"] = 40
    assert table(rounds, target_ms=20.0)["harli"]["meets_qos"] is True
    assert table(rounds, target_ms=5.0)["harli"]["meets_qos"] is False
