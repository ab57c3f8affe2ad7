"""The scheduler loop's mechanism: carry out a policy's StepPlan on the engine.

Each step: take new requests, show the policy a snapshot, preempt what it names (freeing
device blocks, keeping host checkpoints), restore checkpoints of resumed requests, run the
batch (abortable at layer safepoints when the plan allows), sample, stream, then checkpoint
what the checkpoint policy picks. An aborted step is kept, and continued from its safepoint
when a later plan says resume. Nothing here decides priority.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

import torch

from backfill.engine.kv_pool import HostBlocks
from backfill.engine.lora import LoraAdapter
from backfill.engine.runner import ModelRunner, SeqChunk, SuspendedStep
from backfill.engine.sampler import History, TokenLogprob, sample_picks
from backfill.errors import ContextLengthError, InvalidRequestError
from backfill.offload.pager import KVPager
from backfill.policy.checkpoint import AdaptiveCheckpointPolicy
from backfill.policy.interface import RunningStep, SchedulerState, SchedulingPolicy, SeqView, StepPlan
from backfill.policy.latency_model import BatchShape
from backfill.serving.api import FinishReason, GenerationRequest, RequestClass, TokenEvent
from backfill.serving.sequence import Detokenizer, HostCheckpoint, Sequence, SeqStatus


class PreemptionRecord(NamedTuple):
    """An offline step yielding to an online arrival (ConServe §4.3), with where the time went."""

    at_s: float             # monotonic time the step yielded
    latency_ms: float       # from the online arrival to the yield
    flag_ms: float          # from the arrival to the abort flag being set (the rest: finishing a layer)
    layer: int | None       # safepoint the step stopped at; None: it ran to its end (only the LM head was left)
    step_tokens: int        # tokens in the step that yielded


class StepRecord(NamedTuple):
    """One scheduler step, for finding where online latency went (the last few thousand are kept)."""

    at_s: float             # monotonic time the step started
    mode: str               # the plan's mode (co-serving, offline-batching, ...)
    online_tokens: int
    offline_tokens: int
    busy_ms: float          # the whole step: restores, the forward pass, sampling, checkpoints
    forward_ms: float       # the model's forward pass alone (to an abort, if aborted)
    aborted: bool


@dataclass
class Suspension:
    """An aborted step kept to be continued: valid while each of its sequences is exactly as it was
    (same computed tokens, same blocks); a cancel, preemption or reclamation in between voids it."""

    chunks: list[SeqChunk]
    shape: BatchShape
    step: SuspendedStep
    ran_s: float                               # forward time it had run before it was aborted
    state: dict[str, tuple[int, tuple[int, ...]]]  # seq id -> (computed tokens, block table)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class SchedulerStats:
    steps: int = 0
    aborted_steps: int = 0
    resumed_steps: int = 0              # aborted steps continued from their safepoint
    wasted_tokens: int = 0              # tokens of aborted steps that were redone instead
    wasted_forward_s: float = 0.0       # forward time those aborted steps had run
    preemption_events: list[PreemptionRecord] = field(default_factory=list)
    preempted_requests: int = 0         # requests taken off the device to free blocks
    checkpointed_tokens: int = 0
    checkpoint_bytes: int = 0
    restored_tokens: int = 0
    recomputed_tokens: int = 0
    output_tokens: dict[str, int] = field(default_factory=lambda: {"online": 0, "offline": 0})
    finished: dict[str, int] = field(default_factory=lambda: {"online": 0, "offline": 0})
    last_step_mode: str = "idle"
    busy_s: float = 0.0                 # in forward passes (runner.execute), aborted ones included
    # Per plan mode (co-serving, offline-batching, priority, ...): step time, checkpoint and
    # restore copies included, and the offline tokens its steps produced.
    mode_busy_s: dict[str, float] = field(default_factory=dict)
    mode_offline_tokens: dict[str, int] = field(default_factory=dict)
    step_log: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=20_000))

    @property
    def preemption_latencies_ms(self) -> list[float]:
        return [event.latency_ms for event in self.preemption_events]


class Scheduler:
    def __init__(self, runner: ModelRunner, policy: SchedulingPolicy, *,
                 checkpoint_policy: AdaptiveCheckpointPolicy | None = None,
                 detokenizer_factory: Callable[[], Detokenizer] | None = None,
                 eos_token_ids: tuple[int, ...] = (), max_model_len: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.runner = runner
        self.kv = runner.kv
        self.policy = policy
        self.checkpoint_policy = checkpoint_policy
        self.detokenizer_factory = detokenizer_factory
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = min(max_model_len or runner.config.max_position_embeddings,
                                 runner.config.max_position_embeddings)
        self.clock = clock
        self.stats = SchedulerStats()
        self.seqs: dict[str, Sequence] = {}
        self._inbox: deque[GenerationRequest] = deque()
        self._adapter_of: dict[str, LoraAdapter] = {}  # inbox requests' adapters, resolved on add
        self._cancels: deque[str] = deque()
        self._invalidated: deque[int] = deque()
        self._lock = threading.Lock()
        self._abort = threading.Event()
        self._abort_requested_s: float | None = None
        self._abort_flagged_s = 0.0
        self._current: RunningStep | None = None
        self._layer_reached = 0  # the running step's last safepoint (its progress, for Algorithm 2)
        self._suspended: Suspension | None = None
        # AQUA §7: swap space that preempted requests' KV is paged to and back (offload/pager.py).
        self.pager: KVPager | None = None

    # --- called from any thread ---------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        vocab = self.runner.config.vocab_size
        prompt = request.prompt_token_ids
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        total = len(prompt) + request.sampling.max_tokens
        if total > self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {total} were "
                f"requested ({len(prompt)} in the prompt, {request.sampling.max_tokens} to generate)")

    def add(self, request: GenerationRequest) -> None:
        self.validate(request)
        # Resolved now: an unknown name fails at submit, and unloading it later spares this request.
        adapter = self.runner.adapters.get(request.adapter) if request.adapter is not None else None
        with self._lock:
            if adapter is not None:
                self._adapter_of[request.request_id] = adapter
            self._inbox.append(request)
        if request.request_class is RequestClass.ONLINE:
            self._on_online_arrival()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancels.append(request_id)

    def invalidate_blocks(self, block_ids: list[int]) -> None:
        """Valve §4.3: these device blocks were reclaimed. A step using them is aborted at its next
        safepoint; their requests go back to waiting and recompute what has no host checkpoint."""
        with self._lock:
            self._invalidated.extend(block_ids)
        if self._current is not None:
            self._abort_requested_s = None
            self._abort.set()

    def has_work(self) -> bool:
        return bool(self.seqs or self._inbox or self._cancels or self._invalidated)

    def _on_online_arrival(self) -> None:
        """ConServe Algorithm 2: maybe abort the running step so the new request meets its TTFT."""
        step = self._current
        if step is None or not step.preemptible or self._abort.is_set():
            return
        now = self.clock()
        with self._lock:
            arrivals = [r for r in self._inbox if r.request_class is RequestClass.ONLINE]
        views = tuple(SeqView(r.request_id, r.request_class, r.arrival_time, len(r.prompt_token_ids),
                              len(r.prompt_token_ids), 0, 0, False, max_tokens=r.sampling.max_tokens)
                      for r in arrivals)
        state = SchedulerState(now, views, self.kv.num_free, self.kv.num_usable, self.kv.block_size,
                               self.max_model_len)
        if self.policy.should_abort_step(state, replace(step, layer_reached=self._layer_reached)):
            self._abort_requested_s = min(r.arrival_time for r in arrivals)
            self._abort_flagged_s = now
            self._abort.set()

    def _safepoint(self, layer: int) -> bool:
        self._layer_reached = layer
        if not self._abort.is_set():
            return False
        if self._abort_requested_s is not None:
            # Also inside the LM head: an aborted step is suspended and continued from here, and
            # a big batch's LM head is the longest stretch of its step.
            self._record_preemption(layer)
        return True

    def _record_preemption(self, layer: int | None) -> None:
        """The running step yields to an online arrival now (aborted, or done past its last layer)."""
        now, arrival = self.clock(), self._abort_requested_s
        step_tokens = self._current.shape.num_tokens if self._current is not None else 0
        self.stats.preemption_events.append(PreemptionRecord(
            now, (now - arrival) * 1e3, (self._abort_flagged_s - arrival) * 1e3, layer, step_tokens))
        self._abort_requested_s = None

    # --- the scheduler thread -----------------------------------------------------------------

    def snapshot(self) -> SchedulerState:
        suspension = self._suspended
        suspended = suspension.state if suspension is not None else {}
        views = tuple(self._view(s, seq_id in suspended) for seq_id, s in self.seqs.items())
        return SchedulerState(self.clock(), views, self.kv.num_free, self.kv.num_usable,
                              self.kv.block_size, self.max_model_len,
                              suspension.ran_s * 1e3 if suspension is not None else 0.0)

    @staticmethod
    def _view(s: Sequence, suspended: bool) -> SeqView:
        request = s.request
        return SeqView(request.request_id, request.request_class, request.arrival_time, len(s.prompt_ids),
                       s.num_tokens, s.num_computed, len(s.block_table), s.status is SeqStatus.RUNNING,
                       s.checkpoint.num_tokens, request.sampling.max_tokens, len(s.output_ids),
                       s.first_token_s, suspended)

    def step(self) -> list[TokenEvent]:
        events = self._take_inbox()
        self._apply_invalidations()
        if self._suspended is not None and not self._suspension_holds(self._suspended):
            self._drop_suspension()
        if not self.seqs:
            return events
        if self.pager is not None:  # a step boundary: elastic tensors may move now
            observe_swap = getattr(self.policy, "observe_swap", None)
            report = self.pager.at_step_boundary()
            if observe_swap is not None:
                observe_swap(report)
        plan = self.policy.schedule(self.snapshot())
        self.stats.last_step_mode = plan.mode
        online_tokens = sum(item.num_tokens for item in plan.scheduled
                            if self.seqs[item.seq_id].request_class is RequestClass.ONLINE)
        # A resumed step's tokens are the suspended step's (only offline steps are suspended).
        fed_tokens = self._suspended.num_tokens if plan.resume and self._suspended else plan.num_tokens
        started_s, started = self.clock(), time.perf_counter()
        offline_before, aborted_before = self.stats.output_tokens["offline"], self.stats.aborted_steps
        forward_before_s = self.stats.busy_s
        events += self._run_plan(plan)
        busy_s = time.perf_counter() - started
        busy, made = self.stats.mode_busy_s, self.stats.mode_offline_tokens
        busy[plan.mode] = busy.get(plan.mode, 0.0) + busy_s
        made[plan.mode] = made.get(plan.mode, 0) + self.stats.output_tokens["offline"] - offline_before
        self.stats.step_log.append(StepRecord(started_s, plan.mode, online_tokens, fed_tokens - online_tokens,
                                              busy_s * 1e3, (self.stats.busy_s - forward_before_s) * 1e3,
                                              self.stats.aborted_steps > aborted_before))
        return events

    def _run_plan(self, plan: StepPlan) -> list[TokenEvent]:
        if plan.resume:
            suspension, self._suspended = self._suspended, None
            if suspension is None:
                return []
            self.stats.resumed_steps += 1
            return self._execute(suspension.chunks, suspension.shape, plan, suspension)
        touched = set(plan.preempt) | {item.seq_id for item in plan.scheduled}
        if self._suspended is not None and touched & self._suspended.state.keys():
            self._drop_suspension()  # the plan reschedules its sequences: the step is redone
        for seq_id in plan.preempt:
            self._preempt(self.seqs[seq_id])
        chunks: list[SeqChunk] = []
        shape = BatchShape()
        for item in plan.scheduled:
            seq = self.seqs[item.seq_id]
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = self.clock()
            self._restore(seq)
            start = seq.num_computed
            self.kv.grow(seq.block_table, start + item.num_tokens)
            seq.status = SeqStatus.RUNNING
            chunks.append(SeqChunk(seq.seq_id, seq.token_slice(start, start + item.num_tokens), start,
                                   seq.block_table, want_logits=start + item.num_tokens == seq.num_tokens,
                                   adapter=seq.adapter))
            shape = shape.plus(item.num_tokens, start)
        if not chunks:
            return []
        return self._execute(chunks, shape, plan)

    def _execute(self, chunks: list[SeqChunk], shape: BatchShape, plan: StepPlan,
                 resume: Suspension | None = None) -> list[TokenEvent]:
        self._abort.clear()
        self._abort_requested_s = None
        ran_s = resume.ran_s if resume is not None else 0.0
        # A continued step started as long ago as it has run: Algorithm 2 estimates what is left.
        self._current = RunningStep(shape, self.clock() - ran_s, plan.preemptible)
        self._layer_reached = resume.step.partial.layer if resume is not None else 0
        if plan.preemptible:
            self._on_online_arrival()  # an arrival raced with planning
        started = time.perf_counter()
        out = self.runner.execute(chunks, self._safepoint if plan.preemptible else None,
                                  None if resume is None else resume.step)
        if self._abort_requested_s is not None and not out.aborted:
            self._record_preemption(None)
        self._current = None
        self.stats.busy_s += time.perf_counter() - started
        self.stats.steps += 1
        if not out.aborted and resume is None:
            self.policy.observe_step(shape, out.duration_s * 1e3)
        if out.aborted:
            # Nothing of the step is committed; its KV writes sit past num_computed. It is kept to
            # be continued where it stopped, or redone if its sequences change in between.
            self.stats.aborted_steps += 1
            if out.suspended is None:
                self.stats.wasted_tokens += out.num_tokens
                self.stats.wasted_forward_s += out.duration_s
            else:
                self._suspended = Suspension(chunks, shape, out.suspended, ran_s + out.duration_s,
                                             {c.seq_id: self._fingerprint(self.seqs[c.seq_id]) for c in chunks})
            return []
        offline_kv_grew = False
        for chunk in chunks:
            seq = self.seqs[chunk.seq_id]
            seq.num_computed += len(chunk.token_ids)
            offline_kv_grew |= seq.request_class is RequestClass.OFFLINE
        seqs = [self.seqs[i] for i in out.logit_seq_ids]
        picks = sample_picks(out.logits, [s.request.sampling for s in seqs], [s.generator for s in seqs],
                             [History(s.prompt_ids, s.output_ids) if s.request.sampling.penalized else None
                              for s in seqs], [s.request.constraint for s in seqs]) if seqs else []
        events = [self._append_token(seq, pick.token_id, pick.logprob) for seq, pick in zip(seqs, picks)]
        if offline_kv_grew:
            # Only a step that computed offline KV has any to copy; skipping the selection (a snapshot
            # of every sequence) keeps it out of online-only steps.
            self._checkpoint_selected()
        return events

    @staticmethod
    def _fingerprint(seq: Sequence) -> tuple[int, tuple[int, ...]]:
        return seq.num_computed, tuple(seq.block_table)

    def _suspension_holds(self, suspension: Suspension) -> bool:
        return all(seq_id in self.seqs and self._fingerprint(self.seqs[seq_id]) == state
                   for seq_id, state in suspension.state.items())

    def _drop_suspension(self) -> None:
        self.stats.wasted_tokens += self._suspended.num_tokens
        self.stats.wasted_forward_s += self._suspended.ran_s
        self._suspended = None

    # --- per-request bookkeeping --------------------------------------------------------------

    def _take_inbox(self) -> list[TokenEvent]:
        with self._lock:
            new, self._inbox = list(self._inbox), deque()
            cancels, self._cancels = list(self._cancels), deque()
            adapters, self._adapter_of = self._adapter_of, {}
        for request in new:
            detok = self.detokenizer_factory() if self.detokenizer_factory else None
            self.seqs[request.request_id] = Sequence(request, detok, adapters.get(request.request_id))
        events = []
        for request_id in cancels:
            seq = self.seqs.get(request_id)
            if seq is not None:
                events.append(self._finish(seq, FinishReason.CANCELLED))
        return events

    def _apply_invalidations(self) -> None:
        with self._lock:
            lost, self._invalidated = set(self._invalidated), deque()
        if not lost:
            return
        for seq in list(self.seqs.values()):
            if lost.intersection(seq.block_table):
                self._preempt(seq, save_tail=False)
        self.kv.retire([b for b in lost if not self.kv.is_allocated(b)])

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> TokenEvent:
        params = seq.request.sampling
        now = self.clock()
        if seq.first_token_s is None:
            seq.first_token_s = now
        seq.output_ids.append(token)
        self.stats.output_tokens[seq.request_class.value] += 1
        n_out = len(seq.output_ids)
        stop_ids = params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids)
        reason = None
        if token in stop_ids and n_out > params.min_tokens:
            reason = FinishReason.STOP
        else:
            before = len(seq.text)
            seq.append_text([token])
            cut = seq.find_stop_string(params.stop, len(seq.text) - before)
            if cut is not None:
                seq.text = seq.text[:cut]
                reason = FinishReason.STOP
        if reason is None and (n_out >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        logprobs = (logprob,) if logprob is not None else ()
        if reason is not None:
            return self._finish(seq, reason, (token,), logprobs)
        return TokenEvent(seq.seq_id, (token,), seq.take_text_delta(params.stop, final=False),
                          num_prompt_tokens=len(seq.prompt_ids), num_output_tokens=n_out, time=now,
                          logprobs=logprobs, scheduled_s=seq.first_scheduled_s if n_out == 1 else None)

    def _finish(self, seq: Sequence, reason: FinishReason, token_ids: tuple[int, ...] = (),
                logprobs: tuple[TokenLogprob, ...] = ()) -> TokenEvent:
        seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        if seq.block_table:
            self.kv.free(seq.block_table)
            seq.block_table = []
        seq.checkpoint = HostCheckpoint()
        if self.pager is not None:
            self.pager.discard(seq.seq_id)
        del self.seqs[seq.seq_id]
        if reason is not FinishReason.CANCELLED:
            self.stats.finished[seq.request_class.value] += 1
        return TokenEvent(seq.seq_id, token_ids, seq.take_text_delta(seq.request.sampling.stop, final=True),
                          finished=True, finish_reason=reason, num_prompt_tokens=len(seq.prompt_ids),
                          num_output_tokens=len(seq.output_ids), time=self.clock(), logprobs=logprobs,
                          scheduled_s=seq.first_scheduled_s if len(seq.output_ids) == 1 and token_ids else None)

    # --- preemption, checkpoint, restore (ConServe §4.4) ---------------------------------------

    def _preempt(self, seq: Sequence, *, save_tail: bool = True) -> None:
        """Free seq's device blocks; what has a host checkpoint is restored later, the rest recomputed.

        Checkpoints after steps hold whole blocks only; a request whose checkpoint is that far
        along gets its partial last block copied now (one block, while its KV is still valid:
        not after a reclamation took its blocks), so it resumes without recomputing anything.
        """
        if self.pager is not None and save_tail and seq.block_table and seq.num_computed > 0:
            # Paged out whole: nothing to recompute when it comes back.
            self.pager.page_out(seq.seq_id, self.kv, seq.block_table[:self.kv.blocks_needed(seq.num_computed)],
                                seq.num_computed)
            seq.checkpoint = HostCheckpoint()
        ckpt = seq.checkpoint
        if save_tail and seq.block_table and self._whole_block_tokens(seq) <= ckpt.num_tokens < seq.num_computed:
            self._copy_to_checkpoint(seq, seq.num_computed)
        keep = seq.num_computed if self.pager is not None and self.pager.holds(seq.seq_id) \
            else min(seq.num_computed, ckpt.num_tokens)
        lost = seq.num_computed - keep
        seq.num_recomputed_tokens += lost
        self.stats.recomputed_tokens += lost
        self.stats.preempted_requests += 1
        seq.num_preemptions += 1
        self.kv.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = keep
        seq.status = SeqStatus.WAITING

    def _restore(self, seq: Sequence) -> None:
        """Bring a preempted sequence's checkpointed KV back into fresh device blocks."""
        if seq.block_table or seq.num_computed == 0:
            return
        if self.pager is not None and self.pager.holds(seq.seq_id):
            seq.block_table = self.kv.allocate(self.pager.num_blocks(seq.seq_id))
            tokens = self.pager.page_in(seq.seq_id, self.kv, seq.block_table)
            seq.num_restored_tokens += tokens
            self.stats.restored_tokens += tokens
            return
        blocks = seq.checkpoint.blocks[: self.kv.blocks_needed(seq.num_computed)]
        seq.block_table = self.kv.allocate(len(blocks))
        data = torch.cat([b.data for b in blocks], dim=2)
        self.kv.copy_from_host(HostBlocks(data), seq.block_table, non_blocking=True)
        seq.num_restored_tokens += seq.num_computed
        self.stats.restored_tokens += seq.num_computed

    def _checkpoint_selected(self) -> None:
        if self.checkpoint_policy is None:
            return
        for seq_id in self.checkpoint_policy.select(self.snapshot()):
            self._checkpoint(self.seqs[seq_id])

    def _checkpoint(self, seq: Sequence) -> None:
        """Incremental: copy the blocks filled since the last checkpoint. A partial last block is
        left for _preempt: copying it again after every decode step would move a whole block per
        request per step, on CPU in the online requests' inter-token time."""
        whole_tokens = self._whole_block_tokens(seq)
        if whole_tokens > seq.checkpoint.num_tokens:
            self._copy_to_checkpoint(seq, whole_tokens)

    def _whole_block_tokens(self, seq: Sequence) -> int:
        """Computed tokens that fill whole KV blocks (the partial last block left out)."""
        return seq.num_computed // self.kv.block_size * self.kv.block_size

    def _copy_to_checkpoint(self, seq: Sequence, upto_tokens: int) -> None:
        ckpt = seq.checkpoint
        first = ckpt.num_tokens // self.kv.block_size
        last = self.kv.blocks_needed(upto_tokens)
        host = self.kv.copy_to_host(seq.block_table[first:last])
        del ckpt.blocks[first:]
        ckpt.blocks.extend(HostBlocks(host.data[:, :, i:i + 1]) for i in range(last - first))
        self.stats.checkpointed_tokens += upto_tokens - ckpt.num_tokens
        self.stats.checkpoint_bytes += host.nbytes
        ckpt.num_tokens = upto_tokens
