"""The latency profiler on a tiny random model: what it measures and what it fits."""

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
    assert latency.estimate_ms(two_decodes) == latency.decode_ms[1] + latency.ms_per_kctx * 82 / 1e3


def test_a_pool_too_small_for_two_decodes_gives_no_decode_table(tiny_runner):
    latency = profile_latency(tiny_runner, grid=(1, 2), decode_grid=(1, 10_000), repeats=1)
    assert latency.decode_grid == () and latency.decode_ms == ()
