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
from typing import Callable

from backfill.engine.lora import LoraAdapter
from backfill.engine.prefix_cache import BlockHash, extend_hashes
from backfill.engine.runner import History, ModelRunner, TokenLogprob, sample_picks
from backfill.engine.step import SeqChunk, SuspendedStep
from backfill.errors import ContextLengthError, InvalidRequestError
from backfill.memory.pager import KVPager
from backfill.policy.checkpoint import AdaptiveCheckpointPolicy
from backfill.policy.interface import SchedulerState, SchedulingPolicy, SeqView, StepPlan
from backfill.policy.latency_model import BatchShape
from backfill.types import FinishReason, GenerationRequest, RequestClass, TokenEvent
from backfill.serving.preemption import REQUEST_PREEMPTED, STEP_ABORTED, RequestPreemption, StepPreemption
from backfill.serving.sequence import Detokenizer, Sequence, SeqStatus
from backfill.serving.stats import SchedulerStats

# Told (request id, kind, time) of each request a preemption touches, on the loop's thread.
PreemptionObserver = Callable[[str, str, float], None]


class Scheduler:
    def __init__(self, runner: ModelRunner, policy: SchedulingPolicy, *,
                 checkpoint_policy: AdaptiveCheckpointPolicy | None = None,
                 detokenizer_factory: Callable[[], Detokenizer] | None = None,
                 eos_token_ids: tuple[int, ...] = (), max_model_len: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.runner = runner
        self.kv = runner.kv
        self.detokenizer_factory = detokenizer_factory
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = min(max_model_len or runner.config.max_position_embeddings,
                                 runner.config.max_position_embeddings)
        self.stats = SchedulerStats()
        self.seqs: dict[str, Sequence] = {}
        self._inbox: deque[GenerationRequest] = deque()
        self._adapter_of: dict[str, LoraAdapter] = {}  # inbox requests' adapters, resolved on add
        self._cancels: deque[str] = deque()
        self._invalidated: deque[int] = deque()
        self._lock = threading.Lock()
        self.step_preemption = StepPreemption(policy, self.stats, clock)
        self.request_preemption = RequestPreemption(self.kv, self.stats, checkpoint_policy)
        # The server's traces record preemptions through these (server/tracing.py).
        self._preemption_observers: list[PreemptionObserver] = []

    # The step preemption consults the policy and reads the clock; a simulator swaps the clock in.
    @property
    def policy(self) -> SchedulingPolicy:
        return self.step_preemption.policy

    @policy.setter
    def policy(self, policy: SchedulingPolicy) -> None:
        self.step_preemption.policy = policy

    @property
    def clock(self) -> Callable[[], float]:
        return self.step_preemption.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.step_preemption.clock = clock

    @property
    def pager(self) -> KVPager | None:
        """AQUA §7: swap space that preempted requests' KV is paged to and back (memory/pager.py)."""
        return self.request_preemption.pager

    @pager.setter
    def pager(self, pager: KVPager | None) -> None:
        self.request_preemption.pager = pager

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
            self.step_preemption.on_online_arrival(self._arrivals)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancels.append(request_id)

    def invalidate_blocks(self, block_ids: list[int]) -> None:
        """Valve §4.3: these device blocks were reclaimed. A step using them is aborted at its next
        safepoint; their requests go back to waiting and recompute what has no host checkpoint."""
        with self._lock:
            self._invalidated.extend(block_ids)
        self.step_preemption.abort_for_reclamation()

    def has_work(self) -> bool:
        return bool(self.seqs or self._inbox or self._cancels or self._invalidated)

    def _arrivals(self) -> SchedulerState:
        """The online requests not yet taken from the inbox, as Algorithm 2 (ConServe §4.3) sees them."""
        now = self.clock()
        with self._lock:
            arrivals = [r for r in self._inbox if r.request_class is RequestClass.ONLINE]
        views = tuple(SeqView(r.request_id, r.request_class, r.arrival_time, len(r.prompt_token_ids),
                              len(r.prompt_token_ids), 0, 0, False, max_tokens=r.sampling.max_tokens)
                      for r in arrivals)
        return SchedulerState(now, views, self.kv.num_free, self.kv.num_usable, self.kv.block_size,
                              self.max_model_len, online_reused_free_blocks=self.kv.num_online_reused_free)

    # --- the scheduler thread -----------------------------------------------------------------

    def snapshot(self) -> SchedulerState:
        suspension = self.step_preemption.suspended
        suspended = suspension.kv_state if suspension is not None else {}
        views = tuple(s.view(seq_id in suspended, *self._prefix_state(s)) for seq_id, s in self.seqs.items())
        return SchedulerState(self.clock(), views, self.kv.num_free, self.kv.num_usable,
                              self.kv.block_size, self.max_model_len,
                              suspension.ran_s * 1e3 if suspension is not None else 0.0,
                              self.kv.num_online_reused_free)

    def step(self) -> list[TokenEvent]:
        events = self._take_inbox()
        self._apply_invalidations()
        self.step_preemption.drop_if_changed(self.seqs)
        if not self.seqs:
            return events
        self.request_preemption.at_step_boundary(self.policy)
        plan = self.policy.schedule(self.snapshot())
        self.stats.last_step_mode = plan.mode
        online_tokens = sum(item.num_tokens for item in plan.scheduled
                            if self.seqs[item.seq_id].request_class is RequestClass.ONLINE)
        # A resumed step's tokens are the suspended step's (only offline steps are suspended).
        suspended = self.step_preemption.suspended
        fed_tokens = suspended.num_tokens if plan.resume and suspended else plan.num_tokens
        started_s, started = self.clock(), time.perf_counter()
        before = self.stats.mark()
        events += self._run_plan(plan)
        self.stats.count_step(plan.mode, started_s, time.perf_counter() - started, online_tokens, fed_tokens, before)
        return events

    def _run_plan(self, plan: StepPlan) -> list[TokenEvent]:
        if plan.resume:
            suspension = self.step_preemption.take()
            if suspension is None:
                return []
            return self._execute(list(suspension.chunks), _shape_of(suspension.chunks), plan, suspension)
        touched = set(plan.preempt) | {item.seq_id for item in plan.scheduled}
        if touched & self.step_preemption.suspended_seq_ids():
            self.step_preemption.drop()  # the plan reschedules its sequences: the step is redone
        for seq_id in plan.preempt:
            self.request_preemption.preempt(self.seqs[seq_id])
            self._tell_preempted(seq_id, REQUEST_PREEMPTED)
        # Every request coming back to the device maps its cached prefix before any grows: an
        # allocation could otherwise evict blocks the plan counted on.
        for item in plan.scheduled:
            seq = self.seqs[item.seq_id]
            if not seq.block_table:
                self._map_cached_prefix(seq)
                self.request_preemption.restore(seq)
                self._register_full_blocks(seq)
        chunks: list[SeqChunk] = []
        shape = BatchShape()
        for item in plan.scheduled:
            seq = self.seqs[item.seq_id]
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = self.clock()
            start = seq.num_computed
            # A longer cached prefix than the plan saw starts the chunk later: it ends at the prompt's end.
            num = min(item.num_tokens, seq.num_tokens - start)
            self.kv.grow(seq.block_table, start + num)
            seq.status = SeqStatus.RUNNING
            chunks.append(SeqChunk(seq.seq_id, seq.token_slice(start, start + num), start,
                                   seq.block_table, want_logits=start + num == seq.num_tokens,
                                   adapter=seq.adapter, online=seq.is_online))
            shape = shape.plus(num, start)
        if not chunks:
            return []
        return self._execute(chunks, shape, plan)

    def _execute(self, chunks: list[SeqChunk], shape: BatchShape, plan: StepPlan,
                 resume: SuspendedStep | None = None) -> list[TokenEvent]:
        out = self.step_preemption.run(self.runner, chunks, shape, plan.preemptible, resume, self._arrivals)
        if not out.aborted and resume is None:
            self.policy.observe_step(shape, out.duration_s * 1e3)
        if out.aborted:
            for chunk in chunks:
                self._tell_preempted(chunk.seq_id, STEP_ABORTED)
            return []
        offline_kv_grew = False
        for chunk in chunks:
            seq = self.seqs[chunk.seq_id]
            seq.num_computed += len(chunk.token_ids)
            self._register_full_blocks(seq)
            offline_kv_grew |= seq.request_class is RequestClass.OFFLINE
        seqs = [self.seqs[i] for i in out.logit_seq_ids]
        picks = sample_picks(out.logits, [s.request.sampling for s in seqs], [s.generator for s in seqs],
                             [History(s.prompt_ids, s.output_ids) if s.request.sampling.penalized else None
                              for s in seqs], [s.request.constraint for s in seqs],
                             self.runner.device_sampler) if seqs else []
        events = [self._append_token(seq, pick.token_id, pick.logprob) for seq, pick in zip(seqs, picks)]
        if offline_kv_grew:
            # Only a step that computed offline KV has any to copy; skipping the selection (a snapshot
            # of every sequence) keeps it out of online-only steps.
            self.request_preemption.checkpoint_selected(self.snapshot, self.seqs)
        return events

    def add_preemption_observer(self, observer: PreemptionObserver) -> Callable[[], None]:
        """Tell observer of each request a preemption touches; returns the function that removes it."""
        self._preemption_observers.append(observer)

        def remove() -> None:
            if observer in self._preemption_observers:
                self._preemption_observers.remove(observer)
        return remove

    def _tell_preempted(self, seq_id: str, kind: str) -> None:
        if self._preemption_observers:
            now = self.clock()
            for observer in tuple(self._preemption_observers):
                observer(seq_id, kind, now)

    # --- prefix caching -----------------------------------------------------------------------

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The addresses of seq's first num_blocks full blocks (computed once per block)."""
        if len(seq.block_hashes) < num_blocks:
            bs = self.kv.block_size
            extend_hashes(seq.block_hashes, self.kv.hash_root, seq.token_slice(0, num_blocks * bs), bs,
                          num_blocks, seq.cache_key)
        return seq.block_hashes[:num_blocks]

    def _mappable_blocks(self, num_tokens: int) -> int:
        """Full blocks a hit may map: never the one holding the last token, which is computed so the
        step has logits to sample (and a shared block is never written)."""
        return (num_tokens - 1) // self.kv.block_size

    def _prefix_state(self, seq: Sequence) -> tuple[int, BlockHash | None]:
        """For the policy: the leading tokens the prefix cache holds now (a probe, for a request holding
        no blocks), and the address of the next full prompt block it would compute (None: none)."""
        if not self.kv.prefix_caching:
            return 0, None
        mappable = self._mappable_blocks(seq.num_tokens)
        if seq.block_table:
            if seq.num_computed >= len(seq.prompt_ids):
                return 0, None
            at = seq.num_computed // self.kv.block_size
            return 0, self._block_hashes(seq, mappable)[at] if at < mappable else None
        hashes = self._block_hashes(seq, mappable)
        cached = len(self.kv.cached_blocks(hashes))
        return cached * self.kv.block_size, hashes[cached] if cached < mappable else None

    def cached_prompt_tokens(self, request: GenerationRequest) -> int:
        """The leading prompt tokens of a request not yet added that the prefix cache holds now (a probe
        that takes nothing; the blocks may be evicted before the request is scheduled)."""
        if not self.kv.prefix_caching:
            return 0
        prompt, bs = request.prompt_token_ids, self.kv.block_size
        mappable = self._mappable_blocks(len(prompt))
        if mappable <= 0:
            return 0
        adapter = self.runner.adapters.get(request.adapter) if request.adapter is not None else None
        hashes: list[BlockHash] = []
        extend_hashes(hashes, self.kv.hash_root, list(prompt[:mappable * bs]), bs, mappable,
                      adapter.cache_key if adapter is not None else "")
        return len(self.kv.cached_blocks(hashes)) * bs

    def _map_cached_prefix(self, seq: Sequence) -> None:
        """Put the cached run of seq's leading blocks in its (empty) block table; the first time, count
        the lookup in prompt tokens (vLLM's prefix_cache_queries / prefix_cache_hits)."""
        if not self.kv.prefix_caching:
            return
        seq.block_table = self.kv.take_cached(self._block_hashes(seq, self._mappable_blocks(seq.num_tokens)), seq.is_online)
        seq.num_registered_blocks = len(seq.block_table)
        if not seq.prefix_looked_up:
            seq.prefix_looked_up = True
            cls = seq.request_class.value
            seq.num_cached_tokens = min(len(seq.block_table) * self.kv.block_size, len(seq.prompt_ids))
            self.stats.prefix_cache_queries[cls] += len(seq.prompt_ids)
            self.stats.prefix_cache_hits[cls] += seq.num_cached_tokens

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Register seq's newly filled blocks under their addresses: later prompts may map them."""
        full = seq.num_computed // self.kv.block_size
        if not self.kv.prefix_caching or full <= seq.num_registered_blocks:
            return
        hashes = self._block_hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.kv.register(seq.block_table[i], hashes[i], seq.is_online)
        seq.num_registered_blocks = full

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
                self.request_preemption.preempt(seq, save_tail=False)
                self._tell_preempted(seq.seq_id, REQUEST_PREEMPTED)
        self.kv.retire([b for b in lost if not self.kv.is_allocated(b)])

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> TokenEvent:
        now = self.clock()
        reason = seq.append_token(token, now, self.eos_token_ids, self.max_model_len)
        self.stats.output_tokens[seq.request_class.value] += 1
        logprobs = (logprob,) if logprob is not None else ()
        if reason is not None:
            return self._finish(seq, reason, (token,), logprobs)
        return TokenEvent(seq.seq_id, (token,), seq.take_text_delta(seq.request.sampling.stop, final=False),
                          num_prompt_tokens=len(seq.prompt_ids), num_output_tokens=len(seq.output_ids), time=now,
                          logprobs=logprobs, num_cached_tokens=seq.num_cached_tokens,
                          scheduled_s=seq.first_scheduled_s if len(seq.output_ids) == 1 else None)

    def _finish(self, seq: Sequence, reason: FinishReason, token_ids: tuple[int, ...] = (),
                logprobs: tuple[TokenLogprob, ...] = ()) -> TokenEvent:
        seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        if seq.block_table:
            self.kv.free(seq.block_table)
            seq.block_table = []
        self.request_preemption.discard(seq)
        del self.seqs[seq.seq_id]
        if reason is not FinishReason.CANCELLED:
            self.stats.finished[seq.request_class.value] += 1
        return TokenEvent(seq.seq_id, token_ids, seq.take_text_delta(seq.request.sampling.stop, final=True),
                          finished=True, finish_reason=reason, num_prompt_tokens=len(seq.prompt_ids),
                          num_output_tokens=len(seq.output_ids), time=self.clock(), logprobs=logprobs,
                          num_cached_tokens=seq.num_cached_tokens,
                          scheduled_s=seq.first_scheduled_s if len(seq.output_ids) == 1 and token_ids else None)


def _shape_of(chunks: tuple[SeqChunk, ...]) -> BatchShape:
    shape = BatchShape()
    for chunk in chunks:
        shape = shape.plus(len(chunk.token_ids), chunk.start_pos)
    return shape
