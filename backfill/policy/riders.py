"""Offline work riding in co-serving steps: which fits, whether it pays, what it really costs.

A co-serving step (ConServe §4.2 Algorithm 1) fills what its SLO budget leaves with offline
tokens: decodes, one per request ("riders"), then prompt chunks. They ride only where they pay:
what they add to the step must be at most a share of what an offline batch would spend on the
same tokens (1: break-even). On a GPU a decode step is bound by reading the weights and a rider costs a few
percent of a batch's token; on a CPU every token costs compute, and a rider can cost more than the
batch. What riders add is learned from the steps that carried them, apart from the online part's drift.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from backfill.policy.latency_model import BatchShape, LatencyModel, largest_chunk
from backfill.policy.planner import PlanBuilder
from backfill.policy.interface import SchedulerState, SeqView


@dataclass(frozen=True)
class _RidingStep:
    """A planned co-serving step with riders, to learn what they added once it has run."""

    online: BatchShape     # its online part alone
    shape: BatchShape      # with the riders
    correction: float      # the online step's drift it was planned with


class Riders:
    """Chooses a co-serving step's riders and learns their real cost; one per policy."""

    def __init__(self, latency: LatencyModel, estimate_ms: Callable[[BatchShape], float], *,
                 cost_share: float, batch_max_seqs: int) -> None:
        self.latency = latency
        self._estimate_ms = estimate_ms  # the policy's drift-corrected step estimate
        self.cost_share = cost_share
        self.batch_max_seqs = batch_max_seqs
        # What riders really add to a co-serving step, against what the profile says (EWMA): the
        # step's measured time less its online part's estimate.
        self.correction = 1.0
        self._riding: _RidingStep | None = None  # the last plan that carried riders
        # batch_ms_per_token of the plan being made (it walks the whole backlog; asked for twice a plan).
        self._priced: tuple[SchedulerState, float] | None = None

    def planned(self, online: BatchShape, shape: BatchShape, correction: float) -> None:
        """The plan just made: its online part, the whole step, and the drift it was planned with."""
        self._priced = None  # the next plan prices its own snapshot, after the drift has moved
        self._riding = _RidingStep(online, shape, correction) if shape.num_tokens > online.num_tokens else None

    def observe_step(self, shape: BatchShape, duration_ms: float) -> bool:
        """Learn from a step that carried riders; False when the step was not one (the policy's
        drift learns from it instead)."""
        riding, self._riding = self._riding, None
        if riding is None or riding.shape != shape:
            return False
        # Only what riders add: were such a step also to move the drift of its online part, a slow
        # rider would read as a slow machine, and with riders in every step the online part's
        # estimate would grow until riders looked free again.
        online_ms = riding.correction * self.latency.estimate_ms(riding.online)
        planned_ms = riding.correction * self.latency.estimate_ms(shape) - online_ms
        if planned_ms > 0:
            added = min(8.0, max(0.0, (duration_ms - online_ms) / planned_ms))
            self.correction = 0.9 * self.correction + 0.1 * added
        return True

    def add(self, plan: PlanBuilder, candidates: list[SeqView], state: SchedulerState, budget_ms: float,
            correction: float, reserve: int) -> None:
        """Add the offline decodes (one token each) that fit the step within budget_ms, as many as pay.

        Cheapest first: an offline decode costs a token plus its context's attention, so the shortest
        contexts fit the most offline tokens into the budget; long ones advance in offline batching
        mode. Riders are kept up to break-even, not one by one: a rider that moves a decode step into
        a bigger CUDA-graph bucket costs the whole padding, which the riders after it fill for free,
        so the kept prefix is the one whose riders together save the most, and a bucket the budget
        cannot fill enough to pay is not entered."""
        per_token_ms = self.batch_ms_per_token(state)
        from_mark, start = plan.mark(), plan.shape
        best_saving_ms, best_mark = 0.0, from_mark
        for seq in sorted(candidates, key=lambda s: (not s.running, s.num_computed_tokens)):
            if not seq.running and plan.free_blocks_for(seq) - state.blocks_for(seq, 1) < reserve:
                continue  # do not admit new offline work into the online headroom
            if correction * self.latency.estimate_ms(plan.shape.plus(1, seq.num_computed_tokens)) > budget_ms:
                continue
            if plan.add(seq, token_cap=1) == 0:
                continue
            saving_ms = self._saving_ms(start, plan, per_token_ms, correction)
            if saving_ms > 0 and saving_ms >= best_saving_ms:
                best_saving_ms, best_mark = saving_ms, plan.mark()
        plan.rollback(best_mark)

    def add_prefill(self, plan: PlanBuilder, candidates: list[SeqView], budget_ms: float, correction: float,
                    reserve: int, batch_tokens: int, cost_share: float | None = None) -> None:
        """Add offline prompt chunks (ConServe §4.2 Algorithm 1) as large as the budget allows; with a
        cost_share, each kept only where it costs the step at most that share of what an offline
        batch of batch_tokens spends on as many prompt tokens.

        Without one, the budget alone decides, as in the paper: a prompt left waiting for offline
        batching keeps its request from decoding, and under steady online load the riders the
        backlog could supply run short, so a prompt's price is not what it costs in a batch alone."""
        per_token_ms = self._estimate_ms(BatchShape().plus(batch_tokens, 0)) / batch_tokens
        for seq in candidates:
            if plan.tokens_left <= 0:
                break
            if not seq.running and plan.free_blocks_for(seq) - plan.state.blocks_for(seq, 1) < reserve:
                continue
            limit = min(seq.num_pending_tokens, plan.chunk_tokens, plan.tokens_left)
            n = largest_chunk(lambda shape: correction * self.latency.estimate_ms(shape), plan.shape, budget_ms,
                              seq.num_computed_tokens, limit)
            if n <= 0:
                continue
            before, mark = plan.shape, plan.mark()
            if plan.add(seq, token_cap=n) == 0:
                continue
            if cost_share is not None and self.added_ms(before, plan.shape, correction) > cost_share * n * per_token_ms:
                plan.rollback(mark)

    def added_ms(self, without: BatchShape, shape: BatchShape, correction: float) -> float:
        """What the offline tokens from `without` to `shape` add to a step: the profile's difference,
        corrected by the online step's drift and by what riders were measured to add."""
        return self.correction * correction * (self.latency.estimate_ms(shape) - self.latency.estimate_ms(without))

    def _saving_ms(self, without: BatchShape, plan: PlanBuilder, per_token_ms: float, correction: float) -> float:
        batch_ms = (plan.tokens - without.num_tokens) * per_token_ms
        return self.cost_share * batch_ms - self.added_ms(without, plan.shape, correction)

    def saving_ms(self, state: SchedulerState, without: BatchShape, plan: PlanBuilder,
                  correction: float) -> float | None:
        """What the offline tokens added to a co-serving step since `without` save against running
        them in an offline batch; None unless they cost the step at most cost_share of that.

        On a GPU a decode step is bound by reading the weights and an offline token rides along
        almost free, as ConServe assumes (§4.2). On a CPU every token costs compute, and a rider pays
        for its context's attention about what offline batching pays for one of its decode tokens:
        riders then lengthen the online step and gain no offline throughput. A share below 1 is a
        margin for the estimate's error.
        """
        added_ms = self.added_ms(without, plan.shape, correction)
        batch_ms = (plan.tokens - without.num_tokens) * self.batch_ms_per_token(state)
        return batch_ms - added_ms if added_ms <= self.cost_share * batch_ms else None

    def batch_ms_per_token(self, state: SchedulerState) -> float:
        """What an offline batch spends on each decode token, with the whole offline backlog decoding
        together (each at its context): the rate a rider's token is weighed against.

        Decodes only: a request's prompt is prefilled once wherever its decodes run, so what riders
        take over from offline batching is decode steps. The whole backlog, not only the requests
        decoding now: a batch of a few decodes at a lone step's cost would make riders look cheap.
        inf when there is no offline work."""
        if self._priced is not None and self._priced[0] is state:
            return self._priced[1]
        batch, n = BatchShape(), 0
        for seq in state.offline[: self.batch_max_seqs]:
            batch, n = batch.plus(1, max(seq.num_tokens - 1, 1)), n + 1
        per_token_ms = self._estimate_ms(batch) / n if n else float("inf")
        self._priced = (state, per_token_ms)
        return per_token_ms

    def release_suspended(self, state: SchedulerState, plan: PlanBuilder, held: list[SeqView], budget_ms: float,
                          correction: float, reserve: int) -> None:
        """Let requests of the suspended step ride, giving the step up, where that pays for it.

        The suspended step holds every running offline request, so nothing could ride until the
        online work is done. The price is the step's work so far (redone in a later batch); the gain
        is what the riders save per step, over the steps the online work has left (the longest
        remaining request's max_tokens, an upper bound).
        """
        before, riders_from = plan.shape, plan.mark()
        self.add(plan, held, state, budget_ms, correction, reserve)
        if plan.tokens == before.num_tokens:
            return
        saving_ms = self.saving_ms(state, before, plan, correction)
        steps_left = max(1, max(s.max_tokens - s.num_output_tokens for s in state.online))
        if saving_ms is None or saving_ms * steps_left < state.suspended_ms:
            plan.rollback(riders_from)
