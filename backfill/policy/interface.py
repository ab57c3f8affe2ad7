"""The contract between the scheduler and its policies (as vLLM v1's sched/interface.py).

A policy sees a snapshot (SchedulerState of SeqViews) and returns a StepPlan; while a step runs,
it may be asked whether to abort it (ConServe §4.3 Algorithm 2, given the RunningStep) and it is
told how long each step took. Policies never touch tensors or the engine: the same objects drive
the real scheduler, unit tests on hand-built states, and the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from backfill.engine.config import SafepointLayout
from backfill.policy.latency_model import BatchShape, LatencyModel
from backfill.types import SLO, RequestClass

if TYPE_CHECKING:
    from backfill.memory.pager import SwapReport
    from backfill.policy.drift import LatencyDrift
    from backfill.policy.model_error import ModelErrorLog

__all__ = ["RunningStep", "SafepointLayout", "Scheduled", "SchedulerState", "SchedulingPolicy", "SeqView",
           "StepPlan"]


class SeqView(NamedTuple):
    """One request as the policy sees it.

    A named tuple, not a frozen dataclass: the scheduler builds one per request for every step's
    snapshot, and a named tuple is several times cheaper to build.
    """

    seq_id: str
    request_class: RequestClass
    arrival_s: float
    num_prompt_tokens: int
    num_tokens: int              # prompt + output so far
    num_computed_tokens: int     # tokens whose KV is valid on the device
    num_blocks: int              # device blocks held now
    running: bool                # holds device blocks (was scheduled before and not preempted)
    num_checkpointed_tokens: int = 0  # tokens whose KV has a host copy
    max_tokens: int = 16
    num_output_tokens: int = 0
    first_token_s: float | None = None  # when its first output token was sampled (scheduler clock)
    suspended: bool = False      # its tokens are in an aborted step the scheduler can continue
    # Holding no blocks: the leading tokens whose KV the prefix cache holds (mapped, not computed,
    # when it is next scheduled; always short of its last token).
    num_cached_tokens: int = 0
    # The content address of the next full prompt block it would compute (None: no such block, or
    # prefix caching is off): two prompts with the same one would compute the same KV twice.
    next_block_key: bytes | None = None

    @property
    def is_online(self) -> bool:
        return self.request_class is RequestClass.ONLINE

    @property
    def num_context_tokens(self) -> int:
        """Tokens whose KV the next step finds: computed, or mapped from the prefix cache."""
        return max(self.num_computed_tokens, self.num_cached_tokens)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens to feed before the next sample: 1 when decoding, more while (re)prefilling; a
        prompt's cached prefix is not fed (the latency model is charged only the rest)."""
        return self.num_tokens - self.num_context_tokens

    @property
    def needs_restore(self) -> bool:
        """Preempted with a host checkpoint: its KV is copied back before it runs again."""
        return not self.running and self.num_computed_tokens > 0

    @property
    def in_prefill(self) -> bool:
        return self.num_pending_tokens > 1


@dataclass(frozen=True)
class SchedulerState:
    now_s: float
    seqs: tuple[SeqView, ...]
    free_blocks: int
    total_blocks: int
    block_size: int
    max_model_len: int
    # Forward time the suspended step (an offline batch an arrival aborted) has run: lost if a plan
    # reschedules any of its requests instead of continuing it.
    suspended_ms: float = 0.0
    # Of free_blocks, those holding a prefix an online request found cached (Echo: an offline burst
    # must not flush the online system prompt; policy/planner.py keeps offline allocations off them).
    online_reused_free_blocks: int = 0

    def by_class(self, cls: RequestClass) -> list[SeqView]:
        return [s for s in self.seqs if s.request_class is cls]

    @property
    def online(self) -> list[SeqView]:
        return self.by_class(RequestClass.ONLINE)

    @property
    def offline(self) -> list[SeqView]:
        return self.by_class(RequestClass.OFFLINE)

    def blocks_for(self, seq: SeqView, num_new_tokens: int) -> int:
        """Extra device blocks seq needs to compute num_new_tokens more tokens (a cached prefix's
        blocks counted: a free cached block leaves the free count when it is mapped)."""
        needed = -(-(seq.num_context_tokens + num_new_tokens) // self.block_size)
        return max(0, needed - seq.num_blocks)


@dataclass(frozen=True)
class Scheduled:
    seq_id: str
    num_tokens: int


@dataclass(frozen=True)
class StepPlan:
    """The policy's decision for one step.

    scheduled: which sequences run and how many of their pending tokens (online first).
    preempt: running sequences to take off the device before the step (their blocks are freed;
      the mechanism keeps what is checkpointed on the host and recomputes the rest).
    preemptible: the step may be aborted at layer safepoints when online work arrives
      (ConServe §4.3: only for pure offline batches).
    resume: continue the suspended step (the one an arrival aborted) from its safepoint instead
      of scheduling anew; scheduled and preempt are then empty.
    """

    scheduled: tuple[Scheduled, ...] = ()
    preempt: tuple[str, ...] = ()
    preemptible: bool = False
    mode: str = "idle"
    info: dict = field(default_factory=dict)
    resume: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass(frozen=True)
class RunningStep:
    """The step the scheduler is executing now, as Algorithm 2 (ConServe §4.3) judges it."""

    shape: BatchShape
    started_s: float
    preemptible: bool
    layer_reached: int = 0  # the last safepoint it passed (0: still in its first layer)


class SchedulingPolicy(Protocol):
    """What the scheduler asks of a policy; the defaults suit a policy without a latency model.

    A policy subclasses this to inherit the defaults (typing.Protocol allows that). Every ability a
    caller may use is declared here with its default, so no caller probes a policy for it.
    """

    name: str
    # The step-latency model the policy plans with (the server's admission reads it); None: none.
    latency: LatencyModel | None = None
    # Each planned step's predicted time against the time it took (ConServe §4.5); None: not logged.
    model_error: ModelErrorLog | None = None
    # Measured over predicted step time, followed online and applied to its estimates; None: none.
    latency_drift: LatencyDrift | None = None

    @property
    def slo(self) -> SLO | None:
        """The SLOs the policy plans to (a co-located finetuning job's decode target); None: none."""
        return None

    def correction_for(self, num_tokens: int) -> float:
        """Measured over estimated step time the policy applies to a step of num_tokens (1.0: none)."""
        return 1.0

    def observe_swap(self, report: SwapReport) -> None:
        """The KV pager's report at a step boundary (AQUA §7: paging share of step time)."""
        return None

    def schedule(self, state: SchedulerState) -> StepPlan:
        """The next step's plan for this snapshot."""
        ...

    def should_abort_step(self, state: SchedulerState, step: RunningStep) -> bool:
        """An online request arrived (state.online) while step runs: abort it at its next safepoint?"""
        return False

    def observe_step(self, shape: BatchShape, duration_ms: float) -> None:
        """A step of this shape ran to its end in duration_ms (to correct a latency model)."""
        return None
