"""Completely fair scheduling of prompts with prefill/decode batch partitioning (AQUA §7).

Every k iterations (a time slice), or when a resident request finishes, the policy picks the
requests that own device memory for the next slice: prefills with the fewest prompt tokens
computed first, given p = b - d tokens of the batch, then decodes with the fewest tokens
generated, d of them (d: as many as fit in memory, the paper's upper bound), then more
prefills while memory lasts. Running requests left out are preempted: the scheduler pages
their KV out to its swap space (elastic tensors, memory/pager.py) and back in when a later
slice picks them, so nobody waits for the requests admitted before a burst to finish.

Context switches cost copies. With only host memory as swap space and paging measured to take
more than max_paging_share of the step time, the policy falls back to first-come-first-served
(AQUA §7: "fall back to FCFS from CFS when tensors are on DRAM"); it returns to CFS when lent
memory is offered again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backfill.errors import InvalidRequestError
from backfill.memory.elastic import Location
from backfill.memory.pager import SwapReport
from backfill.policy.baselines import VLLM_DEFAULT_LIMITS, FCFSPolicy
from backfill.policy.latency_model import BatchShape
from backfill.policy.planner import BatchLimits, PlanBuilder
from backfill.policy.interface import SchedulerState, SchedulingPolicy, SeqView, StepPlan


@dataclass(frozen=True)
class CFSConfig:
    slice_iterations: int = 5            # k: iterations per time slice (the paper's code uses 5)
    limits: BatchLimits = VLLM_DEFAULT_LIMITS   # b = max_batch_tokens, as the FCFS baseline's
    max_paging_share: float = 0.25       # host-memory paging above this share of step time: FCFS
    min_paged_tokens: int = 512          # paging measured over at least this many tokens first

    def __post_init__(self) -> None:
        if self.slice_iterations < 1:
            raise InvalidRequestError(f"slice_iterations must be >= 1, got {self.slice_iterations}")
        if not 0.0 < self.max_paging_share <= 1.0:
            raise InvalidRequestError(f"max_paging_share must be in (0, 1], got {self.max_paging_share}")
        if self.min_paged_tokens < 0:
            raise InvalidRequestError(f"min_paged_tokens must be >= 0, got {self.min_paged_tokens}")


def is_prefill(seq: SeqView) -> bool:
    return seq.num_computed_tokens < seq.num_prompt_tokens


@dataclass
class CFSPolicy(SchedulingPolicy):
    config: CFSConfig = field(default_factory=CFSConfig)
    name: str = "cfs"

    def __post_init__(self) -> None:
        self._fcfs = FCFSPolicy(self.config.limits)
        self._resident: list[str] = []
        self._iterations_left = 0
        self._forward_ms = 0.0
        self._swap: SwapReport | None = None
        self.slices = 0
        self.fcfs_fallback_steps = 0      # steps planned by FCFS because paging measured too dear

    # --- what the scheduler reports -------------------------------------------------------------

    def observe_step(self, shape: BatchShape, duration_ms: float) -> None:
        self._forward_ms += duration_ms

    def observe_swap(self, report: SwapReport) -> None:
        self._swap = report

    @property
    def paging_share(self) -> float:
        """Share of the time in steps and paging that paging took, as measured so far."""
        paging = self._swap.paging_ms if self._swap is not None else 0.0
        return paging / (paging + self._forward_ms) if paging > 0 else 0.0

    @property
    def falls_back(self) -> bool:
        """Host-only swap space whose measured paging costs more than the slices are worth."""
        swap = self._swap
        return (swap is not None and swap.location is Location.HOST
                and swap.paged_tokens >= self.config.min_paged_tokens
                and self.paging_share > self.config.max_paging_share)

    # --- planning -----------------------------------------------------------------------------

    def schedule(self, state: SchedulerState) -> StepPlan:
        if self.falls_back:
            self.fcfs_fallback_steps += 1
            fcfs = self._fcfs.schedule(state)
            self._resident, self._iterations_left = [], 0
            return StepPlan(fcfs.scheduled, fcfs.preempt, False, "cfs-fcfs", fcfs.info)
        by_id = {s.seq_id: s for s in state.seqs}
        if self._iterations_left <= 0 or any(seq_id not in by_id for seq_id in self._resident):
            self._resident = [s.seq_id for s in self._choose(state)]
            self._iterations_left = self.config.slice_iterations
            self.slices += 1
        self._iterations_left -= 1
        limits = self.config.limits
        plan = PlanBuilder(state, limits.max_batch_tokens, limits.max_batch_seqs, limits.prefill_chunk_tokens)
        resident = set(self._resident)
        for seq in state.seqs:
            if seq.running and seq.seq_id not in resident:
                plan.preempt(seq)   # paged out: not in this slice
        for seq_id in self._resident:
            plan.add(by_id[seq_id])
        # Work conserving: a prompt that arrived mid-slice starts now if memory is free for it
        # (and its k tokens of growth), without preempting anybody.
        for seq in sorted((s for s in state.seqs if s.seq_id not in resident and not s.running and is_prefill(s)),
                          key=lambda s: (s.num_computed_tokens, s.arrival_s)):
            chunk = min(seq.num_pending_tokens, limits.prefill_chunk_tokens, plan.tokens_left)
            if chunk <= 0 or state.blocks_for(seq, chunk + self.config.slice_iterations) > plan.free_blocks_for(seq):
                break
            if plan.add(seq):
                self._resident.append(seq.seq_id)
        return plan.plan(mode="cfs", slice_left=self._iterations_left)

    def _choose(self, state: SchedulerState) -> list[SeqView]:
        """The slice's residents: p prefill tokens, d decodes, in fairness order, within memory."""
        k, bs, limits = self.config.slice_iterations, state.block_size, self.config.limits
        blocks = lambda tokens: -(-tokens // bs)  # noqa: E731
        prefills = sorted((s for s in state.seqs if is_prefill(s)),
                          key=lambda s: (s.num_computed_tokens, s.arrival_s))
        decodes = sorted((s for s in state.seqs if not is_prefill(s)),
                         key=lambda s: (s.num_output_tokens, s.arrival_s))
        # d: the decodes that fit in memory (with k tokens of growth each), capped by the batch.
        memory, d = state.total_blocks, 0
        for seq in decodes[:limits.max_batch_seqs]:
            need = blocks(seq.num_tokens + k)
            if need > memory:
                break
            memory -= need
            d += 1
        prefill_tokens = max(0, limits.max_batch_tokens - d)
        memory = state.total_blocks
        chosen: list[SeqView] = []
        taken: set[str] = set()

        def take(seq: SeqView, tokens: int) -> bool:
            nonlocal memory
            need = blocks(seq.num_context_tokens + tokens + k)
            if need > memory or len(chosen) >= limits.max_batch_seqs:
                return False
            memory -= need
            chosen.append(seq)
            taken.add(seq.seq_id)
            return True

        for seq in prefills:                              # p: fewest prefill tokens computed first
            chunk = min(seq.num_pending_tokens, limits.prefill_chunk_tokens, prefill_tokens)
            if chunk <= 0:
                break
            if take(seq, chunk):
                prefill_tokens -= chunk
        for seq in decodes:                               # d: fewest tokens generated first
            take(seq, seq.num_pending_tokens)
        for seq in prefills:                              # memory left: more prompts start
            if seq.seq_id not in taken:
                take(seq, min(seq.num_pending_tokens, limits.prefill_chunk_tokens))
        if not chosen and (prefills or decodes):
            chosen = [(prefills or decodes)[0]]           # too big for a fair share: run it alone
        # Decodes first in the batch: prefill chunks take what tokens are left (p = b - d).
        return sorted(chosen, key=is_prefill)
