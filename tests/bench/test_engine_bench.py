"""The engine benchmark's floors: each decode figure carries the bandwidth read between its steps."""

import statistics

import pytest

from backfill.bench import engine_bench


class FixedProbe:
    def __init__(self, readings):
        self.readings = list(readings)
        self.calls = 0

    def read_gbs(self) -> float:
        self.calls += 1
        return self.readings[(self.calls - 1) % len(self.readings)]


def test_decode_bench_pairs_each_step_with_a_bandwidth_read(tiny_runner):
    probe = FixedProbe([10.0, 30.0, 20.0])
    d = engine_bench.bench_decode(tiny_runner, batch=2, prompt_len=8, new_tokens=5, probe=probe)
    assert probe.calls == d["decode_steps"] >= 4  # one read after each decode step, none after the prefill
    reads = sorted(probe.readings[i % 3] for i in range(probe.calls))
    assert d["paired_read_bandwidth_gbs"] == statistics.median(reads)
    floor_ms = tiny_runner.model.weight_bytes / (statistics.median(reads) * 1e9) * 1e3
    assert d["paired_floor_ms"] == pytest.approx(floor_ms)
    assert d["tpot_over_paired_floor"] == pytest.approx(d["tpot_ms"] / floor_ms)


def test_bandwidth_probe_reads_a_plausible_bandwidth():
    assert 0.1 < engine_bench.BandwidthProbe("cpu", size_mb=64).read_gbs() < 10_000


@pytest.mark.slow
def test_engine_bench_reports_both_floors_for_each_batch():
    result = engine_bench.run_engine_bench(dtypes=("float32",), batches=(1, 2), prompt_len=16, new_tokens=4,
                                           with_hf=False, random_weights=True, log=lambda *_: None)
    run = result["runs"]["float32"]
    assert result["read_bandwidth_gbs"] > 0 and run["bandwidth_floor_ms"] > 0
    assert [d["batch"] for d in run["decode"]] == [1, 2]
    for d in run["decode"]:
        assert d["tpot_ms"] > 0 and d["paired_read_bandwidth_gbs"] > 0
        assert d["tpot_over_floor"] == pytest.approx(d["tpot_ms"] / run["bandwidth_floor_ms"])
        assert d["tpot_over_paired_floor"] == pytest.approx(d["tpot_ms"] / d["paired_floor_ms"])


def test_decode_bench_collects_each_requests_greedy_tokens(tiny_runner):
    first, second = [], []
    engine_bench.bench_decode(tiny_runner, batch=3, prompt_len=8, new_tokens=5, tokens=first)
    engine_bench.bench_decode(tiny_runner, batch=3, prompt_len=8, new_tokens=5, tokens=second)
    assert [len(t) for t in first] == [5, 5, 5] and first == second
    assert first[0] != first[1]  # in the requests' order, each its own prompt's tokens
    agree = engine_bench.greedy_agreement(first, second)
    assert agree == {"sequences": 3, "identical": 3, "tokens_per_sequence": 5, "shortest_common_prefix": 5,
                     "mean_common_prefix": 5}


def test_greedy_agreement_counts_where_sequences_part():
    agree = engine_bench.greedy_agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 7, 6]])
    assert agree["identical"] == 1 and agree["shortest_common_prefix"] == 1 and agree["mean_common_prefix"] == 2
    with pytest.raises(ValueError, match="2 sequences against 1"):
        engine_bench.greedy_agreement([[1], [2]], [[1]])


def test_mixed_steps_are_timed_graphed_and_eager_with_the_same_logits(tiny_runner):
    """Decodes beside a prompt chunk, through the mixed-step graphs (capture off on CPU) and eagerly."""
    from backfill.engine.cuda_graphs import DecodeGraphs
    from backfill.engine.runner import ModelRunner

    kv = tiny_runner.kv
    runner = ModelRunner(tiny_runner.model, kv, DecodeGraphs(tiny_runner.model, kv, capture=False, mixed=True))
    free = kv.num_free
    d = engine_bench.bench_mixed(runner, batch=3, prompt_len=40, repeats=2)
    assert d["chunk_tokens"] == engine_bench.MIXED_CHUNK_MAX and d["chunk_start"] == 40 - d["chunk_tokens"]
    assert d["graphed_ms"] > 0 and d["eager_ms"] > 0
    assert d["max_abs_logit_diff"] < 1e-4  # fp32 on CPU: summation order only
    # Prompts of 3 x 40 and 8 tokens fit the buckets too; then 2 warm-ups and 2 repeats graphed.
    assert runner.decode_graphs.mixed_runs == 4 + 2 + 2 and runner.decode_graphs.mixed and kv.num_free == free
    with pytest.raises(ValueError, match="mixed"):
        engine_bench.bench_mixed(tiny_runner, batch=3, prompt_len=40)
