"""The scheduler's two kinds of preemption, as mechanism: the policy decides, these carry it out.

StepPreemption (ConServe §4.3): a running offline step is aborted at its next layer safepoint
when the policy's Algorithm 2 says an online arrival cannot wait for it, and the aborted step is
kept (a SuspendedStep) to be continued from there.

RequestPreemption (ConServe §4.4): a request taken off the device to free its KV blocks keeps
what has a host checkpoint (or what the pager holds, AQUA §7) and recomputes the rest; the
checkpoint policy picks which requests get incremental host copies after each step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Callable

import torch

from backfill.engine.kv_pool import HostBlocks, KVBlockPool
from backfill.engine.runner import ModelRunner, StepOutput
from backfill.engine.step import SeqChunk
from backfill.engine.step import SuspendedStep, kv_fingerprint
from backfill.memory.pager import KVPager
from backfill.policy.checkpoint import AdaptiveCheckpointPolicy
from backfill.policy.interface import RunningStep, SchedulerState, SchedulingPolicy
from backfill.policy.latency_model import BatchShape
from backfill.serving.sequence import HostCheckpoint, Sequence, SeqStatus
from backfill.serving.stats import PreemptionRecord, SchedulerStats

# What a preemption did to a request, as the scheduler tells its preemption observers.
STEP_ABORTED = "step_aborted"            # ConServe §4.3: a step carrying it yielded at a safepoint
REQUEST_PREEMPTED = "request_preempted"  # ConServe §4.4: its KV blocks were freed


class StepPreemption:
    """Runs steps abortably and keeps the one an arrival aborted (ConServe §4.3, Algorithm 2)."""

    def __init__(self, policy: SchedulingPolicy, stats: SchedulerStats, clock: Callable[[], float]) -> None:
        self.policy = policy
        self.stats = stats
        self.clock = clock
        self.abort = threading.Event()
        self.requested_s: float | None = None  # arrival of the online request the step yields to
        self.flagged_s = 0.0                    # when the abort flag was set for it
        self.running: RunningStep | None = None
        self.layer_reached = 0  # the running step's last safepoint (its progress, for Algorithm 2)
        self.suspended: SuspendedStep | None = None

    # --- called from any thread ---------------------------------------------------------------

    def on_online_arrival(self, arrivals: Callable[[], SchedulerState]) -> None:
        """Maybe abort the running step so the new request meets its TTFT; arrivals() is the snapshot
        of the online requests waiting, built only when the running step could be aborted."""
        step = self.running
        if step is None or not step.preemptible or self.abort.is_set():
            return
        state = arrivals()
        if self.policy.should_abort_step(state, replace(step, layer_reached=self.layer_reached)):
            self.requested_s = min(s.arrival_s for s in state.seqs)
            self.flagged_s = state.now_s
            self.abort.set()

    def abort_for_reclamation(self) -> None:
        """Valve §4.3: blocks the running step may use were reclaimed; stop it at its next safepoint."""
        if self.running is not None:
            self.requested_s = None
            self.abort.set()

    # --- the scheduler thread -----------------------------------------------------------------

    def safepoint(self, layer: int) -> bool:
        self.layer_reached = layer
        if not self.abort.is_set():
            return False
        if self.requested_s is not None:
            # Also inside the LM head: an aborted step is suspended and continued from here, and
            # a big batch's LM head is the longest stretch of its step.
            self._record(layer)
        return True

    def _record(self, layer: int | None) -> None:
        """The running step yields to an online arrival now (aborted, or done past its last layer)."""
        now, arrival = self.clock(), self.requested_s
        step_tokens = self.running.shape.num_tokens if self.running is not None else 0
        self.stats.record_preemption(PreemptionRecord(
            now, (now - arrival) * 1e3, (self.flagged_s - arrival) * 1e3, layer, step_tokens))
        self.requested_s = None

    def run(self, runner: ModelRunner, chunks: list[SeqChunk], shape: BatchShape, preemptible: bool,
            resume: SuspendedStep | None, arrivals: Callable[[], SchedulerState]) -> StepOutput:
        """Execute one step, abortable at safepoints when preemptible; with resume, continue that step."""
        self.abort.clear()
        self.requested_s = None
        ran_s = resume.ran_s if resume is not None else 0.0
        # A continued step started as long ago as it has run: Algorithm 2 estimates what is left.
        self.running = RunningStep(shape, self.clock() - ran_s, preemptible)
        self.layer_reached = resume.layer if resume is not None else 0
        if preemptible:
            self.on_online_arrival(arrivals)  # an arrival raced with planning
        started = time.perf_counter()
        out = runner.execute(chunks, self.safepoint if preemptible else None, resume)
        if self.requested_s is not None and not out.aborted:
            self._record(None)
        self.running = None
        self.stats.busy_s += time.perf_counter() - started
        self.stats.steps += 1
        if out.aborted:
            # Nothing of the step is committed; its KV writes sit past num_computed. It is kept to
            # be continued where it stopped, or redone if its sequences change in between.
            self.stats.aborted_steps += 1
            if out.suspended is None:
                self.stats.wasted_tokens += out.num_tokens
                self.stats.wasted_forward_s += out.duration_s
            else:
                self.suspended = out.suspended
        return out

    def suspended_seq_ids(self) -> set[int | str]:
        return set(self.suspended.kv_state) if self.suspended is not None else set()

    def drop_if_changed(self, seqs: dict[str, Sequence]) -> None:
        """Give the suspended step up if any of its sequences moved on, was preempted or is gone."""
        step = self.suspended
        if step is not None and not step.holds_for({seq_id: kv_fingerprint(seqs[seq_id].num_computed,
                                                                             seqs[seq_id].block_table)
                                                    for seq_id in step.kv_state if seq_id in seqs}):
            self.drop()

    def drop(self) -> None:
        """The suspended step will be redone instead of continued: what it had run is wasted."""
        self.stats.wasted_tokens += self.suspended.num_tokens
        self.stats.wasted_forward_s += self.suspended.ran_s
        self.suspended = None

    def take(self) -> SuspendedStep | None:
        """The suspended step, to continue now (a plan said resume)."""
        step, self.suspended = self.suspended, None
        if step is not None:
            self.stats.resumed_steps += 1
        return step


class RequestPreemption:
    """Takes requests off the device and brings them back, checkpointing KV to the host (ConServe §4.4)."""

    def __init__(self, kv: KVBlockPool, stats: SchedulerStats,
                 checkpoint_policy: AdaptiveCheckpointPolicy | None = None) -> None:
        self.kv = kv
        self.stats = stats
        self.checkpoint_policy = checkpoint_policy
        # AQUA §7: swap space that preempted requests' KV is paged to and back (memory/pager.py).
        self.pager: KVPager | None = None

    def at_step_boundary(self, policy: SchedulingPolicy) -> None:
        """AQUA §7: elastic tensors may move between steps; a policy that watches swapping is told."""
        if self.pager is None:
            return
        policy.observe_swap(self.pager.at_step_boundary())

    def preempt(self, seq: Sequence, *, save_tail: bool = True) -> None:
        """Free seq's device blocks; what has a host checkpoint is restored later, the rest recomputed.

        Checkpoints after steps hold whole blocks only; a request whose checkpoint is that far
        along gets its partial last block copied now (one block, while its KV is still valid:
        not after a reclamation took its blocks), so it resumes without recomputing anything.
        """
        if self.pager is not None and save_tail and seq.block_table and seq.num_computed > 0:
            # Paged out whole but for its leading shared blocks (AQUA §7 pages a shared block once: it
            # stays cached while another request maps it): nothing to recompute when it comes back.
            table = seq.block_table[:self.kv.blocks_needed(seq.num_computed)]
            shared = 0
            while shared < len(table) and self.kv.ref_count(table[shared]) > 1:
                shared += 1
            if shared < len(table):
                self.pager.page_out(seq.seq_id, self.kv, table[shared:], seq.num_computed, first_block=shared)
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
        self.kv.free(seq.block_table)  # its cached full blocks stay findable until evicted
        seq.block_table = []
        seq.num_registered_blocks = 0
        seq.num_computed = keep
        seq.status = SeqStatus.WAITING

    def restore(self, seq: Sequence) -> None:
        """Bring a preempted sequence's KV back. Its block table holds what the prefix cache still
        had of its leading blocks (shared ones re-found, not copied); the pager or the host
        checkpoint supplies the rest, and what neither holds is recomputed."""
        mapped_tokens = len(seq.block_table) * self.kv.block_size
        paged = self.pager is not None and self.pager.holds(seq.seq_id)
        if seq.num_computed <= mapped_tokens:
            if paged:
                self.pager.discard(seq.seq_id)   # the cache had all of it
            seq.num_computed = mapped_tokens
            return
        if paged:
            first = self.pager.first_block(seq.seq_id)
            if len(seq.block_table) >= first:
                # The shared leading blocks were found again; the page goes back after them, into
                # blocks of its own (what else the cache holds of it is not mapped twice).
                self.kv.free(seq.block_table[first:])
                seq.block_table = seq.block_table[:first] + self.kv.allocate(self.pager.num_blocks(seq.seq_id))
                seq.num_registered_blocks = first
                tokens = self.pager.page_in(seq.seq_id, self.kv, seq.block_table[first:]) - first * self.kv.block_size
                seq.num_restored_tokens += tokens
                self.stats.restored_tokens += tokens
                return
            # A shared block was evicted since: the page cannot follow the gap, so recompute from it.
            self.pager.discard(seq.seq_id)
            lost = seq.num_computed - mapped_tokens
            seq.num_recomputed_tokens += lost
            self.stats.recomputed_tokens += lost
            seq.num_computed = mapped_tokens
            return
        first = len(seq.block_table)
        wanted = seq.checkpoint.blocks[first:self.kv.blocks_needed(seq.num_computed)]
        copies = []
        for block in wanted:
            if block is None:   # shared when checkpointed and evicted since: recomputed from here
                break
            copies.append(block)
        if len(copies) < len(wanted):
            kept = (first + len(copies)) * self.kv.block_size
            seq.num_recomputed_tokens += seq.num_computed - kept
            self.stats.recomputed_tokens += seq.num_computed - kept
            seq.num_computed = kept
        if copies:
            fresh = self.kv.allocate(len(copies))
            data = torch.cat([b.data for b in copies], dim=2)
            self.kv.copy_from_host(HostBlocks(data), fresh, non_blocking=True)
            seq.block_table.extend(fresh)
        restored = max(0, seq.num_computed - mapped_tokens)
        seq.num_restored_tokens += restored
        self.stats.restored_tokens += restored

    def discard(self, seq: Sequence) -> None:
        """seq finished: drop its host copies."""
        seq.checkpoint = HostCheckpoint()
        if self.pager is not None:
            self.pager.discard(seq.seq_id)

    def checkpoint_selected(self, snapshot: Callable[[], SchedulerState], seqs: dict[str, Sequence]) -> None:
        if self.checkpoint_policy is None:
            return
        for seq_id in self.checkpoint_policy.select(snapshot()):
            self._checkpoint(seqs[seq_id])

    def _checkpoint(self, seq: Sequence) -> None:
        """Incremental: copy the blocks filled since the last checkpoint. A partial last block is
        left for preempt: copying it again after every decode step would move a whole block per
        request per step, on CPU in the online requests' inter-token time."""
        whole_tokens = self._whole_block_tokens(seq)
        if whole_tokens > seq.checkpoint.num_tokens:
            self._copy_to_checkpoint(seq, whole_tokens)

    def _whole_block_tokens(self, seq: Sequence) -> int:
        """Computed tokens that fill whole KV blocks (the partial last block left out)."""
        return seq.num_computed // self.kv.block_size * self.kv.block_size

    def _copy_to_checkpoint(self, seq: Sequence, upto_tokens: int) -> None:
        """Copy seq's blocks up to upto_tokens to the host, but for blocks other requests share now:
        those stay cached while anyone maps them, and are re-found on restore."""
        ckpt = seq.checkpoint
        first = ckpt.num_tokens // self.kv.block_size
        last = self.kv.blocks_needed(upto_tokens)
        ids = seq.block_table[first:last]
        own = [i for i, block in enumerate(ids) if self.kv.ref_count(block) == 1]
        del ckpt.blocks[first:]
        ckpt.blocks.extend([None] * len(ids))
        if own:
            host = self.kv.copy_to_host([ids[i] for i in own])
            for n, i in enumerate(own):
                ckpt.blocks[first + i] = HostBlocks(host.data[:, :, n:n + 1])
            self.stats.checkpoint_bytes += host.nbytes
        self.stats.checkpointed_tokens += upto_tokens - ckpt.num_tokens
        ckpt.num_tokens = upto_tokens
