"""A model runner that costs steps instead of running them, on a virtual clock.

It has ModelRunner's interface (`kv`, `config`, `execute(chunks, safepoint, resume)`), so the real
Scheduler, its policies and its KV pool drive it unchanged: the simulator replays a workload
through the same decisions the engine takes, in a fraction of the time and for machines we do not
have (a step-cost table of another accelerator). What it leaves out is said where it matters:
host copies (checkpoint, restore) cost no time, and no token is computed (a step's logits are
zeros, so greedy sampling yields token 0; the workloads it replays ignore EOS).

A step's time, from `StepCost`, is spread over its layers the way the engine's forward meets its
safepoints (backfill/engine/model.py): three per layer (before attention, before gate/up, before
down; the first layer's first is skipped) and LM_HEAD_SLICES in the LM head. Each layer's share is
split 1/4 attention, 1/2 gate/up, 1/4 down (the MLP is three quarters of a Llama layer's weights),
and the LM head's share is its weights times the rows that want logits, against the layers'
weights times all tokens. An online arrival due during a step is delivered at the next safepoint,
where the scheduler's Algorithm 2 may abort the step; an aborted step is suspended and continues
from that safepoint when resumed, as on the real engine.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np
import torch

from backfill.engine.config import ModelConfig, SafepointLayout
from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.model import LAYER_STRETCH_SHARES, LM_HEAD_SLICES
from backfill.engine.step import Safepoint
from backfill.engine.runner import StepOutput
from backfill.engine.step import SeqChunk
from backfill.engine.step import SuspendedStep
from backfill.errors import InvalidRequestError
from backfill.policy.latency_model import BatchShape


class StepCost(Protocol):
    """How long a step of this shape takes on the simulated machine, in ms. A LatencyModel is one:
    the machine then behaves exactly as the policy's profile says."""

    def estimate_ms(self, shape: BatchShape) -> float: ...


class VirtualClock:
    """Seconds since the simulation started; only the simulator moves it."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance_ms(self, ms: float) -> None:
        if ms < 0:
            raise ValueError(f"the clock cannot go back ({ms} ms)")
        self.now_s += ms / 1e3

    def advance_to(self, t_s: float) -> None:
        self.now_s = max(self.now_s, t_s)


def sim_model_config(real: ModelConfig) -> ModelConfig:
    """The real model's layer count and context length, with a one-float KV row and a byte-sized
    vocabulary: the KV pool keeps the real number of blocks at almost no memory."""
    return ModelConfig(vocab_size=256, hidden_size=1, intermediate_size=1, num_layers=real.num_layers,
                       num_heads=1, num_kv_heads=1, max_position_embeddings=real.max_position_embeddings,
                       name=f"sim-{real.name}")


class SimulatedRunner:
    device_sampler = None  # samples on the host, as ModelRunner does without one
    warming_up = False     # nothing compiles in the background

    def __init__(self, real_config: ModelConfig, num_kv_blocks: int, cost: StepCost, clock: VirtualClock, *,
                 block_size: int = 16, on_time: Callable[[float], None] = lambda now_s: None,
                 step_overhead_ms: float = 0.0, noise_cv: float = 0.0, seed: int = 0) -> None:
        if step_overhead_ms < 0 or noise_cv < 0:
            raise InvalidRequestError("step_overhead_ms and noise_cv must be >= 0")
        self.real_config = real_config
        self.kv = KVBlockPool(sim_model_config(real_config), num_kv_blocks, block_size)
        self.cost = cost
        self.clock = clock
        self.on_time = on_time  # delivers what is due by now (the simulator's arrivals)
        self.step_overhead_ms = step_overhead_ms
        self.noise_cv = noise_cv
        self._rng = np.random.default_rng(seed)
        self.device = torch.device("cpu")
        c = real_config
        kv_dim = c.num_kv_heads * c.head_dim
        self._layer_weights = c.num_layers * (c.hidden_size * (c.hidden_size + 2 * kv_dim) + c.hidden_size ** 2
                                              + 3 * c.hidden_size * c.intermediate_size)
        self._head_weights = c.vocab_size * c.hidden_size

    @property
    def config(self) -> ModelConfig:
        return self.kv.config

    @property
    def safepoint_layout(self) -> SafepointLayout:
        return SafepointLayout(self.real_config.num_layers, max(LAYER_STRETCH_SHARES))

    def _noise(self) -> float:
        if self.noise_cv == 0:
            return 1.0
        sigma = np.sqrt(np.log1p(self.noise_cv ** 2))
        return float(self._rng.lognormal(-sigma ** 2 / 2, sigma))  # mean 1

    def _stretches(self, step_ms: float, num_tokens: int, num_logits: int) -> tuple[list[int], list[float]]:
        """The safepoint layer checked before each stretch of work (-1: none) and the stretch's ms."""
        layers_w = self._layer_weights * num_tokens
        head_w = self._head_weights * num_logits
        per_layer_ms = step_ms * layers_w / (layers_w + head_w) / self.real_config.num_layers
        head_ms = max(0.0, step_ms - per_layer_ms * self.real_config.num_layers)  # no logits: 0, not -1e-14
        checks: list[int] = []
        ms: list[float] = []
        for li in range(self.real_config.num_layers):
            for stage, share in enumerate(LAYER_STRETCH_SHARES):
                checks.append(-1 if li == 0 and stage == 0 else li)
                ms.append(per_layer_ms * share)
        for _ in range(LM_HEAD_SLICES):
            checks.append(self.real_config.num_layers)
            ms.append(head_ms / LM_HEAD_SLICES)
        return checks, ms

    def execute(self, chunks: list[SeqChunk], safepoint: Safepoint | None = None,
                resume: SuspendedStep | None = None) -> StepOutput:
        if not chunks:
            return StepOutput(None, [], duration_s=0.0)
        shape = BatchShape()
        for chunk in chunks:
            end = chunk.start_pos + len(chunk.token_ids)
            if not chunk.token_ids or len(chunk.block_table) * self.kv.block_size < end:
                raise ValueError(f"sequence {chunk.seq_id}: empty chunk or block table too short for {end} tokens")
            shape = shape.plus(len(chunk.token_ids), chunk.start_pos)
        logit_ids = tuple(c.seq_id for c in chunks if c.want_logits)
        if resume is None:
            self.clock.advance_ms(self.step_overhead_ms)
            step_ms = self.cost.estimate_ms(shape) * self._noise()
            checks, stretch_ms = self._stretches(step_ms, shape.num_tokens, len(logit_ids))
            first = 0
        else:
            (checks, stretch_ms), first = resume.carry, resume.stage
        ran_ms = 0.0
        for i in range(first, len(checks)):
            self.on_time(self.clock())
            if checks[i] >= 0 and safepoint is not None and safepoint(checks[i]):
                ran_s = (resume.ran_s if resume is not None else 0.0) + ran_ms / 1e3
                suspended = SuspendedStep(checks[i], i, (tuple(checks), tuple(stretch_ms)))
                suspended.attach_batch(chunks, (), logit_ids, ran_s)
                return StepOutput(None, [], aborted=True, aborted_at_layer=checks[i], duration_s=ran_ms / 1e3,
                                  num_tokens=shape.num_tokens, suspended=suspended)
            self.clock.advance_ms(stretch_ms[i])
            ran_ms += stretch_ms[i]
        self.on_time(self.clock())
        logits = torch.zeros(len(logit_ids), self.config.vocab_size)
        return StepOutput(logits, list(logit_ids), duration_s=ran_ms / 1e3, num_tokens=shape.num_tokens)
