"""Adaptive incremental checkpointing of offline KV to host memory (ConServe §4.4, §5).

Checkpointing starts when device KV use passes a threshold (50% by default) and covers only a
few offline requests at first; the share grows as usage rises and grows faster while usage
keeps increasing, like random early detection. Below the threshold nothing is copied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from backfill.errors import InvalidRequestError
from backfill.policy.interface import SchedulerState


@dataclass(frozen=True)
class CheckpointConfig:
    start_usage: float = 0.5   # ConServe default threshold
    full_usage: float = 0.9    # at and above: checkpoint every running offline request
    min_new_tokens: int = 1    # skip requests with fewer uncheckpointed tokens than this
    enabled: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.start_usage < self.full_usage <= 1.0:
            raise InvalidRequestError("need 0 <= start_usage < full_usage <= 1")


class AdaptiveCheckpointPolicy:
    def __init__(self, config: CheckpointConfig = CheckpointConfig()) -> None:
        self.config = config
        self._last_usage = 0.0
        self._ramp = 0.0  # extra share earned by consecutive usage increases

    def select(self, state: SchedulerState) -> list[str]:
        """Offline requests whose new KV blocks should be copied to the host after this step."""
        cfg = self.config
        usage = 1.0 - state.free_blocks / state.total_blocks
        rising = usage > self._last_usage
        self._last_usage = usage
        if not cfg.enabled or usage < cfg.start_usage:
            self._ramp = 0.0
            return []
        self._ramp = min(1.0, self._ramp + 0.1) if rising else max(0.0, self._ramp - 0.05)
        base = (usage - cfg.start_usage) / (cfg.full_usage - cfg.start_usage)
        share = min(1.0, base + self._ramp)
        candidates = [s for s in state.offline
                      if s.running and s.num_computed_tokens - s.num_checkpointed_tokens >= cfg.min_new_tokens]
        # Oldest first: they hold the most KV and are the cheapest victims once copied.
        candidates.sort(key=lambda s: s.arrival_s)
        count = math.ceil(share * len(candidates))
        return [s.seq_id for s in candidates[:count]]
