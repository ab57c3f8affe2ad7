"""The plan builder's bookkeeping with cached prefixes, and HyGen's prefix-sharing order."""

from backfill.policy.interface import SchedulerState, SeqView
from backfill.policy.latency_model import BatchShape
from backfill.policy.planner import PlanBuilder, prefill_first
from backfill.types import RequestClass

OFFLINE = RequestClass.OFFLINE


def _waiting(seq_id: str, arrival_s: float, prompt: int = 100, cached: int = 0) -> SeqView:
    return SeqView(seq_id, OFFLINE, arrival_s, prompt, prompt, 0, 0, False, num_cached_tokens=cached)


def _state(*seqs: SeqView, free_blocks: int = 100) -> SchedulerState:
    return SchedulerState(100.0, seqs, free_blocks, 100, 16, 2048)


def test_a_cached_prefix_is_context_not_work():
    seq = _waiting("a", 0.0, prompt=100, cached=64)
    assert seq.num_pending_tokens == 36 and seq.num_context_tokens == 64
    state = _state(seq, free_blocks=7)
    # Its cached blocks are counted as needed (a free cached block leaves the free count when mapped).
    assert state.blocks_for(seq, 36) == 7
    plan = PlanBuilder(state, 512, 8, 512)
    assert plan.add(seq) == 36 and plan.free_blocks == 0
    assert plan.shape == BatchShape().plus(36, 64)
    tight = PlanBuilder(_state(seq, free_blocks=5), 512, 8, 512)
    assert tight.add(seq) == 80 - 64   # five blocks hold 80 tokens, 64 of them the cached prefix


def test_prefix_sharing_order_runs_cached_lines_first_within_a_bounded_wait():
    running = SeqView("run", OFFLINE, 5.0, 100, 100, 50, 4, True)
    decoding = SeqView("dec", OFFLINE, 1.0, 10, 20, 19, 2, True)
    old = _waiting("old", 0.0)                 # waited 100 s: past the bound, goes by arrival
    plain = _waiting("plain", 80.0)
    hit = _waiting("hit", 95.0, cached=64)
    best = _waiting("best", 99.0, cached=96)
    seqs = [decoding, best, plain, hit, old, running]
    assert [s.seq_id for s in prefill_first(seqs, now_s=100.0)] == ["old", "run", "best", "hit", "plain", "dec"]
    # Without a clock: arrival order, as before prefix caching.
    assert [s.seq_id for s in prefill_first(seqs)] == ["old", "run", "plain", "hit", "best", "dec"]
    assert [s.seq_id for s in prefill_first(seqs, now_s=100.0, max_wait_s=1000.0)][:2] == ["run", "best"]


def test_a_prompt_whose_next_block_another_computes_waits_a_step():
    first = SeqView("first", OFFLINE, 0.0, 100, 100, 32, 2, True, next_block_key=b"k2")
    twin = SeqView("twin", OFFLINE, 1.0, 90, 90, 0, 0, False, num_cached_tokens=32, next_block_key=b"k2")
    other = SeqView("other", OFFLINE, 2.0, 90, 90, 0, 0, False, next_block_key=b"x0")
    plan = PlanBuilder(_state(first, twin, other), 512, 8, 512)
    assert plan.add(first) == 68
    assert plan.add(twin) == 0 and plan.add(other) == 90
    plan.rollback(0)
    assert plan.add(twin) == 0    # first, on the device, computes it when next scheduled
    plan.preempt(first)
    assert plan.add(twin) == 58   # nothing computes its block now: it goes


def test_a_prompt_waits_for_the_block_a_suspended_step_computes():
    """An aborted offline step holds a prompt's next block: a waiting line with the same prefix
    does not compute it again beside it (in a co-serving step, where the suspended one cannot ride)."""
    suspended = SeqView("sus", OFFLINE, 0.0, 1000, 1000, 512, 32, True, suspended=True, next_block_key=b"k32")
    twin = SeqView("twin", OFFLINE, 1.0, 1000, 1000, 0, 0, False, num_cached_tokens=512, next_block_key=b"k32")
    plan = PlanBuilder(_state(suspended, twin), 512, 8, 512)
    assert plan.add(twin) == 0


def test_an_online_prompt_does_not_wait_for_an_offline_one_on_the_device():
    offline = SeqView("off", OFFLINE, 0.0, 1000, 1000, 512, 32, True, next_block_key=b"k32")
    online = SeqView("on", RequestClass.ONLINE, 1.0, 1000, 1000, 0, 0, False, num_cached_tokens=512,
                     next_block_key=b"k32")
    twin = SeqView("twin", OFFLINE, 2.0, 1000, 1000, 0, 0, False, num_cached_tokens=512, next_block_key=b"k32")
    plan = PlanBuilder(_state(offline, online, twin), 512, 8, 512)
    assert plan.add(twin) == 0 and plan.add(online) == 488
    # Once a prompt of the plan computes the block, everybody waits for it.
    later = SeqView("later", RequestClass.ONLINE, 3.0, 1000, 1000, 0, 0, False, num_cached_tokens=512,
                    next_block_key=b"k32")
    assert plan.add(later) == 0
    # An online prompt on the device holds back an online one too.
    on_device = SeqView("first", RequestClass.ONLINE, 0.0, 1000, 1000, 512, 32, True, next_block_key=b"k32")
    assert PlanBuilder(_state(on_device, online), 512, 8, 512).add(online) == 0


def test_offline_allocations_leave_online_cached_blocks_alone():
    """Echo: free blocks an online request's prefix left cached are not offline's to take."""
    oldest = SeqView("oldest", OFFLINE, 0.0, 200, 200, 100, 7, True)
    younger = SeqView("younger", OFFLINE, 1.0, 200, 200, 112, 7, True)   # its blocks are full
    new = _waiting("new", 2.0, prompt=160)
    online = SeqView("on", RequestClass.ONLINE, 3.0, 96, 96, 0, 0, False)
    state = SchedulerState(100.0, (oldest, younger, new, online), 20, 100, 16, 2048, online_reused_free_blocks=14)
    plan = PlanBuilder(state, 512, 8, 512)
    assert plan.free_blocks_for(new) == 6 and plan.free_blocks_for(younger) == 6
    # Online requests take every block; so does a lone running offline request (nothing to preempt).
    assert plan.free_blocks_for(oldest) == 6 and plan.free_blocks_for(online) == 20
    lone = PlanBuilder(SchedulerState(100.0, (oldest, new), 20, 100, 16, 2048, online_reused_free_blocks=14),
                       512, 8, 512)
    assert lone.free_blocks_for(oldest) == 20 and lone.free_blocks_for(new) == 6
    assert plan.add(new) == 96                 # six blocks hold 96 tokens of its 160
    assert plan.free_blocks == 14 and plan.free_blocks_for(younger) == 0
    assert plan.add(younger) == 0
    # An online prompt takes the unprotected blocks first, then the protected ones.
    plan.rollback(0)
    assert plan.add(online) == 96 and (plan.free_blocks, plan.protected_blocks) == (14, 14)
    assert plan.free_blocks_for(new) == 0
    plan.rollback(0)
    assert (plan.free_blocks, plan.protected_blocks) == (20, 14)


def test_online_cached_protection_is_capped_at_a_share_of_the_pool():
    new = _waiting("new", 2.0, prompt=160)
    state = SchedulerState(100.0, (new,), 90, 100, 16, 2048, online_reused_free_blocks=80)
    plan = PlanBuilder(state, 512, 8, 512)
    assert plan.protected_blocks == 50 and plan.free_blocks_for(new) == 40
