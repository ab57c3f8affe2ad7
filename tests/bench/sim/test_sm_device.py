"""The simulated SM-partitioned device: the measured profile at full share, the stated scaling
below it, co-location interference, finetuning cost, and its typed errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from backfill.errors import SimDeviceError
from backfill.bench.sim.sm_config import SmDeviceConfig, SmSimScenario
from backfill.bench.sim.sm_device import H200_DATA, ModelShape, SimulatedDevice
from backfill.policy.latency_model import BatchShape, LatencyModel

SHARES = [k / 10 for k in range(1, 11)]

# The measured files the simulated device defaults to; the package ships a copy (bench/data/).
RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results" / "h200-llama3-8b"


def test_the_shipped_device_data_is_the_measured_files_in_the_docs():
    for name in ("profile-corrected.json", "config.json"):
        assert (H200_DATA / name).read_bytes() == (RESULTS / name).read_bytes()


@pytest.fixture(scope="module")
def device() -> SimulatedDevice:
    return SimulatedDevice.load(SmDeviceConfig())


def test_the_shape_is_llama3_8b_and_a_decode_step_streams_its_weights(device):
    shape = device.shape
    assert (shape.layers, shape.hidden, shape.intermediate, shape.kv_heads) == (32, 4096, 14336, 8)
    assert 14.0e9 < shape.streamed_params * 2 < 14.8e9  # docs/gpu.md: 14.4 GB of bf16 weights
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


@pytest.mark.parametrize("batch, seqlen", [(1, 64), (4, 256), (16, 512), (64, 128), (64, 1024)])
def test_decode_at_full_share_is_the_measured_profile_and_never_faster_with_fewer_sms(device, batch, seqlen):
    profile = LatencyModel.load(RESULTS / "profile-corrected.json")
    measured = profile.estimate_ms(BatchShape(num_tokens=batch, decode_context_tokens=int(batch * seqlen)))
    assert device.decode_ms(batch, seqlen, 1.0) == pytest.approx(measured)
    times = [device.decode_ms(batch, seqlen, s) for s in SHARES]
    assert all(a >= b for a, b in zip(times, times[1:]))  # non-increasing in the SM share
    # memory-bound: no slower down to the saturation share, slower below it
    assert device.decode_ms(batch, seqlen, 0.5) == pytest.approx(measured)
    assert device.decode_ms(batch, seqlen, 0.2) > 1.5 * measured


def test_prefill_is_compute_bound_so_it_slows_as_its_share_shrinks(device):
    assert device.prefill_ms(512, 1.0) == pytest.approx(LatencyModel.load(RESULTS / "profile-corrected.json")
                                                        .estimate_ms(BatchShape(512, 0, 1, 0)))
    assert device.prefill_ms(512, 0.5) > 1.8 * device.prefill_ms(512, 1.0)


def test_co_located_finetuning_slows_decode_more_as_its_share_grows(device):
    solo = device.decode_ms(16, 256, 0.5)
    colo = [device.decode_ms(16, 256, 1 - f, f) for f in (0.1, 0.3, 0.5)]
    assert solo < colo[-1] and colo == sorted(colo)
    no_interference = SimulatedDevice.load(replace(SmDeviceConfig(), interference=0.0))
    # what is left without the stated interference is Eq. 5 alone: LoRA at 2 x 1024 tokens is
    # compute-bound, so its bandwidth demand does not push decode past B
    assert no_interference.decode_ms(16, 256, 0.5, 0.5) == pytest.approx(no_interference.decode_ms(16, 256, 0.5))


def test_finetuning_speed_grows_with_its_share_and_drops_beside_decode(device):
    rates = [device.samples_per_s(s) for s in SHARES]
    assert rates == sorted(rates) and rates[-1] > 0
    assert device.samples_per_s(0.5, share_infer_busy=0.5) < device.samples_per_s(0.5)
    assert device.ft_step_ms(0.0) == float("inf")
    assert 0 < device.drain_ms(0.5) == pytest.approx(2 * device.drain_ms(1.0))


@pytest.mark.parametrize("call", [
    lambda d: d.decode_ms(4, 128, 0.0), lambda d: d.decode_ms(4, 128, 1.2), lambda d: d.decode_ms(4, 128, -0.1),
    lambda d: d.decode_ms(4, 128, 0.7, 0.4), lambda d: d.decode_ms(4, 128, 0.5, -0.1), lambda d: d.decode_ms(0, 128),
    lambda d: d.prefill_ms(64, 1.5), lambda d: d.ft_step_ms(1.1), lambda d: d.samples_per_s(0.5, 2.0)])
def test_shares_outside_the_device_are_typed_errors(device, call):
    with pytest.raises(SimDeviceError):
        call(device)


def test_a_missing_or_broken_file_is_a_typed_error(tmp_path):
    with pytest.raises(SimDeviceError, match="no latency profile"):
        SimulatedDevice.load(SmDeviceConfig(profile=str(tmp_path / "missing.json")))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(SimDeviceError):
        SimulatedDevice.load(SmDeviceConfig(profile=str(broken)))
    with pytest.raises(SimDeviceError, match="model shape"):
        SimulatedDevice.load(SmDeviceConfig(model_config=str(tmp_path / "missing-config.json")))
    partial = tmp_path / "config.json"
    partial.write_text(json.dumps({"hidden_size": 4096}))
    with pytest.raises(SimDeviceError):
        ModelShape.from_hf_config(partial)


@pytest.mark.parametrize("changes", [{"saturation_share": 0.0}, {"saturation_share": 1.5}, {"ft_efficiency": 0},
                                     {"compute_efficiency": 2.0}, {"read_tbps": 5.0}, {"peak_tflops": -1.0},
                                     {"interference": -0.1}, {"noise_cv": 1.0}, {"ft_batch": 0}, {"ft_rank": 1.5}])
def test_stated_parameters_out_of_range_are_typed_errors(changes):
    with pytest.raises(SimDeviceError):
        SmDeviceConfig(**changes)


@pytest.mark.parametrize("changes", [{"duration_s": 0.0}, {"online_load": 0.0}, {"online_load": 1.5}, {"rounds": 0},
                                     {"tpot_target_x_solo": 0.9}, {"static_share_infer": 1.0}, {"headroom": 1.0}])
def test_scenario_out_of_range_is_a_typed_error(changes):
    with pytest.raises(SimDeviceError):
        SmSimScenario(**changes)
