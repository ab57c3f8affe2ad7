import pytest

from backfill.errors import BackfillError
from backfill.policy.latency_model import BatchShape, LatencyModel


def test_interpolates_extrapolates_and_adds_context_terms():
    m = LatencyModel((1, 9, 17), (10.0, 10.0, 18.0), ms_per_kctx=2.0, ms_per_mpair=1.0)
    assert m.estimate_ms(BatchShape(5)) == 10.0
    assert m.estimate_ms(BatchShape(13)) == 14.0
    assert m.estimate_ms(BatchShape(25)) == 26.0
    assert m.estimate_ms(BatchShape(5, decode_context_tokens=1000)) == 12.0
    assert m.estimate_ms(BatchShape(0)) == 0.0


def test_shape_plus_counts_decode_context_and_prefill_pairs():
    s = BatchShape().plus(1, 99).plus(4, 0)
    assert s.num_tokens == 5 and s.decode_context_tokens == 100 and s.prefill_attention_pairs == 10
    assert s.prefill_context_pairs == 0
    assert s.plus(4, 10).prefill_context_pairs == 40


def test_a_chunk_from_position_0_costs_what_the_table_says():
    # The table was measured on chunks from position 0: their own attention is in it, and only the
    # pairs against earlier context are added (no double count).
    m = LatencyModel((1, 512), (10.0, 20.0), ms_per_mpair=100.0)
    assert m.estimate_ms(BatchShape().plus(512, 0)) == 20.0
    assert m.estimate_ms(BatchShape().plus(512, 1000)) == pytest.approx(20.0 + 100.0 * 512 * 1000 / 1e6)


def test_max_new_tokens_inverts_estimate():
    m = LatencyModel((1, 101), (10.0, 110.0))
    assert m.max_new_tokens(BatchShape(), 50.0, 0, 1000) == 41
    assert m.max_new_tokens(BatchShape(40), 50.0, 0, 1000) == 1
    assert m.max_new_tokens(BatchShape(), 5.0, 0, 1000) == 0


def test_save_load_round_trip_and_corrupt_file(tmp_path):
    m = LatencyModel((1, 64), (3.0, 9.0), 0.5, 0.25, "cpu", "tiny")
    m.save(tmp_path / "p.json")
    assert LatencyModel.load(tmp_path / "p.json") == m
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(BackfillError, match="latency profile"):
        LatencyModel.load(tmp_path / "bad.json")
    with pytest.raises(BackfillError):
        LatencyModel((1,), (1.0,))


def test_decode_steps_read_the_decode_table_and_steps_with_prompt_tokens_the_token_table():
    # A GPU: decodes from CUDA graphs at 3 ms, any step with a prompt chunk eager at 11 ms.
    m = LatencyModel((1, 64), (11.0, 12.0), ms_per_kctx=1.0, decode_grid=(1, 8), decode_ms=(3.0, 3.7))
    two_decodes = BatchShape().plus(1, 499).plus(1, 499)
    assert m.estimate_ms(two_decodes) == pytest.approx(3.1 + 1.0)
    assert m.estimate_ms(two_decodes.plus(2, 0)) == pytest.approx(11.0 + 3 / 63 + 1.0)
    # Past the decode table's last point the token table takes over.
    many = BatchShape()
    for _ in range(9):
        many = many.plus(1, 99)
    assert m.estimate_ms(many) == pytest.approx(11.0 + 8 / 63 + 0.9)


def test_decode_table_round_trips_and_is_validated(tmp_path):
    m = LatencyModel((1, 64), (3.0, 9.0), decode_grid=(1, 2, 4), decode_ms=(1.0, 1.5, 2.0))
    m.save(tmp_path / "p.json")
    assert LatencyModel.load(tmp_path / "p.json") == m
    with pytest.raises(BackfillError, match="decode table"):
        LatencyModel((1, 64), (3.0, 9.0), decode_grid=(1,), decode_ms=(1.0,))
    with pytest.raises(BackfillError, match="decode table"):
        LatencyModel((1, 64), (3.0, 9.0), decode_grid=(1, 2), decode_ms=(1.0,))
    with pytest.raises(BackfillError, match="decode grid"):
        LatencyModel((1, 64), (3.0, 9.0), decode_grid=(2, 1), decode_ms=(1.0, 2.0))


def test_steps_with_prompt_chunks_read_the_mixed_table_up_to_its_last_point():
    # A GPU with mixed-step graphs: a prompt chunk beside decodes costs the graphed step, its tokens'
    # attention priced per (query, key) pair at the decode rate; past the table, the eager token table.
    m = LatencyModel((1, 64, 128), (11.0, 12.0, 13.0), ms_per_kctx=1.0, ms_per_mpair=0.5,
                     decode_grid=(1, 8), decode_ms=(3.0, 3.7), mixed_grid=(1, 64), mixed_ms=(3.0, 9.3))
    decodes = BatchShape().plus(1, 499).plus(1, 499)
    assert m.estimate_ms(decodes) == pytest.approx(3.1 + 1.0)  # decodes alone: the decode table
    mixed = decodes.plus(4, 10)  # 6 tokens; the chunk's pairs: 4 * 10 + 10 = 50
    assert m.graphs_mixed(mixed)
    assert m.estimate_ms(mixed) == pytest.approx(3.0 + 6.3 * 5 / 63 + 1.0 * (1000 + 50) / 1e3)
    eager = decodes.plus(70, 10)
    assert not m.graphs_mixed(eager)
    assert m.estimate_ms(eager) == pytest.approx(12.0 + 8 / 64 + 1.0 + 0.5 * 700 / 1e6)
    # Without the graphs (an engine that runs them eagerly) the same step reads the token table.
    plain = m.without_mixed_graphs()
    assert not plain.graphs_mixed(mixed) and plain.decode_grid == m.decode_grid
    assert plain.estimate_ms(mixed) == pytest.approx(11.0 + 5 / 63 + 1.0 + 0.5 * 40 / 1e6)


def test_mixed_table_round_trips_and_is_validated(tmp_path):
    m = LatencyModel((1, 64), (3.0, 9.0), mixed_grid=(1, 64), mixed_ms=(2.0, 4.0))
    m.save(tmp_path / "p.json")
    assert LatencyModel.load(tmp_path / "p.json") == m
    with pytest.raises(BackfillError, match="mixed table"):
        LatencyModel((1, 64), (3.0, 9.0), mixed_grid=(1,), mixed_ms=(1.0,))
    with pytest.raises(BackfillError, match="mixed grid"):
        LatencyModel((1, 64), (3.0, 9.0), mixed_grid=(4, 1), mixed_ms=(1.0, 2.0))
