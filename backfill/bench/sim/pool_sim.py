"""The node benchmark's memory side in simulated time: the real SharedMemoryPool and MIAD policy,
no engines.

Online requests arrive on the benchmark's own trace (bench.make_trace); each one
needs KV for its prompt and grows by a token per decode step, and the online engine allocates
handles when it runs short and gives back whole handles it no longer needs, as
node_engines/online_engine.py does. The offline engine takes every free handle at once (memory-bound
offline, Valve §5's setting). Seconds of benchmark become milliseconds here, so MIAD settings can
be compared over many seeds and long horizons before a real run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from backfill.errors import PolicyInputError
from backfill.bench.node_bench import REFERENCE_ARRIVALS, NodeBenchConfig, make_trace
from backfill.memory.shared_pool import EngineRole, PoolConfig, SharedMemoryPool
from backfill.policy.miad import MIADReservation
from backfill.policy.reclaim import GreedyReclaimPolicy


@dataclass(frozen=True)
class PoolSimResult:
    duration_s: float
    pressure_events: int
    reclamations: int
    reclaimed_handles: int
    mean_offline_handles: float

    @property
    def reclamations_per_min(self) -> float:
        return self.reclamations * 60.0 / self.duration_s


def simulate_pool(config: NodeBenchConfig = NodeBenchConfig(), *, step_s: float = 0.065,
                  vocab_size: int = 49152) -> PoolSimResult:
    """config's trace, pool and MIAD settings; one online decode step (every active request +1
    token) per step_s of simulated time. vocab_size keeps the trace's random draws aligned with a
    run on the default model."""
    if not step_s > 0:
        raise PolicyInputError(f"step_s must be > 0, got {step_s}")
    if config.arrivals is None:  # no machine to size to: the rate the benchmark's docs figures ran at
        config = replace(config, arrivals=REFERENCE_ARRIVALS)
    online_trace, _ = make_trace(config, vocab_size)
    requests = [(t, len(d["prompt_token_ids"]), d["max_tokens"]) for t, d in online_trace]
    num_handles, blocks_per_handle, block_size = config.num_handles, config.blocks_per_handle, config.block_size
    duration_s = config.duration_s

    pool = SharedMemoryPool(PoolConfig(num_handles, blocks_per_handle), reclaim_policy=GreedyReclaimPolicy(),
                            reservation=MIADReservation(config.miad))
    pool.register("online", EngineRole.ONLINE)
    pool.register("offline", EngineRole.OFFLINE)
    held: list[int] = []
    active: list[list[int]] = []   # [tokens with KV after this step, decode steps left]
    offline_held: list[int] = []
    next_request, t = 0, 0.0

    def blocks_needed() -> int:
        return sum(math.ceil((tokens + 1) / block_size) for tokens, _ in active)

    while t < duration_s or active:
        while next_request < len(requests) and requests[next_request][0] <= t:
            _, n, out = requests[next_request]
            active.append([n, out])
            next_request += 1
        if active:
            short = blocks_needed() - len(held) * blocks_per_handle
            if short > 0:
                held += pool.allocate("online", math.ceil(short / blocks_per_handle), t)
            for request in active:
                request[0] += 1
                request[1] -= 1
            active = [r for r in active if r[1] > 0]
            spare = (len(held) * blocks_per_handle - blocks_needed()) // blocks_per_handle
            if spare > 0:
                pool.release("online", held[-spare:], t)
                del held[-spare:]
        pool.tick(t)
        if pool.free_handles:
            pool.allocate("offline", pool.free_handles, t)
        offline_held.append(len(pool.handles_of("offline")))
        t += step_s
    return PoolSimResult(duration_s, pool.reservation.pressure_events, pool.stats.reclamations,
                         pool.stats.reclaimed_handles, float(np.mean(offline_held)))
