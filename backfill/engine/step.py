"""The engine's step types: what a step is fed (SeqChunk), the check between its layers (Safepoint),
and a step stopped at a safepoint (StepAborted, carrying a SuspendedStep to continue instead of redo).

ConServe §4.3 aborts a running offline step at a layer safepoint when an online request
arrives; continuing it later saves the layers it had already run. One object carries that
step from the forward pass that stopped (the model raises StepAborted with it) through the
runner (which adds the batch it was running) to the scheduler (which keeps it until a plan
says resume, or drops it when one of its sequences changes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from backfill.engine.lora import LoraAdapter

# Called between layers with the layer about to run; True: stop the step there (ConServe §4.3).
Safepoint = Callable[[int], bool]


@dataclass
class SeqChunk:
    """Feed token_ids to one sequence whose first start_pos tokens are already in the KV cache.

    block_table must already cover start_pos + len(token_ids) tokens.
    """

    seq_id: int | str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    want_logits: bool = True
    adapter: LoraAdapter | None = None  # a LoRA adapter applied to this sequence's tokens (engine/lora.py)
    online: bool = False  # an online request's tokens: a node's gate never parks a step carrying them

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.start_pos > 0


class StepAborted(Exception):
    """Raised inside forward when the safepoint asks to abort: the layer reached and, where the
    path can continue from there (the eager one), the suspended step to continue."""

    def __init__(self, layer: int, suspended: SuspendedStep | None = None) -> None:
        super().__init__(f"step aborted before layer {layer}")
        self.layer = layer
        self.suspended = suspended


@dataclass
class SuspendedStep:
    """Where an aborted step stopped, what it was running, and what it assumes still holds.

    layer is the safepoint reached (num_layers: inside the LM head) and stage the position within
    it, in the terms of the runner that made it (the model's: 0 before attention, 1 before the
    MLP, 2 before the down projection, or the LM-head slice; the simulator's: the stretch index).
    carry is what that runner needs to go on: the model's hidden rows and activations, the
    simulator's stretch plan. The step is valid only while every sequence in it has the KV
    position and block table it had when it stopped (kv_state): a cancel, preemption or
    reclamation in between voids it.
    """

    layer: int
    stage: int
    carry: tuple[Any, ...] = ()
    chunks: tuple[SeqChunk, ...] = ()
    prepared: tuple[Any, ...] = ()                # the runner's prepared batch, reused on resume
    logit_ids: tuple[int | str, ...] = ()
    ran_s: float = 0.0                            # forward time run over all its attempts
    kv_state: dict[int | str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks)

    def attach_batch(self, chunks: list[SeqChunk], prepared: tuple[Any, ...], logit_ids: list[int | str] | tuple,
                     ran_s: float) -> SuspendedStep:
        """Complete this stop with the batch the runner was running and the step's forward time so far."""
        self.chunks = tuple(chunks)
        self.prepared = prepared
        self.logit_ids = tuple(logit_ids)
        self.ran_s = ran_s
        self.kv_state = {chunk.seq_id: kv_fingerprint(chunk.start_pos, chunk.block_table) for chunk in chunks}
        return self

    def holds_for(self, kv_state_now: dict[int | str, tuple[int, tuple[int, ...]] | None]) -> bool:
        """Each of its sequences is where the step left it (None: the sequence is gone)."""
        return all(kv_state_now.get(seq_id) == state for seq_id, state in self.kv_state.items())


def kv_fingerprint(num_computed: int, block_table: list[int]) -> tuple[int, tuple[int, ...]]:
    """A sequence's KV position and blocks, compared to decide whether a suspended step still holds."""
    return num_computed, tuple(block_table)
