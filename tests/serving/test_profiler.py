"""The latency profiler on a tiny random model: what it measures and what it fits."""

import pytest

from backfill.engine.runner import StepOutput
from backfill.policy.latency_model import BatchShape
from backfill.serving.profiler import profile_latency


def _spy_shapes(runner, monkeypatch) -> list[tuple[tuple[int, bool], ...]]:
    """(tokens, is past position 0) of each chunk of every step the profiler runs."""
    shapes, execute = [], runner.execute

    def spy(chunks, *args, **kwargs) -> StepOutput:
        shapes.append(tuple((len(c.token_ids), c.start_pos > 0) for c in chunks))
        return execute(chunks, *args, **kwargs)

    monkeypatch.setattr(runner, "execute", spy)
    return shapes


def test_token_points_are_prefill_chunks_and_decode_points_are_decode_batches(tiny_runner, monkeypatch):
    # Compiled decode (CPU) and CUDA graphs (GPU) run decodes on their own path, so decodes alone are
    # timed as decodes (one token past position 0, logits wanted) in a table of their own, and the
    # token table is timed on prompt chunks from position 0.
    shapes = _spy_shapes(tiny_runner, monkeypatch)
    latency = profile_latency(tiny_runner, grid=(1, 2, 8), decode_grid=(1, 2, 3), repeats=2)
    assert ((1, False),) in shapes and ((8, False),) in shapes      # token points 1 and 8
    assert ((1, True),) * 3 in shapes                              # decode point 3
    assert latency.token_grid == (1, 2, 8) and latency.decode_grid == (1, 2, 3)
    # The scratch sequences' blocks are all given back.
    assert tiny_runner.kv.num_free == tiny_runner.kv.num_usable


def test_tables_never_decrease_and_decode_steps_read_the_decode_table(tiny_runner):
    latency = profile_latency(tiny_runner, grid=(1, 2, 8), decode_grid=(1, 2, 4), repeats=2)
    for table in (latency.step_ms, latency.decode_ms):
        assert table[0] > 0 and all(a <= b for a, b in zip(table, table[1:]))
    assert latency.ms_per_kctx >= 0 and latency.ms_per_mpair >= 0
    two_decodes = BatchShape().plus(1, 40).plus(1, 40)
    assert latency.estimate_ms(two_decodes) == pytest.approx(latency.decode_ms[1] + latency.ms_per_kctx * 82 / 1e3)


def test_a_pool_too_small_for_two_decodes_gives_no_decode_table(tiny_runner):
    latency = profile_latency(tiny_runner, grid=(1, 2), decode_grid=(1, 10_000), repeats=1)
    assert latency.decode_grid == () and latency.decode_ms == ()


def test_robust_ms_drops_a_stall_and_takes_the_median():
    from backfill.serving.profiler import robust_ms

    assert robust_ms([10.0, 10.2, 9.9, 10.1, 55.0]) == 10.05  # the stall is dropped before the median
    assert robust_ms([4.0]) == 4.0
    with pytest.raises(ValueError):
        robust_ms([])


def test_monotone_pass_pools_one_slow_point_instead_of_carrying_it():
    from backfill.serving.profiler import _monotone
    # A running maximum would make every size after the 19 ms point cost 19 ms.
    table = _monotone([10.0, 19.0, 11.0, 12.0, 13.0, 26.0])
    assert all(a <= b for a, b in zip(table, table[1:]))
    assert table[-2] < 19.0 and table[0] == 10.0 and table[-1] == 26.0


def test_bad_repeat_counts_are_refused(tiny_runner):
    with pytest.raises(ValueError):
        profile_latency(tiny_runner, grid=(1, 2), decode_grid=(), repeats=0)


def test_each_shape_is_warmed_up_before_it_is_timed(tiny_runner, monkeypatch):
    shapes = _spy_shapes(tiny_runner, monkeypatch)
    profile_latency(tiny_runner, grid=(1, 2), decode_grid=(1, 2), repeats=3, warmups=2)
    assert shapes.count(((2, False),)) >= 5  # 2 warm-ups + 3 repeats of the 2-token chunk


def test_a_point_slower_than_a_bigger_shape_is_measured_again():
    from backfill.serving.profiler import remeasure_inversions
    calls = []

    def again(i):
        calls.append(i)
        return [10.0, 11.0, 12.0, 13.0][i]

    # Point 1 stalled in every repeat: measured again, and the faster value kept; point 2 is fine.
    assert remeasure_inversions([10.0, 90.0, 12.0, 13.0], again) == [10.0, 11.0, 12.0, 13.0]
    assert calls == [1]
    assert remeasure_inversions([10.0, 12.4, 10.0], lambda i: 99.0) == [10.0, 12.4, 10.0]  # within 1.25x


def test_with_mixed_step_graphs_the_token_table_is_eager_and_a_mixed_table_is_graphed(tiny_config, monkeypatch):
    """Where the runner graphs steps with prompt chunks (capture off on CPU), the token table is timed
    with them off and the chunks up to the largest bucket again with them on, for the mixed table."""
    from backfill.engine.cuda_graphs import DecodeGraphs
    from backfill.engine.kv_pool import KVBlockPool
    from backfill.engine.model import LlamaModel
    from backfill.engine.runner import ModelRunner
    from tests.conftest import random_weights

    model = LlamaModel(tiny_config, random_weights(tiny_config))
    kv = KVBlockPool(tiny_config, 64, 8)
    graphs = DecodeGraphs(model, kv, capture=False, mixed=True)
    runner = ModelRunner(model, kv, graphs)
    seen, execute = [], runner.execute

    def spy(chunks, *args, **kwargs) -> StepOutput:
        if all(c.start_pos == 0 for c in chunks):
            seen.append((len(chunks[0].token_ids), graphs.mixed))
        return execute(chunks, *args, **kwargs)

    monkeypatch.setattr(runner, "execute", spy)
    latency = profile_latency(runner, grid=(1, 8, 128), decode_grid=(1, 2), repeats=1, warmups=0)
    assert (128, False) in seen and (8, False) in seen      # token table: eager
    assert (8, True) in seen and (128, True) not in seen     # mixed table: up to the largest bucket
    assert latency.mixed_grid == (1, 8) and graphs.mixed
    assert all(ms >= 0 for ms in latency.mixed_ms)
    assert latency.graphs_mixed(BatchShape().plus(8, 0)) and not latency.graphs_mixed(BatchShape().plus(128, 0))
