"""What coserve's co-serving steps carry in `sim coserve` on the corrected H200 profile (docs/coserving.md).

Runs priority, coserve and the given coserve variants at one online load with SLOs of 200 / 15 ms
(40 s, one round, as the frontier) and prints, per mode, offline tok/s against priority's and the
means over its co-serving plans: online tokens, offline decodes, offline prompt tokens, the planned
step time, the budget, and the offline requests decoding and waiting for their prompts.

    PYTHONPATH=. python scripts/coserve_step_mix.py LOAD [VARIANT ...]

PROFILE=path picks another machine profile; MIXED=0 prices steps with prompt chunks eagerly.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections import defaultdict
from dataclasses import replace

from backfill.bench.scenario import CoserveScenario
from backfill.engine.weights import random_model_name
from backfill.options import build
from backfill.policy import coserve
from backfill.serving.config import ServingConfig
from backfill.bench.sim.coserve_sim import load_inputs, simulate_coserve

COLUMNS = ("online tokens", "offline decodes", "offline prompt tokens", "planned ms", "budget ms",
           "offline decoding", "offline waiting for prompt")


def main() -> int:
    load, variants = float(sys.argv[1]), sys.argv[2:]
    plans: dict[object, list[tuple]] = defaultdict(list)
    plan_step = coserve.CoServePolicy._co_serving

    def recorded(policy, state):
        plan = plan_step(policy, state)
        online = {s.seq_id for s in state.online}
        offline = {s.seq_id: s for s in state.offline}
        rows = [(x, offline.get(x.seq_id)) for x in plan.scheduled]
        plans[policy.config].append((
            sum(x.num_tokens for x, _ in rows if x.seq_id in online),
            sum(1 for _, s in rows if s is not None and not s.in_prefill),
            sum(x.num_tokens for x, s in rows if s is not None and s.in_prefill),
            policy._planned[1], plan.info.get("budget_ms", 0.0),
            sum(1 for s in state.offline if not s.in_prefill), sum(1 for s in state.offline if s.in_prefill)))
        return plan

    coserve.CoServePolicy._co_serving = recorded
    serving = ServingConfig(model=random_model_name("llama3-8b"), dtype="bfloat16", kv_cache_gb=24,
                            mixed_graphs=os.environ.get("MIXED", "1") != "0")
    scenario = build(CoserveScenario, {"duration": 40.0, "rounds": 1, "online_load": load, "warmup_s": 0.0,
                                       "ttft_slo_ms": 200.0, "tpot_slo_ms": 15.0})
    profile = os.environ.get("PROFILE", "docs/results/h200-llama3-8b/profile-corrected.json")
    config, latency, machine = load_inputs(serving, profile)
    modes = ("priority", "coserve", *variants)
    results = simulate_coserve(scenario, machine, latency, config, serving, modes, None, log=lambda *a: None)
    priority = results["priority"].metrics.offline.tokens_per_s
    for (name, result), steps in zip(list(results.items())[1:], plans.values()):
        tok_s = result.metrics.offline.tokens_per_s
        means = ", ".join(f"{c} {statistics.mean(v):.2f}" for c, v in zip(COLUMNS, zip(*steps)))
        print(f"{name}: offline {tok_s:,.0f} tok/s = {tok_s / priority:.3f}x priority; {len(steps)} co-serving "
              f"steps, means: {means}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
