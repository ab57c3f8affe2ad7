"""ConServe's SLO-aware co-serving policy (ConServe §4.2 Algorithms 1-2, §4.5).

Co-serving mode (online work present): online requests go in first; the step gets a latency
budget from the SLOs (TPOT when online requests decode, else what is left of the most urgent
TTFT) and offline tokens fill what the latency model says still fits: offline decodes first, then
offline prompt chunks (Algorithm 1), each where it costs no more per token there than in an
offline batch (on a CPU a few offline tokens can turn a fast lone decode into a slow eager step
for no throughput; on a GPU without mixed-step graphs a prompt chunk turns a graph-replayed
decode step into an eager one, and with them its tokens read their context as decodes do).
The budget is planned to a margin below the SLO that follows the latency model's measured error
on recent co-serving steps (§4.5). Offline requests never hold blocks an online request needs:
they are preempted, checkpointed ones first.

The TPOT SLO bounds a request's mean time per output token, not every step: a decoding request
whose steps so far ran faster than its SLO has banked the difference, and a step may spend it,
up to a few SLOs long (bank_step_max_slos): on a GPU such a step prefills the offline prompts that
waited through a stretch of co-serving, which would otherwise keep their requests from decoding.
Steps slowed by online prefills draw the bank down, so the next steps carry fewer offline tokens.
What the bank cannot see is the future: an online request arriving later stalls every decoding
request for its prefill, and a request that had spent its bank would end over the SLO. So the
bank is only spent above a reserve for such prefills, sized by the longest prompt among recent
online requests (a request has to earn it first: early tokens spend nothing). The paper's
per-step budget, or the interference cap when one is set, is the floor.

Offline batching mode (no online work): offline runs in big batches, ignoring the budget, as
large as the preemption target allows: a step can only be aborted at a safepoint (three per
layer), so the work between two safepoints must take no longer than the latency we promise.

Algorithm 2: when an online request arrives during a preemptible step, abort the step at the
next layer safepoint if finishing it would make the request miss its TTFT SLO - or, with an
interference cap, if finishing it would delay the request by more than that share of its prefill.
The aborted step is suspended, not lost: once no online work is left, offline batching continues
it from that safepoint. Meanwhile co-serving steps may take its requests as riders, giving the step
up, where their savings over the online work left pay for the work it loses.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from backfill.policy.config import CoServeConfig
from backfill.policy.drift import LatencyDrift
from backfill.policy.latency_model import BatchShape, LatencyModel, largest_chunk
from backfill.policy.model_error import ModelErrorLog
from backfill.policy.planner import BatchLimits, PlanBuilder, decode_first, prefill_first, recompute_cost_order
from backfill.policy.riders import Riders
from backfill.types import SLO
from backfill.policy.interface import (RunningStep, SafepointLayout, SchedulerState, SchedulingPolicy, SeqView,
                                       StepPlan)

# The adapted margin: read from this many recent co-serving steps, once at least MARGIN_MIN_STEPS
# ran, and kept within [MARGIN_MIN, slo_margin_max] (never the whole budget: the P90 is a sample).
MARGIN_WINDOW_STEPS = 256
MARGIN_MIN_STEPS = 32
MARGIN_MIN = 0.5


class CoServePolicy(SchedulingPolicy):
    name = "coserve"

    def __init__(self, latency: LatencyModel, layout: SafepointLayout, config: CoServeConfig = CoServeConfig(),
                 limits: BatchLimits = BatchLimits()) -> None:
        self.latency = latency
        self.layout = layout  # the runner's (ModelRunner.safepoint_layout)
        self.config = config
        self.limits = limits
        # Measured / estimated step time (EWMA) per batch-size bucket, as small and big steps drift
        # from the profile differently; an unseen bucket follows the drift of all steps.
        self._corrections: dict[int, float] = {}
        self._overall_correction = 1.0
        # The whole machine's drift from the profile, followed within seconds (drift.py); the bucket
        # corrections above learn what is left of each step's error after it.
        self.latency_drift = LatencyDrift()
        self._now_s = 0.0
        self._offline_tokens_factor = 1.0
        self._offline_tokens = self._offline_batch_tokens()
        self._recent_online_prompts: OrderedDict[str, int] = OrderedDict()  # seq id -> prompt tokens
        self.riders = Riders(latency, self._estimate_ms, cost_share=config.rider_cost_share,
                             batch_max_seqs=config.offline_batch_max_seqs)
        # What each plan was predicted to take, to report the model's error on the steps that ran.
        self.model_error = ModelErrorLog()
        self._planned: tuple[BatchShape, float, str] | None = None
        self._recent_ratios: deque[float] = deque(maxlen=MARGIN_WINDOW_STEPS)  # measured / predicted
        self._margin = config.slo_margin

    @property
    def slo(self) -> SLO:
        return self.config.slo

    @staticmethod
    def _bucket(num_tokens: int) -> int:
        return min(max(num_tokens, 1).bit_length(), 12)

    def correction_for(self, num_tokens: int) -> float:
        bucket = self._corrections.get(self._bucket(num_tokens), self._overall_correction)
        return self._drift_factor() * bucket

    def _drift_factor(self) -> float:
        return self.latency_drift.factor if self.config.follow_drift else 1.0

    def observe_step(self, shape: BatchShape, duration_ms: float) -> None:
        planned, self._planned = self._planned, None
        if planned is not None and planned[0] == shape:
            self._observe_error(planned[2], planned[1], duration_ms)
        estimate = self.latency.estimate_ms(shape)
        if estimate <= 0 or duration_ms <= 0:
            return
        if self.riders.observe_step(shape, duration_ms):
            return
        ratio = min(4.0, max(0.25, duration_ms / (self._drift_factor() * estimate)))
        bucket = self._bucket(shape.num_tokens)
        self._corrections[bucket] = 0.9 * self._corrections.get(bucket, self._overall_correction) + 0.1 * ratio
        self._overall_correction = 0.9 * self._overall_correction + 0.1 * ratio

    def _observe_error(self, mode: str, predicted_ms: float, measured_ms: float) -> None:
        if self.model_error.observe(mode, predicted_ms, measured_ms) is None:
            return
        # The step was planned at _now_s and has just ended; the drift compares with a prediction that
        # carries its factor (applied or, with follow_drift off, only reported).
        unapplied = self.latency_drift.factor / self._drift_factor()
        self.latency_drift.observe(self._now_s + measured_ms / 1e3, unapplied * predicted_ms, measured_ms)
        if mode != "co-serving":
            return
        self._recent_ratios.append(measured_ms / predicted_ms)
        if self.config.adapt_margin and len(self._recent_ratios) >= MARGIN_MIN_STEPS:
            # Plan so that a step as far over its estimate as one in ten recent ones still meets the
            # budget (ConServe §4.5: the profile's error is what the margin is for).
            ratios = sorted(self._recent_ratios)
            p90 = ratios[min(len(ratios) - 1, int(0.9 * len(ratios)))]
            self._margin = min(self.config.slo_margin_max, max(MARGIN_MIN, 1.0 / p90))

    @property
    def slo_margin(self) -> float:
        """The share of the SLO budget steps are planned to: slo_margin, or adapted to the model's error."""
        return self._margin

    def _estimate_ms(self, shape: BatchShape) -> float:
        return self.correction_for(shape.num_tokens) * self.latency.estimate_ms(shape)

    def _budget_tokens(self, base: BatchShape, budget_ms: float, start_pos: int, limit: int) -> int:
        """Most tokens (<= limit) a chunk at start_pos can add to base within budget_ms, estimated
        with the correction of the resulting step's size."""
        return largest_chunk(self._estimate_ms, base, budget_ms, start_pos, limit)

    def _offline_step_budget_ms(self) -> float:
        """Longest offline-batching step whose stretches between safepoints meet the preemption target."""
        return self.config.preempt_target_ms * self.layout.num_layers / self.layout.longest_stretch_share

    def _offline_batch_tokens(self) -> int:
        # On a machine slower than its profile a batch of as many tokens runs past the preemption
        # target: the batch shrinks with the drift.
        factor = self._offline_tokens_factor = self._drift_factor()
        n = largest_chunk(lambda shape: factor * self.latency.estimate_ms(shape), BatchShape(),
                          self._offline_step_budget_ms(), 0, self.config.offline_batch_max_tokens)
        return max(1, n)

    def schedule(self, state: SchedulerState) -> StepPlan:
        self._now_s = state.now_s
        if abs(self._drift_factor() / self._offline_tokens_factor - 1.0) > 0.05:
            self._offline_tokens = self._offline_batch_tokens()
        if state.online:
            return self._co_serving(state)
        return self._offline_batching(state)

    # --- Algorithm 1: co-serving mode -----------------------------------------------------------

    def _budget_ms(self, state: SchedulerState) -> float:
        """The paper's per-step budget, already scaled by slo_margin (ConServe §4.5)."""
        cfg = self.config
        if any(s.running and not s.in_prefill for s in state.online):
            return self.slo_margin * cfg.slo.tpot_ms
        waited_ms = max((state.now_s - s.arrival_s) * 1e3 for s in state.online)
        # Never longer than a decode step's budget either: a request arriving during this step
        # waits for all of it, and in a burst such filled steps would stack up in its TTFT.
        return self.slo_margin * min(max(cfg.slo.ttft_ms - waited_ms, 0.0), cfg.slo.tpot_ms)

    def _banked_budget_ms(self, state: SchedulerState) -> float:
        """How long this step may take spending only what every decoding online request banked
        above the reserve for future prefills (see the module doc); at most bank_step_max_slos SLOs."""
        cfg = self.config
        target_tpot_ms = self.slo_margin * cfg.slo.tpot_ms
        decoding = [s for s in state.online if s.running and not s.in_prefill]
        if not decoding:
            return 0.0
        # After this step a request has n + 1 tokens; its TPOT so far is
        # (now + step - first token) / n, which must stay within the target.
        allowance = min(self._tpot_allowance_ms(s, state.now_s, target_tpot_ms) for s in decoding)
        return min(allowance - self._prefill_reserve_ms(), cfg.bank_step_max_slos * cfg.slo.tpot_ms)

    def _note_online_prompts(self, state: SchedulerState) -> None:
        for s in state.online:
            self._recent_online_prompts[s.seq_id] = s.num_prompt_tokens
            self._recent_online_prompts.move_to_end(s.seq_id)
        while len(self._recent_online_prompts) > 32:
            self._recent_online_prompts.popitem(last=False)

    def _prefill_reserve_ms(self) -> float:
        longest = max(self._recent_online_prompts.values(), default=0)
        if longest == 0 or self.config.bank_reserve_prefills == 0:
            return 0.0
        return self.config.bank_reserve_prefills * self._estimate_ms(BatchShape().plus(longest, 0))

    @staticmethod
    def _tpot_allowance_ms(seq: SeqView, now_s: float, target_tpot_ms: float) -> float:
        if seq.first_token_s is None or seq.num_output_tokens < 1:
            return target_tpot_ms
        decode_ms = (now_s - seq.first_token_s) * 1e3
        return target_tpot_ms * seq.num_output_tokens - decode_ms

    def _co_serving(self, state: SchedulerState) -> StepPlan:
        cfg = self.config
        self._note_online_prompts(state)
        limits = self.limits
        online = decode_first(state.online)
        offline = state.offline
        victims = None  # sorted only when an online request needs blocks: this runs every online step
        # Online work is never limited by the offline budget; only by the step's token cap.
        plan = PlanBuilder(state, max(limits.max_batch_tokens, self._offline_tokens),
                           limits.max_batch_seqs, limits.prefill_chunk_tokens)
        for seq in online:
            want = min(seq.num_pending_tokens, limits.prefill_chunk_tokens, plan.tokens_left)
            if state.blocks_for(seq, want) > plan.free_blocks_for(seq):
                if victims is None:
                    victims = recompute_cost_order([s for s in offline if s.running])
                plan.make_room(seq, want, victims)
            plan.add(seq)
        budget_ms = self._budget_ms(state)
        if cfg.interference_slack is not None:  # inf leaves the SLO budget as it is
            budget_ms = min(budget_ms, (1.0 + cfg.interference_slack) * self._estimate_ms(plan.shape))
        if cfg.bank_tpot_slack:
            budget_ms = max(budget_ms, self._banked_budget_ms(state))
        reserve = int(cfg.online_reserve_fraction * state.total_blocks)
        # Offline decodes added to the step drift with its online part, not with the (rarely seen)
        # bucket the mixed step lands in.
        correction = self.correction_for(plan.shape.num_tokens)
        online_shape = plan.shape
        # A restore copy is not in the latency model: checkpointed requests resume in offline batching.
        rideable = [s for s in offline if not s.needs_restore]
        decodes = [s for s in rideable if not s.in_prefill]
        self.riders.add(plan, [s for s in decodes if not s.suspended], state, budget_ms, correction, reserve)
        held = [s for s in decodes if s.suspended]
        if held and cfg.release_suspended:
            self.riders.release_suspended(state, plan, held, budget_ms, correction, reserve)
        if cfg.prefill_riders:
            # Algorithm 1: what the budget leaves after the decodes goes to offline prompt chunks,
            # oldest first (they finish first and free their blocks).
            prompts = [s for s in rideable if s.in_prefill and not s.suspended]
            share = None if cfg.prefill_cost_share == float("inf") else cfg.prefill_cost_share
            self.riders.add_prefill(plan, prompts, budget_ms, correction, reserve, self._offline_tokens, share)
        self.riders.planned(online_shape, plan.shape, correction)
        predicted_ms = self._estimate_ms(online_shape) + self.riders.added_ms(online_shape, plan.shape, correction)
        self._planned = (plan.shape, predicted_ms, "co-serving")
        return plan.plan(mode="co-serving", budget_ms=budget_ms)

    # --- Offline batching mode ------------------------------------------------------------------

    def _offline_batching(self, state: SchedulerState) -> StepPlan:
        cfg = self.config
        if any(s.suspended for s in state.offline):
            # The step an online arrival aborted: continuing it from its safepoint keeps the layers
            # it already ran instead of redoing them.
            self._planned = None  # a continued step is not timed whole
            return StepPlan(preemptible=True, mode="offline-batching", resume=True)
        # Prefills first: a decode step's fixed cost is spread over the requests decoding, so
        # admitting the waiting prompts at once beats giving each step to the few admitted decodes.
        offline = prefill_first(state.offline, state.now_s)   # HyGen: lines sharing a cached prefix together
        plan = PlanBuilder(state, self._offline_tokens, cfg.offline_batch_max_seqs, self._offline_tokens)
        step_budget_ms = self._offline_step_budget_ms()
        reserve = int(cfg.online_reserve_fraction * state.total_blocks)
        for seq in offline:
            if plan.tokens_left <= 0:
                break
            if not seq.running and plan.free_blocks_for(seq) - state.blocks_for(seq, 1) < reserve:
                continue
            if seq.running and state.blocks_for(seq, 1) > plan.free_blocks_for(seq):
                # A running offline request cannot grow: preempt the youngest other offline work.
                others = [s for s in reversed(offline) if s.running and s.seq_id != seq.seq_id
                          and s.arrival_s > seq.arrival_s]
                plan.make_room(seq, 1, recompute_cost_order(others))
            # Decode attention grows with context: long offline contexts get fewer tokens per step,
            # so the stretch between two safepoints still meets the preemption target.
            room = self._budget_tokens(plan.shape, step_budget_ms, seq.num_context_tokens,
                                       min(seq.num_pending_tokens, plan.tokens_left))
            if room <= 0:
                if plan.scheduled:
                    break
                room = 1  # the step must make progress even if one token is over the estimate
            plan.add(seq, token_cap=room)
        self._planned = (plan.shape, self._estimate_ms(plan.shape), "offline-batching")
        return plan.plan(preemptible=True, mode="offline-batching")

    # --- Algorithm 2: online arrival during a running step ---------------------------------------

    def should_abort_step(self, state: SchedulerState, step: RunningStep) -> bool:
        if not step.preemptible or not state.online:
            return False
        elapsed_ms = (state.now_s - step.started_s) * 1e3
        remain_ms = max(self._estimate_ms(step.shape) - elapsed_ms, 0.0)
        if step.layer_reached > 0:
            # The step's own pace so far (the LM head counted as one more layer): on a slowed machine
            # a step runs past its estimate, which would then say it is done.
            layers_left = self.layout.num_layers + 1 - step.layer_reached
            remain_ms = max(remain_ms, elapsed_ms * layers_left / step.layer_reached)
        online_shape = BatchShape()
        for seq in state.online:
            online_shape = online_shape.plus(seq.num_pending_tokens, seq.num_computed_tokens)
        exec_ms = self._estimate_ms(online_shape)
        waited_ms = max((state.now_s - s.arrival_s) * 1e3 for s in state.online)
        if self.config.interference_slack is not None and remain_ms > self.config.interference_slack * exec_ms:
            # The cap that bounds co-serving steps bounds the wait for offline work too: the paper's
            # rule (finish while the TTFT SLO holds) moves TTFTs up to the SLO.
            return True
        return remain_ms + exec_ms + waited_ms > self.slo_margin * self.config.slo.ttft_ms
