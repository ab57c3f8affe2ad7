"""Reference policies the co-serving policy is measured against.

fcfs and priority default to vLLM V1's scheduling budget for its API server (2048 batched
tokens per step, 256 sequences), as ConServe's vLLM++ baseline used vLLM's own defaults.

online-only: serves online requests and ignores offline ones (the latency baseline).
fcfs:        one queue by arrival time, no notion of class.
priority:    online first at iteration level, offline fills the rest of the token budget; no
             SLO budget and no mid-step preemption (ConServe's "vLLM++" baseline, §6.1).
"""

from __future__ import annotations

from typing import Callable

from backfill.policy.planner import BatchLimits, PlanBuilder, decode_first, recompute_cost_order
from backfill.policy.interface import SchedulerState, SchedulingPolicy, SeqView, StepPlan


def _serve_in_order(state: SchedulerState, order: list[SeqView], limits: BatchLimits,
                    victims_for: Callable[[SeqView], list[SeqView]],
                    may_evict: Callable[[SeqView], bool] = lambda seq: seq.running) -> PlanBuilder:
    plan = PlanBuilder(state, limits.max_batch_tokens, limits.max_batch_seqs, limits.prefill_chunk_tokens)
    for seq in order:
        if plan.tokens_left <= 0:
            break
        want = min(seq.num_pending_tokens, limits.prefill_chunk_tokens, plan.tokens_left)
        if may_evict(seq) and state.blocks_for(seq, want) > plan.free_blocks_for(seq):
            # A sequence that cannot grow takes blocks from lower-ranked ones (vLLM-style).
            plan.make_room(seq, want, victims_for(seq))
        plan.add(seq)
    return plan


class OnlineOnlyPolicy(SchedulingPolicy):
    name = "online-only"

    def __init__(self, limits: BatchLimits = BatchLimits()) -> None:
        self.limits = limits

    def schedule(self, state: SchedulerState) -> StepPlan:
        online = decode_first(state.online)
        victims = lambda seq: [s for s in reversed(online) if s.running and s.arrival_s > seq.arrival_s]
        return _serve_in_order(state, online, self.limits, victims).plan(mode="online")


VLLM_DEFAULT_LIMITS = BatchLimits(max_batch_tokens=2048, max_batch_seqs=256, prefill_chunk_tokens=2048)


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def __init__(self, limits: BatchLimits = VLLM_DEFAULT_LIMITS) -> None:
        self.limits = limits

    def schedule(self, state: SchedulerState) -> StepPlan:
        order = decode_first(list(state.seqs))
        victims = lambda seq: [s for s in reversed(order) if s.running and s.arrival_s > seq.arrival_s]
        return _serve_in_order(state, order, self.limits, victims).plan(mode="fcfs")


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def __init__(self, limits: BatchLimits = VLLM_DEFAULT_LIMITS) -> None:
        self.limits = limits

    def schedule(self, state: SchedulerState) -> StepPlan:
        offline = decode_first(state.offline)
        order = decode_first(state.online) + offline
        offline_victims = recompute_cost_order([s for s in offline if s.running])

        def victims(seq: SeqView) -> list[SeqView]:
            if seq.is_online:
                return offline_victims
            return [s for s in reversed(offline) if s.running and s.arrival_s > seq.arrival_s]

        return _serve_in_order(state, order, self.limits, victims,
                               may_evict=lambda seq: seq.running or seq.is_online).plan(mode="priority")
