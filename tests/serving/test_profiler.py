"""The latency profiler on a tiny random model: what it measures and what it fits."""

from backfill.engine.runner import StepOutput
from backfill.serving.profiler import profile_latency


def test_the_one_token_point_is_a_lone_decode_and_the_table_never_decreases(tiny_runner, monkeypatch):
    # With compiled decode a lone decode runs its own faster path; a 1-token prefill chunk would
    # run eager, so the profile must time a decode (start_pos > 0, one sequence, logits wanted).
    lone_decodes, execute = [], tiny_runner.execute

    def spy(chunks, *args, **kwargs) -> StepOutput:
        if len(chunks) == 1 and len(chunks[0].token_ids) == 1:
            lone_decodes.append(chunks[0])
        return execute(chunks, *args, **kwargs)

    monkeypatch.setattr(tiny_runner, "execute", spy)
    latency = profile_latency(tiny_runner, grid=(1, 2, 8), repeats=2)
    assert lone_decodes and all(c.start_pos > 0 and c.want_logits for c in lone_decodes)
    assert latency.token_grid == (1, 2, 8)
    assert all(a <= b for a, b in zip(latency.step_ms, latency.step_ms[1:]))
    assert latency.step_ms[0] > 0 and latency.ms_per_kctx >= 0 and latency.ms_per_mpair >= 0
    # The scratch sequences' blocks are all given back.
    assert tiny_runner.kv.num_free == tiny_runner.kv.num_usable


def test_points_of_compiled_decode_batch_sizes_are_timed_as_decode_batches(tiny_runner, monkeypatch):
    # Two and three sequences decoding take compiled decode's path too; the profile reads which
    # batch sizes it was built for. (No pieces here: the steps themselves run eager.)
    from types import SimpleNamespace

    monkeypatch.setattr(tiny_runner.model, "compiled_decode", SimpleNamespace(batch_sizes=(1, 2), pieces={}))
    shapes, execute = [], tiny_runner.execute

    def spy(chunks, *args, **kwargs) -> StepOutput:
        shapes.append(tuple((len(c.token_ids), c.start_pos > 0) for c in chunks))
        return execute(chunks, *args, **kwargs)

    monkeypatch.setattr(tiny_runner, "execute", spy)
    profile_latency(tiny_runner, grid=(1, 2, 4), repeats=2)
    assert ((1, True), (1, True)) in shapes   # the 2-token point: two decodes
    assert ((4, False),) in shapes            # the 4-token point: a prefill chunk
    assert ((2, False),) not in shapes
    assert tiny_runner.kv.num_free == tiny_runner.kv.num_usable
