"""Shared bookkeeping for building a StepPlan: token/seq limits and free blocks.

Every policy fills a batch the same way (decodes take one token, prefills take chunks, each
needs blocks); they differ only in order, budgets and who may be preempted.
"""

from __future__ import annotations

from dataclasses import dataclass

from backfill.errors import InvalidRequestError
from backfill.policy.latency_model import BatchShape
from backfill.policy.interface import Scheduled, SchedulerState, SeqView, StepPlan


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int = 512     # tokens per step in normal (co-serving) operation
    max_batch_seqs: int = 64
    prefill_chunk_tokens: int = 512  # longest prefill chunk of one sequence in one step

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_batch_seqs", "prefill_chunk_tokens"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")


# Echo: offline allocations leave alone the free blocks holding prefixes online requests found cached,
# up to this share of the pool (beyond it, the least recently used of them are fair game, so online
# chats of many distinct histories cannot hold offline work off the whole pool).
ONLINE_CACHE_PROTECTED_SHARE = 0.5


class PlanBuilder:
    def __init__(self, state: SchedulerState, max_tokens: int, max_seqs: int, chunk_tokens: int) -> None:
        self.state = state
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.chunk_tokens = chunk_tokens
        self.free_blocks = state.free_blocks
        # Of free_blocks, those offline allocations may not take (the pool evicts them last: an online
        # allocation takes every other free block first).
        self.protected_blocks = min(state.online_reused_free_blocks, state.free_blocks,
                                    int(ONLINE_CACHE_PROTECTED_SHARE * state.total_blocks))
        # A lone running offline request may take them: with no other offline request to preempt for
        # its blocks, it could otherwise wait for ever.
        running_offline = [s.seq_id for s in state.seqs if s.running and not s.is_online]
        self._offline_progress_id = running_offline[0] if len(running_offline) == 1 else None
        self.scheduled: list[Scheduled] = []
        self.scheduled_ids: set[str] = set()
        self.preempted: list[str] = []
        self.tokens = 0
        self.shape = BatchShape()
        # Per scheduled entry: its blocks, the protected blocks among them, the shape before it.
        self._undo: list[tuple[int, int, BatchShape]] = []
        # Next prompt blocks being computed, by address: by prompts of this plan, and by prompts already
        # on the device (a suspended step's, or one the budget leaves out of this step).
        self._planned_keys: dict[bytes, str] = {}
        self._device_prompts = [s for s in state.seqs if s.next_block_key is not None and s.running]
        self._device_keys = self._keys_on_device()

    @property
    def tokens_left(self) -> int:
        return self.max_tokens - self.tokens

    def free_blocks_for(self, seq: SeqView) -> int:
        """The free blocks seq's allocations may take: all for an online request (and a lone running
        offline one), none of the protected online prefix blocks for other offline requests."""
        if seq.is_online or seq.seq_id == self._offline_progress_id:
            return self.free_blocks
        return max(0, self.free_blocks - self.protected_blocks)

    def add(self, seq: SeqView, token_cap: int | None = None) -> int:
        """Schedule as many of seq's pending tokens as limits and free blocks allow; return the count."""
        if seq.seq_id in self.scheduled_ids or seq.seq_id in self.preempted or len(self.scheduled) >= self.max_seqs:
            return 0
        key = seq.next_block_key
        # HyGen: a prompt whose next block another prompt computes (in this step, or one on the device)
        # waits and maps it from the prefix cache instead of computing it twice; an online prompt
        # waits for an online one only, as the policy may advance an offline prompt slowly.
        if key is not None and not seq.running and (
                key in self._planned_keys
                or (key in self._device_keys and (self._device_keys[key] or not seq.is_online))):
            return 0
        n = min(seq.num_pending_tokens, self.chunk_tokens, self.tokens_left)
        if token_cap is not None:
            n = min(n, token_cap)
        # Never schedule past the context: the mechanism finishes such sequences.
        n = min(n, self.state.max_model_len - seq.num_context_tokens)
        fits = (seq.num_blocks + self.free_blocks_for(seq)) * self.state.block_size - seq.num_context_tokens
        n = min(n, fits)
        if n <= 0:
            return 0
        blocks = self.state.blocks_for(seq, n)
        # The pool hands out unprotected blocks first: only what goes beyond them eats the protected.
        protected_taken = max(0, blocks - (self.free_blocks - self.protected_blocks))
        self.free_blocks -= blocks
        self.protected_blocks -= protected_taken
        self.scheduled.append(Scheduled(seq.seq_id, n))
        self._undo.append((blocks, protected_taken, self.shape))
        self.scheduled_ids.add(seq.seq_id)
        self.tokens += n
        self.shape = self.shape.plus(n, seq.num_context_tokens)
        if key is not None:
            self._planned_keys.setdefault(key, seq.seq_id)
        return n

    def mark(self) -> int:
        """A point to roll back to: how many sequences are scheduled so far."""
        return len(self.scheduled)

    def rollback(self, mark: int) -> None:
        """Unschedule every sequence added since mark (preemptions stay)."""
        if mark >= len(self.scheduled):
            return
        for item, (blocks, protected_taken, _) in zip(self.scheduled[mark:], self._undo[mark:]):
            self.free_blocks += blocks
            self.protected_blocks += protected_taken
            self.scheduled_ids.discard(item.seq_id)
            self.tokens -= item.num_tokens
        self._planned_keys = {k: v for k, v in self._planned_keys.items() if v in self.scheduled_ids}
        self.shape = self._undo[mark][2]
        del self.scheduled[mark:], self._undo[mark:]

    def preempt(self, seq: SeqView) -> None:
        """Take seq off the device before the step; its blocks become free for this plan."""
        if seq.seq_id in self.scheduled_ids or seq.seq_id in self.preempted or not seq.running:
            return
        self.preempted.append(seq.seq_id)
        self.free_blocks += seq.num_blocks
        if seq.next_block_key is not None:   # it no longer computes its prompt's next block
            self._device_keys = self._keys_on_device()

    def _keys_on_device(self) -> dict[bytes, bool]:
        """The next prompt block of each prompt on the device (not preempted by this plan), by address:
        whether an online prompt computes it."""
        keys: dict[bytes, bool] = {}
        for s in self._device_prompts:
            if s.seq_id not in self.preempted:
                keys[s.next_block_key] = keys.get(s.next_block_key, False) or s.is_online
        return keys

    def make_room(self, seq: SeqView, n: int, victims: list[SeqView]) -> None:
        """Preempt victims (in order) until seq's next n tokens fit in free blocks."""
        for victim in victims:
            if self.state.blocks_for(seq, min(n, seq.num_pending_tokens)) <= self.free_blocks_for(seq):
                return
            self.preempt(victim)

    def plan(self, *, preemptible: bool = False, mode: str = "", **info) -> StepPlan:
        return StepPlan(tuple(self.scheduled), tuple(self.preempted), preemptible, mode, info)


def decode_first(seqs: list[SeqView]) -> list[SeqView]:
    """Running decodes (cheap, latency-visible) before prefills, each group by arrival."""
    return sorted(seqs, key=lambda s: (s.in_prefill or not s.running, s.arrival_s))


# HyGen's prefix-sharing order waits a prompt at most this long behind later ones that find their
# prefix cached: after that it goes by arrival again, so no line starves.
PREFIX_GROUP_MAX_WAIT_S = 30.0


def prefill_first(seqs: list[SeqView], now_s: float | None = None,
                  max_wait_s: float = PREFIX_GROUP_MAX_WAIT_S) -> list[SeqView]:
    """Requests waiting for (the rest of) their prompt before running decodes, each group by arrival.

    Given now_s, prompts not yet started go in HyGen's prefix-sharing order: those that waited
    max_wait_s first, by arrival; then the longest cached prefix first (lines sharing a prefix run
    together while its blocks are cached, before an eviction makes the next group recompute it).
    """
    if now_s is None:
        return sorted(seqs, key=lambda s: (s.running and not s.in_prefill, s.arrival_s))

    def key(s: SeqView) -> tuple:
        if s.running or s.num_computed_tokens or now_s - s.arrival_s >= max_wait_s:
            return (s.running and not s.in_prefill, 0, 0, s.arrival_s)
        return (False, 1, -s.num_cached_tokens, s.arrival_s)

    return sorted(seqs, key=key)


def recompute_cost_order(victims: list[SeqView]) -> list[SeqView]:
    """Victims whose KV is already on the host first (free to drop), then the youngest."""
    return sorted(victims, key=lambda s: (s.num_computed_tokens - s.num_checkpointed_tokens, -s.arrival_s))
