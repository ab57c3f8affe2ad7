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


def test_large_steps_pad_only_where_every_pair_measured_the_padded_count_faster():
    from backfill.engine.kernel_choice import LARGE_STEP_MARGIN, LARGE_STEP_ROW_MULTIPLE, LARGE_STEP_ROW_PAIRS
    faster = {rows: 100.0 if rows % 16 == 0 else 140.0 for pair in LARGE_STEP_ROW_PAIRS for rows in pair}
    assert KernelChoice(large_rows_us=faster).large_step_row_multiple == LARGE_STEP_ROW_MULTIPLE
    # One pair with no penalty: the mean of 1.4, 1.4 and 1.0 still pads.
    assert KernelChoice(large_rows_us={**faster, LARGE_STEP_ROW_PAIRS[0][0]: 100.0}).large_step_row_multiple == 16
    within_margin = {rows: 100.0 if rows % 16 == 0 else 100.0 * LARGE_STEP_MARGIN - 1 for rows in faster}
    assert KernelChoice(large_rows_us=within_margin).large_step_row_multiple == 1
    missing = {k: v for k, v in faster.items() if k != LARGE_STEP_ROW_PAIRS[-1][1]}
    assert KernelChoice(large_rows_us=missing).large_step_row_multiple == 1
    assert KernelChoice().large_step_row_multiple == 1
    again = KernelChoice.from_json(json.loads(json.dumps(KernelChoice(large_rows_us=faster).to_json())))
    assert again.large_rows_us == faster
    assert f"multiple of {LARGE_STEP_ROW_MULTIPLE}" in again.format()


def test_measure_large_rows_times_each_count():
    from backfill.engine.kernel_choice import LARGE_STEP_ROW_PAIRS
    w = torch.randn(32, 16)
    built = []

    def layer_at(rows):
        built.append(rows)
        x = torch.randn(rows, 16)
        return lambda: x @ w.T

    times = kernel_choice.measure_large_rows(layer_at)
    assert sorted(built) == sorted(rows for pair in LARGE_STEP_ROW_PAIRS for rows in pair) == sorted(times)
    assert all(t > 0 for t in times.values())


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
