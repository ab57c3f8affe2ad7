"""CFS (AQUA §7) on constructed states, and through the real scheduler on a tiny model with
its KV paged to host memory and to memory lent through a shared-memory segment."""

import pytest

from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.runner import ModelRunner
from backfill.sampling_params import SamplingParams
from backfill.errors import InvalidRequestError
from backfill.memory.elastic import ElasticStore, LocalLender, Location, ShmSegment
from backfill.memory.pager import KVPager, SwapReport
from backfill.policy.baselines import FCFSPolicy
from backfill.policy.cfs import CFSConfig, CFSPolicy
from backfill.policy.planner import BatchLimits
from backfill.policy.interface import SchedulerState, SeqView
from backfill.types import GenerationRequest, RequestClass
from backfill.serving.scheduler import Scheduler

ONLINE = RequestClass.ONLINE
LIMITS = BatchLimits(max_batch_tokens=64, max_batch_seqs=16, prefill_chunk_tokens=32)


def view(seq_id, *, arrival, prompt=16, computed=0, output=0, running=False):
    tokens = prompt + output
    return SeqView(seq_id, ONLINE, arrival, prompt, tokens, computed, -(-computed // 4) if running else 0, running,
                   max_tokens=64, num_output_tokens=output)


def state(seqs, total_blocks=16, free_blocks=None):
    used = sum(s.num_blocks for s in seqs)
    return SchedulerState(1.0, tuple(seqs), total_blocks - used if free_blocks is None else free_blocks,
                          total_blocks, 4, 512)


def test_new_prompt_displaces_the_decode_that_generated_most():
    old = [view(f"old{i}", arrival=i, output=30, computed=45, running=True) for i in range(3)]
    new = view("new", arrival=10)
    policy = CFSPolicy(CFSConfig(limits=LIMITS))
    plan = policy.schedule(state(old + [new], total_blocks=40))
    scheduled = {s.seq_id: s.num_tokens for s in plan.scheduled}
    assert scheduled["new"] == 16             # the whole prompt in this step's p tokens
    assert plan.preempt                       # somebody is paged out to make room...
    assert set(plan.preempt) <= {"old0", "old1", "old2"}
    assert plan.mode == "cfs"


def test_fewest_generated_decodes_first_and_prefill_least_computed_first():
    decodes = [view(f"d{n}", arrival=n, output=n, computed=16 + n - 1, running=True) for n in (9, 1, 5)]
    prefills = [view("p-half", arrival=0, prompt=32, computed=16, running=True), view("p-none", arrival=5, prompt=32)]
    limits = BatchLimits(max_batch_tokens=40, max_batch_seqs=16, prefill_chunk_tokens=32)
    policy = CFSPolicy(CFSConfig(limits=limits))
    chosen = [s.seq_id for s in policy._choose(state(decodes + prefills, total_blocks=30))]
    # d = 3 decodes fit in memory, so p = 40 - 3 = 37 prefill tokens: p-none's 32 (10 blocks with
    # k = 5 tokens of growth), then 5 of p-half's (7 blocks); then decodes by fewest generated:
    # d1 (6 blocks), d5 (7); d9 does not fit. In the batch, decodes come first.
    assert chosen == ["d1", "d5", "p-none", "p-half"]
    plan = policy.schedule(state(decodes + prefills, total_blocks=30))
    assert [(s.seq_id, s.num_tokens) for s in plan.scheduled] == [("d1", 1), ("d5", 1), ("p-none", 32), ("p-half", 6)]
    assert plan.preempt == ("d9",)


def test_slices_last_k_iterations_unless_a_resident_finishes():
    seqs = [view(f"s{i}", arrival=i, output=i + 1, computed=16 + i, running=True) for i in range(4)]
    policy = CFSPolicy(CFSConfig(slice_iterations=3, limits=LIMITS))
    for _ in range(3):
        policy.schedule(state(seqs, total_blocks=64))
    assert policy.slices == 1
    policy.schedule(state(seqs, total_blocks=64))
    assert policy.slices == 2
    policy.schedule(state(seqs[1:], total_blocks=64))  # s0 finished mid-slice
    assert policy.slices == 3


def test_falls_back_to_fcfs_only_when_host_paging_is_measured_too_dear():
    seqs = [view("a", arrival=0, output=3, computed=18, running=True), view("b", arrival=1)]
    policy = CFSPolicy(CFSConfig(limits=LIMITS, min_paged_tokens=100))
    policy.observe_step(None, 100.0)
    policy.observe_swap(SwapReport(Location.HOST, 50, 500.0, 0))
    assert not policy.falls_back                     # not measured enough yet
    policy.observe_swap(SwapReport(Location.LENT, 1000, 500.0, 0))
    assert not policy.falls_back                     # lent memory: keep paging
    policy.observe_swap(SwapReport(Location.HOST, 1000, 500.0, 0))
    assert policy.falls_back and policy.schedule(state(seqs)).mode == "cfs-fcfs"
    assert policy.fcfs_fallback_steps == 1
    policy.observe_swap(SwapReport(Location.HOST, 1000, 10.0, 0))
    assert not policy.falls_back                     # cheap host paging: CFS
    assert policy.schedule(state(seqs)).mode == "cfs" and policy.fcfs_fallback_steps == 1


def test_config_errors():
    with pytest.raises(InvalidRequestError):
        CFSConfig(slice_iterations=0)
    with pytest.raises(InvalidRequestError):
        CFSConfig(max_paging_share=0)


def _drain(scheduler):
    out = {}
    steps = 0
    while scheduler.has_work():
        for event in scheduler.step():
            out.setdefault(event.request_id, []).extend(event.token_ids)
        steps += 1
        assert steps < 5000
    return out


def _burst(n=10):
    params = SamplingParams.greedy_params(max_tokens=20)
    return [GenerationRequest([3 + (i * 7 + j * 5) % 250 for j in range(12 + i)], params, ONLINE, request_id=f"r{i}")
            for i in range(n)]


@pytest.mark.parametrize("swap", ["host", "lent"])
def test_cfs_pages_prompts_out_and_in_and_tokens_match_fcfs(tiny_config, tiny_runner, device, swap):
    """A pool of 12 blocks of 8 tokens holds ~3 of these requests: CFS pages the others out and in."""
    requests = _burst()
    reference = Scheduler(tiny_runner, FCFSPolicy())
    for r in requests:
        reference.add(r)
    expected = _drain(reference)

    small = ModelRunner(tiny_runner.model, KVBlockPool(tiny_config, 12, 8, device=device))
    segment = ShmSegment(1 << 20)
    try:
        lender = LocalLender(segment) if swap == "lent" else None
        scheduler = Scheduler(small, CFSPolicy(CFSConfig(limits=LIMITS, slice_iterations=5)))
        scheduler.pager = KVPager(ElasticStore(device=device, lender=lender))
        for r in _burst():
            scheduler.add(r)
        assert _drain(scheduler) == expected
        stats = scheduler.pager.stats
        assert stats.pages_out > 0 and stats.pages_in == stats.pages_out
        assert scheduler.stats.recomputed_tokens == 0      # paged, never recomputed
        assert scheduler.pager.resident_bytes == 0 and len(scheduler.pager.store) == 0
        if lender is not None:
            assert lender.bytes_lent == 0
    finally:
        segment.unlink()


def test_a_prompt_arriving_mid_slice_starts_at_once_when_memory_is_free():
    policy = CFSPolicy(CFSConfig(limits=LIMITS))
    running = [view("a", arrival=0, output=2, computed=17, running=True)]
    policy.schedule(state(running, total_blocks=40))
    plan = policy.schedule(state(running + [view("late", arrival=5)], total_blocks=40))
    assert {s.seq_id for s in plan.scheduled} == {"a", "late"} and not plan.preempt and policy.slices == 1
    # No memory for it: it waits for the next slice rather than evicting mid-slice.
    crowded = [view(f"c{i}", arrival=i, output=2, computed=17, running=True) for i in range(5)]
    policy = CFSPolicy(CFSConfig(limits=LIMITS))
    policy.schedule(state(crowded, total_blocks=30))
    plan = policy.schedule(state(crowded + [view("late", arrival=9)], total_blocks=30))
    assert "late" not in {s.seq_id for s in plan.scheduled} and not plan.preempt
