"""The co-serving policy's knobs (ConServe §4.2-§4.5): SLOs, the preemption target and the margins
its budget is planned to (its batch limits are every policy's, ServingConfig.limits). A config module apart from the policy, so serving's config,
the CLI and the benchmarks read the knobs without the policy's code."""

from __future__ import annotations

from dataclasses import dataclass

from backfill.errors import InvalidRequestError
from backfill.options import knob
from backfill.types import SLO


@dataclass(frozen=True)
class CoServeConfig:
    slo: SLO = SLO()
    # An arrival waits for the rest of one stretch between two safepoints (ConServe §4.3); planned
    # below the bound it promises, as step estimates err on a loaded machine.
    preempt_target_ms: float = knob(8.0, "longest offline work between two safepoints, ms", group="coserve")
    offline_batch_max_tokens: int = knob(2048, "largest offline batch, tokens", group="coserve")
    offline_batch_max_seqs: int = knob(256, "largest offline batch, sequences (vLLM's max_num_seqs)",
                                       group="coserve")
    online_reserve_fraction: float = knob(0.1, "share of KV blocks kept free for online arrivals when offline "
                                          "work is admitted", group="coserve")
    interference_slack: float | None = knob(0.05, "a co-serving step may take at most (1 + this) x its online "
                                            "work alone, and an arrival waits for an offline step at most this "
                                            "share of its own prefill (inf: no cap)", group="coserve")
    slo_margin: float = knob(0.85, "co-serving steps are planned to this share of the SLO budget",
                             group="coserve")
    bank_tpot_slack: bool = knob(True, "a decoding online request may spend the time it banked by running "
                                 "faster than its TPOT SLO", group="coserve")
    bank_step_max_slos: float = knob(3.0, "a step spending banked time takes at most this many TPOT SLOs (the SLO "
                                     "bounds a request's mean time per token, not each step)", group="coserve")
    bank_reserve_prefills: float = knob(1.0, "banked time kept back for this many future online prefills",
                                        group="coserve")
    rider_cost_share: float = knob(1.0, "offline tokens ride in a co-serving step only while they add at most this "
                                   "share of what an offline batch spends on them (1: break-even)", group="coserve")
    prefill_riders: bool = knob(True, "co-serving steps carry offline prompt chunks as well as offline decodes",
                                group="coserve")
    prefill_cost_share: float = knob(1.0, "an offline prompt chunk rides only while it adds at most this "
                                     "share of what an offline batch spends on its tokens (inf: the SLO budget alone "
                                     "decides, as in ConServe Algorithm 1)", group="coserve")
    slo_margin_max: float = knob(0.85, "the most of the SLO budget an adapted margin plans to", group="coserve")
    adapt_margin: bool = knob(True, "the share of the SLO budget planned follows the latency model's measured "
                              "error on recent co-serving steps (slo_margin until enough are seen)", group="coserve")
    release_suspended: bool = knob(True, "co-serving steps may take requests of the offline step an arrival "
                                   "suspended, where that pays for the step's lost work", group="coserve")
    follow_drift: bool = knob(True, "step estimates follow measured over predicted step time online, so budgets "
                              "shrink on a machine that slows (policy/drift.py)", group="coserve")

    def __post_init__(self) -> None:
        if not self.preempt_target_ms > 0:
            raise InvalidRequestError(f"preempt_target_ms must be positive, got {self.preempt_target_ms}")
        if not 0.0 <= self.online_reserve_fraction < 1.0:
            raise InvalidRequestError("online_reserve_fraction must be in [0, 1)")
        if self.interference_slack is not None and self.interference_slack < 0:
            raise InvalidRequestError("interference_slack must be >= 0")
        if not 0.0 < self.slo_margin <= 1.0:
            raise InvalidRequestError("slo_margin must be in (0, 1]")
        if not 0.0 < self.slo_margin_max <= 1.0:
            raise InvalidRequestError("slo_margin_max must be in (0, 1]")
        if not self.bank_step_max_slos >= 1.0:
            raise InvalidRequestError("bank_step_max_slos must be >= 1")
        if not self.bank_reserve_prefills >= 0:
            raise InvalidRequestError("bank_reserve_prefills must be >= 0")
        if not self.rider_cost_share >= 0:
            raise InvalidRequestError("rider_cost_share must be >= 0")
        if not self.prefill_cost_share >= 0:
            raise InvalidRequestError("prefill_cost_share must be >= 0")
        if self.offline_batch_max_tokens < 1 or self.offline_batch_max_seqs < 1:
            raise InvalidRequestError("offline_batch_max_tokens and offline_batch_max_seqs must be >= 1")
