"""The kernel choice: the faster path per weight and rows, kept per machine and shape."""

import json

import pytest
import torch

from backfill.engine import kernel_choice
from backfill.engine.kernel_choice import LINEAR, LINEAR_MARGIN, SMALL_BATCH, KernelChoice


def test_path_takes_the_linear_only_past_the_margin():
    choice = KernelChoice({"qkv": {1: {SMALL_BATCH: 10.0, LINEAR: 30.0},
                                   8: {SMALL_BATCH: 50.0, LINEAR: 50.0 / LINEAR_MARGIN + 1},  # within the margin
                                   64: {SMALL_BATCH: 400.0, LINEAR: 100.0}}})
    assert [choice.path("qkv", n) for n in (1, 8, 64)] == [SMALL_BATCH, SMALL_BATCH, LINEAR]
    assert choice.path("qkv", 16) == SMALL_BATCH and choice.path("down", 64) == SMALL_BATCH  # not measured
    assert choice.linear_names(64) == frozenset({"qkv"}) and choice.linear_names(1) == frozenset()


def test_json_round_trip_keeps_every_choice_and_the_digest():
    choice = KernelChoice({"o": {4: {SMALL_BATCH: 5.0, LINEAR: 9.0}, 32: {SMALL_BATCH: 90.0, LINEAR: 20.0}}},
                          "onednn-packed")
    again = KernelChoice.from_json(json.loads(json.dumps(choice.to_json())))
    assert again.times_us == choice.times_us and again.linear_name == "onednn-packed"
    assert again.digest == choice.digest
    flipped = KernelChoice({"o": {4: {SMALL_BATCH: 5.0, LINEAR: 9.0}, 32: {SMALL_BATCH: 10.0, LINEAR: 20.0}}})
    assert flipped.digest != choice.digest
    assert [r["choice"] for r in again.table()] == [SMALL_BATCH, LINEAR]
    assert "onednn-packed" in again.format()


def test_from_json_refuses_another_format():
    with pytest.raises(ValueError, match="format"):
        KernelChoice.from_json({"format": 99, "times_us": {}})


def test_measure_times_both_paths_at_each_rows():
    w = torch.randn(64, 32)
    slow_calls = []

    def slow(x):
        slow_calls.append(x.shape[0])
        return torch.stack([x @ w.T for _ in range(20)]).sum(0)

    choice = kernel_choice.measure({"qkv": (slow, lambda x: x @ w.T, 32)}, (1, 4), torch.float32, "torch.mm")
    assert set(choice.times_us["qkv"]) == {1, 4}
    for cell in choice.times_us["qkv"].values():
        assert cell[SMALL_BATCH] > cell[LINEAR] > 0
    assert set(slow_calls) == {1, 4}


def test_load_or_measure_caches_and_remeasures_a_damaged_file(tmp_path, monkeypatch):
    monkeypatch.setenv("BACKFILL_CACHE_DIR", str(tmp_path))
    measured = []

    def measure_now():
        measured.append(1)
        return KernelChoice({"down": {8: {SMALL_BATCH: 3.0, LINEAR: 1.0}}})

    signature = {"what": "test", "hidden": 8}
    first = kernel_choice.load_or_measure(signature, measure_now)
    second = kernel_choice.load_or_measure(signature, measure_now)
    assert measured == [1] and second.times_us == first.times_us
    kernel_choice.load_or_measure({"what": "test", "hidden": 16}, measure_now)  # another shape: measured
    assert measured == [1, 1]
    kernel_choice.cache_path(signature).write_text("{not json")
    again = kernel_choice.load_or_measure(signature, measure_now)
    assert measured == [1, 1, 1] and again.path("down", 8) == LINEAR
