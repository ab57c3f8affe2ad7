"""Elastic tensors: bytes identical wherever they move (AQUA §6), gathered moves, lent regions freed."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backfill.errors import OffloadError, UnknownTensorError
from backfill.memory.elastic import ElasticStore, LocalLender, Location, ShmSegment
from backfill.memory.regions import first_fit


@pytest.fixture
def segment():
    seg = ShmSegment(1 << 20)
    yield seg
    seg.unlink()


DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)

moves = st.lists(st.tuples(st.sampled_from(["put", "move", "move_all", "reclaim", "offer", "boundary", "free"]),
                           st.integers(0, 5), st.sampled_from(list(Location)), st.integers(1, 300),
                           st.sampled_from(range(len(DTYPES)))), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=moves)
def test_bytes_identical_after_every_move(segment, ops):
    lender = LocalLender(segment)
    store = ElasticStore(lender=lender)
    expected: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(len(ops))
    for op, index, where, size, dtype_index in ops:
        key = f"t{index}"
        if op == "put":
            data = (torch.randn(size, 3, generator=g) * 100).to(DTYPES[dtype_index])
            expected[key] = data.clone()
            got = store.put(key, data, where)
            data.zero_()  # the store keeps its own copy
            assert got is where or (where is Location.LENT and got is Location.HOST)
        elif op == "move" and key in expected:
            store.move([key], where)
        elif op == "move_all" and expected:
            store.move(sorted(expected), where)
        elif op == "reclaim":
            lender.reclaiming = True
        elif op == "offer":
            lender.reclaiming = False
        elif op == "boundary":
            store.at_step_boundary()
            if lender.reclaiming:
                assert store.bytes_in(Location.LENT) == 0
        elif op == "free" and key in expected:
            store.free(key)
            del expected[key]
        for k, want in expected.items():
            assert torch.equal(store.read(k), want), (op, k)
        assert sorted(store.keys()) == sorted(expected)
    for k in list(expected):
        store.free(k)
    assert lender.bytes_lent == 0  # every lent region went back


def test_gathered_move_is_one_region(segment):
    lender = LocalLender(segment)
    store = ElasticStore(lender=lender)
    for i in range(8):
        store.put(f"b{i}", torch.full((16, 4), float(i)), Location.HOST)
    store.move([f"b{i}" for i in range(8)], Location.LENT)
    assert len(lender._taken) == 1 and store.stats.moves == 9
    store.free("b0")
    assert len(lender._taken) == 1  # the others still live in it
    for i in range(1, 8):
        assert torch.equal(store.read(f"b{i}"), torch.full((16, 4), float(i)))
        store.free(f"b{i}")
    assert lender.bytes_lent == 0


def test_full_segment_falls_back_to_host(segment):
    store = ElasticStore(lender=LocalLender(segment))
    assert store.put("big", torch.zeros(2 << 20, dtype=torch.uint8)) is Location.HOST
    assert store.stats.fell_back == 1
    assert store.put("small", torch.ones(10)) is Location.LENT


def test_reclaim_vacates_then_returns(segment):
    lender = LocalLender(segment)
    store = ElasticStore(lender=lender)
    store.put("a", torch.arange(100.0))
    lender.reclaiming = True
    assert store.at_step_boundary() == 1 and store.location("a") is Location.HOST and lender.bytes_lent == 0
    lender.reclaiming = False
    store.at_step_boundary()
    assert store.location("a") is Location.LENT
    assert torch.equal(store.read("a"), torch.arange(100.0))


def test_errors():
    store = ElasticStore()
    with pytest.raises(UnknownTensorError):
        store.read("nope")
    with pytest.raises(UnknownTensorError):
        store.free("nope")
    with pytest.raises(OffloadError):
        ShmSegment(0)
    assert store.put("x", torch.ones(3)) is Location.HOST  # no lender: host memory


def test_first_fit():
    assert first_fit([], 100, 100) == 0
    assert first_fit([(0, 10)], 100, 10) == 64
    assert first_fit([(0, 10), (64, 10)], 256, 50) == 128
    assert first_fit([(0, 10), (128, 10)], 256, 64) == 64
    assert first_fit([(0, 250)], 256, 10) is None


def test_producers_lend_a_host_segment_on_cpu_and_bad_ipc_names_are_typed_errors():
    from backfill.memory.elastic import make_segment, map_segment

    segment = make_segment(4096, "cpu")
    try:
        assert isinstance(segment, ShmSegment) and map_segment(segment.path).numel() == 4096
    finally:
        segment.unlink()
    with pytest.raises(OffloadError, match="cannot open lent device memory"):
        map_segment("cuda-ipc:bm90IGEgcGlja2xl")

