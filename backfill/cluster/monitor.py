"""Valve §6 SLA monitor: evict an offline job that persistently misses its throughput SLA.

Each check hands the monitor the throughput a job delivered since the previous check. A job is
evicted (to be placed again elsewhere) after `misses_to_evict` consecutive checks below
tolerance x SLA; one good check clears its record, so a single burst of online load does not
move a job whose node still serves it on average.
"""

from __future__ import annotations

from dataclasses import dataclass

from backfill.errors import ClusterInputError


@dataclass(frozen=True)
class MonitorConfig:
    misses_to_evict: int = 3
    tolerance: float = 0.95      # a check counts as a miss below tolerance x SLA

    def __post_init__(self) -> None:
        if not isinstance(self.misses_to_evict, int) or self.misses_to_evict < 1:
            raise ClusterInputError(f"misses_to_evict must be an integer >= 1, got {self.misses_to_evict!r}")
        if not 0 < self.tolerance <= 1:
            raise ClusterInputError(f"tolerance must lie in (0, 1], got {self.tolerance}")


class SLAMonitor:
    def __init__(self, config: MonitorConfig = MonitorConfig()) -> None:
        self.config = config
        self._misses: dict[str, int] = {}

    def observe(self, job_id: str, measured_tokens_per_s: float, sla_tokens_per_s: float) -> bool:
        """Record one check; True when the job should be evicted now."""
        if measured_tokens_per_s < self.config.tolerance * sla_tokens_per_s:
            self._misses[job_id] = self._misses.get(job_id, 0) + 1
        else:
            self._misses[job_id] = 0
        return self._misses[job_id] >= self.config.misses_to_evict

    def misses(self, job_id: str) -> int:
        return self._misses.get(job_id, 0)

    def forget(self, job_id: str) -> None:
        """The job left its node (evicted, finished, or its node died): start its record afresh."""
        self._misses.pop(job_id, None)
