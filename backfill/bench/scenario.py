"""The co-serving benchmark's scenario: online trace, offline backlog, SLOs and rounds.

Its fields are the flags of `backfill bench coserve`, `bench server` and `sim coserve`
(backfill/options.py); kept free of numpy and torch at import so `backfill --help` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from backfill.errors import InvalidRequestError
from backfill.options import knob


@dataclass(frozen=True)
class CoserveScenario:
    duration_s: float = knob(90.0, "seconds of online trace per mode", group="scenario", option="duration")
    online_load: float = knob(0.3, "online arrival rate as a fraction of online capacity", group="scenario")
    cv: float = knob(1.0, "coefficient of variation of online inter-arrival times", group="scenario")
    prompt_len: str = knob("uniform:64:256", "online prompt tokens (a length spec)", group="scenario")
    output_len: str = knob("uniform:16:64", "online output tokens (a length spec)", group="scenario")
    offline_prompt_len: str = knob("uniform:128:384", "offline prompt tokens (a length spec)", group="scenario")
    offline_output_len: str = knob("uniform:64:192", "offline output tokens (a length spec)", group="scenario")
    offline_concurrency: int = knob(48, "offline requests kept in flight (closed loop)", group="scenario")
    offline_pool: int = 4000
    seed: int = knob(0, "seed of the traces and prompts", group="scenario")
    # Unset: the policies get online-only's own P99 from the same run ("keep my latency where it is alone").
    ttft_slo_ms: float | None = knob(None, "online TTFT SLO, ms; unset: online-only's P99 in this run",
                                     group="scenario")
    tpot_slo_ms: float | None = knob(None, "online TPOT SLO, ms; unset: online-only's P99 in this run",
                                     group="scenario")
    # A noisy neighbour, the same schedule in every mode (bench/cpu_hog.py; simulated: sim coserve).
    slowdown_at_s: float | None = knob(None, "slow the machine this many seconds into each mode's run of each round "
                                       "(a busy loop pinned to one core, stopped at the run's end)", group="scenario")
    # Interleaved rounds compare modes run minutes apart less on a machine whose speed drifts.
    rounds: int = knob(1, "interleave the modes in this many rounds of duration/rounds each and pool them",
                       group="rounds")
    # The first mode would otherwise run on an idle machine while the others follow a busy one.
    warmup_s: float = knob(30.0, "offline batching before the first round, not measured (0: none)", group="rounds")

    def __post_init__(self) -> None:
        from backfill.bench.lengths import parse_length_spec

        if not self.duration_s > 0 or not 0 < self.online_load <= 1.0 or not self.cv > 0:
            raise InvalidRequestError("need duration_s > 0, 0 < online_load <= 1 and cv > 0")
        if self.slowdown_at_s is not None and not self.slowdown_at_s >= 0:
            raise InvalidRequestError(f"slowdown_at_s must be >= 0, got {self.slowdown_at_s}")
        if self.rounds < 1:
            raise InvalidRequestError(f"rounds must be >= 1, got {self.rounds}")
        if not self.warmup_s >= 0:
            raise InvalidRequestError(f"warmup_s must be >= 0, got {self.warmup_s}")
        for spec in (self.prompt_len, self.output_len, self.offline_prompt_len, self.offline_output_len):
            parse_length_spec(spec)
