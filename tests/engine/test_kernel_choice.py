"""The kernel choice: the faster path per weight and rows, kept per machine and shape."""

import json

import pytest
import torch

from backfill.engine import kernel_choice
from backfill.engine.kernel_choice import LINEAR, LINEAR_MARGIN, SMALL_BATCH, TILES, KernelChoice


def test_path_takes_the_linear_only_past_the_margin():
    choice = KernelChoice({"qkv": {1: {SMALL_BATCH: 10.0, LINEAR: 30.0},
                                   8: {SMALL_BATCH: 50.0, LINEAR: 50.0 / LINEAR_MARGIN + 1},  # within the margin
                                   64: {SMALL_BATCH: 400.0, LINEAR: 100.0}}})
    assert [choice.path("qkv", n) for n in (1, 8, 64)] == [SMALL_BATCH, SMALL_BATCH, LINEAR]
    assert choice.path("qkv", 16) == SMALL_BATCH and choice.path("down", 64) == SMALL_BATCH  # not measured
    assert choice.linear_names(64) == frozenset({"qkv"}) and choice.linear_names(1) == frozenset()


def test_path_takes_the_faster_fused_kernel_and_the_linear_past_the_margin_of_it():
    choice = KernelChoice({"gate_up": {8: {SMALL_BATCH: 400.0, TILES: 150.0, LINEAR: 200.0},
                                       64: {SMALL_BATCH: 900.0, TILES: 300.0, LINEAR: 300.0 / LINEAR_MARGIN - 1},
                                       2: {SMALL_BATCH: 100.0, TILES: 120.0, LINEAR: 200.0}},
                           "down": {8: {SMALL_BATCH: 400.0, LINEAR: 200.0}}})  # no tiles for this weight
    assert [choice.path("gate_up", n) for n in (2, 8, 64)] == [SMALL_BATCH, TILES, LINEAR]
    assert choice.path("down", 8) == LINEAR and choice.linear_names(8) == frozenset({"down"})
    assert "tiles µs" in choice.format()
    assert [r["choice"] for r in KernelChoice.from_json(json.loads(json.dumps(choice.to_json()))).table()] == \
        [SMALL_BATCH, TILES, LINEAR, LINEAR]


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


def test_measure_times_each_path_over_a_steps_matmuls_in_order():
    """Each path's pass runs every layer's calls in order; a weight's time is its mean over them,
    and a path that leaves a weight out has no time for it."""
    layers = [torch.randn(64, 32) for _ in range(3)]
    head = torch.randn(128, 32)
    order = []

    def step_calls(path, rows):
        x = torch.randn(rows, 32)
        repeat = 20 if path == SMALL_BATCH else 1  # the slow path
        calls = [("qkv", lambda w=w, li=li: (order.append((path, li)),
                                            torch.stack([x @ w.T for _ in range(repeat)]).sum(0)))
                 for li, w in enumerate(layers)]
        return calls + ([] if path == TILES else [("lm_head", lambda: x @ head.T)])

    choice = kernel_choice.measure(step_calls, (SMALL_BATCH, TILES, LINEAR), (1, 4), "torch.mm")
    assert set(choice.times_us) == {"qkv", "lm_head"} and set(choice.times_us["qkv"]) == {1, 4}
    for cell in choice.times_us["qkv"].values():
        assert set(cell) == {SMALL_BATCH, TILES, LINEAR} and cell[SMALL_BATCH] > cell[LINEAR] > 0
    assert all(set(cell) == {SMALL_BATCH, LINEAR} for cell in choice.times_us["lm_head"].values())
    assert order[:3] == [(SMALL_BATCH, 0), (SMALL_BATCH, 1), (SMALL_BATCH, 2)]
    assert choice.path("qkv", 4) != SMALL_BATCH and choice.path("lm_head", 4) in (SMALL_BATCH, LINEAR)


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
